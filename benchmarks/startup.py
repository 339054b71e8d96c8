"""Engine startup benchmark: how many step variants an engine compiles, how long that takes, and how many
programs a varied request mix compiles after it (the answer should be none).

Random weights of a real model shape are made on the device (no checkpoint on disk); the engine is
configured as a GPU server would be. A row per engine configuration:

    python -m benchmarks.startup --shape 1b --max-num-seqs 256 --max-step-tokens 8192 \
        --max-model-len 32768                                   # GPU: the serving configuration
    python -m benchmarks.startup --shape small --max-num-seqs 8 --max-step-tokens 64 \
        --max-model-len 512                                     # CPU smoke run

`--cache DIR` points JAX's persistent compilation cache at DIR, so running the command twice gives the
cold and the warm startup.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.harness import SHAPES, append_jsonl, command_line, describe_device, random_model


def request_mix(engine, vocab: int, seed: int = 0) -> tuple[int, str]:
    """Plain greedy and sampled requests of short and long prompts, several at once, and one per
    compression press; runs them to the end and returns how many requests finished and a digest of every
    request's tokens (equal across runs when the programs compute the same: seeded sampling)."""
    import hashlib

    from jaxkv.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    longest = min(engine.max_model_len - 64, 4 * engine.scheduler.max_step_tokens)
    lengths = [n for n in (5, 40, 300) if n < longest // 2] + [longest // 2, longest]
    n = 0
    for i, length in enumerate(lengths):
        for temperature in (0.0, 0.8):
            ids = rng.integers(3, vocab, size=length).tolist()
            engine.add_request(ids, SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True,
                                                   seed=i))
            n += 1
    for press in ("snapkv", "streaming_llm", "h2o", "hardkv"):
        ids = rng.integers(3, vocab, size=min(600, longest)).tolist()
        try:
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                               kv_policy=press, kv_budget=0.25)
            n += 1
        except ValueError as e:  # a press that needs files this random model lacks (HARD-KV calibration)
            print(f"  skipped {press}: {e}")
    done, tokens = 0, {}
    while engine.has_unfinished():
        for o in engine.step():
            done += o.finished
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return done, hashlib.sha256(repr([tokens[k] for k in sorted(tokens)]).encode()).hexdigest()[:16]


def _seconds(compilations) -> dict:
    """Where compile time went: per stage, and the five slowest functions."""
    if not hasattr(compilations, "seconds"):
        return {}
    stages, programs = compilations.seconds()
    top = sorted(programs.items(), key=lambda kv: -kv[1])[:5]
    return {"stage_s": {k.rsplit("/", 1)[-1]: round(v, 1) for k, v in stages.items()},
            "slowest_s": {k: round(v, 1) for k, v in top}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-step-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--cache", default=None, help="persistent compilation cache directory ('' = off)")
    ap.add_argument("--no-mix", action="store_true", help="skip the request mix after startup")
    ap.add_argument("--first-request", type=int, default=0, metavar="N",
                    help="no precompile: time one request of N prompt tokens + 16 decoded on a fresh engine "
                         "twice (the first compiles what it needs) instead")
    ap.add_argument("--json", default=None)
    ap.add_argument("--progress", action="store_true", help="progress bar while compiling")
    args = ap.parse_args(argv)
    start = time.perf_counter()

    import os

    if args.cache is not None:
        os.environ["JAXKV_COMPILATION_CACHE"] = args.cache
    from jaxkv.engine import warmup
    from jaxkv.engine.engine import Engine

    try:
        from jaxkv.engine import compilations
    except ImportError:  # a jaxkv without the counters (timing an older tree side by side)
        class compilations:  # noqa: N801
            install = staticmethod(lambda: None)
            xla_programs = staticmethod(lambda: {"compiled": 0, "persistent_cache": 0})
            step_programs = staticmethod(lambda: 0)

    compilations.install()
    model = random_model(args.shape, args.dtype, args.max_model_len)

    def make_engine():
        return Engine(model, max_num_seqs=args.max_num_seqs, max_step_tokens=args.max_step_tokens,
                      max_model_len=args.max_model_len, kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                      enable_prefix_caching=False)

    if args.first_request:
        from jaxkv.sampling import SamplingParams

        times = []
        for _ in range(2):
            engine = make_engine()
            ids = np.random.default_rng(0).integers(3, model.config.vocab_size, args.first_request).tolist()
            t0 = time.perf_counter()
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - t0)
        row = dict(shape=args.shape, first_request_tokens=args.first_request, cold_s=round(times[0], 2),
                   warm_s=round(times[1], 3), xla_programs=compilations.xla_programs(),
                   **_seconds(compilations))
        print(json.dumps(row), flush=True)
        return
    engine = make_engine()
    variants = len(warmup.variants(engine))
    t0 = time.perf_counter()
    engine.precompile(progress=args.progress)
    ready = time.perf_counter() - t0
    before_xla, before_steps = compilations.xla_programs(), compilations.step_programs()
    row = dict(shape=args.shape, max_num_seqs=args.max_num_seqs, max_step_tokens=args.max_step_tokens,
               max_model_len=args.max_model_len, variants=variants, ready_s=round(ready, 1),
               since_start_s=round(time.perf_counter() - start, 1),
               step_cache_hits=getattr(engine, "step_cache_hits", None),
               xla_programs_at_ready=before_xla, **_seconds(compilations))
    if not args.no_mix:
        t0 = time.perf_counter()
        row["mix_requests"], row["mix_tokens_digest"] = request_mix(engine, model.config.vocab_size)
        row["mix_s"] = round(time.perf_counter() - t0, 1)
        after = compilations.xla_programs()
        row["xla_compiled_in_mix"] = after["compiled"] - before_xla["compiled"]
        row["xla_cache_loads_in_mix"] = after["persistent_cache"] - before_xla["persistent_cache"]
        row["step_variants_in_mix"] = compilations.step_programs() - before_steps
    print(json.dumps(row), flush=True)
    if args.json:
        append_jsonl(args.json, row | {"command": command_line("benchmarks.startup", argv),
                                       "device": describe_device()})


if __name__ == "__main__":
    main()
