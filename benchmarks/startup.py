"""Engine startup benchmark: how many step variants an engine compiles, how long that takes, and how many
programs a varied request mix compiles after it (the answer should be none).

Random weights of a real model shape are made on the device (no checkpoint on disk); the engine is
configured as a GPU server would be. A row per engine configuration:

    python -m benchmarks.startup --shape 1b --max-num-seqs 256 --max-step-tokens 8192 \
        --max-model-len 32768                                   # GPU: the serving configuration
    python -m benchmarks.startup --shape small --max-num-seqs 8 --max-step-tokens 64 \
        --max-model-len 512                                     # CPU smoke run

`--cache DIR` points JAX's persistent compilation cache at DIR, so running the command twice gives the
cold and the warm startup. `--precompile-reuse` names the segment-reuse methods precompiled (default
`all`: at the GPU configuration RedKnot's 19 passes; the page copy naive and EPIC run before their ragged
steps; the selection program of each token bucket and the steps from the selection layer, which
CacheBlend and SparseX share; the device-built table of a many-row step), compiled in the step
variants' pool run, as the server does (`--reuse-apart`: in a run of their own after it).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time

import numpy as np

from benchmarks import host_trace
from benchmarks.harness import SHAPES, append_jsonl, command_line, describe_device, random_model
from jaxkv.engine.config import PER_REQUEST_RETRIEVAL_ROWS

REUSE_METHODS = ("naive", "epic", "cacheblend", "sparsex", "redknot")
log = logging.getLogger("benchmarks.startup")


def reuse_methods(value: str) -> list[str]:
    """`--precompile-reuse`: comma-separated reuse methods, or "all" (every method of the mix); names are
    checked here, before any model is made."""
    from jaxkv.policies.reuse import resolve_reuse

    if value.strip() == "all":
        return list(REUSE_METHODS)
    names = [m.strip() for m in value.split(",") if m.strip()]
    for name in names:
        try:
            resolve_reuse(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _run(engine) -> dict:
    """Runs every queued request to the end: request id -> its tokens."""
    tokens: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def request_kinds(engine, vocab: int, seed: int = 0, retrieval=None, presses=None) -> dict:
    """The request mix, kind by kind: name -> a function queuing that kind's requests on `engine`. Plain
    greedy and sampled requests of short and long prompts several at once, n > 1 (one prompt, several seeded
    samples, as the server fans it out), one per compression press, one per segment-reuse method on
    registered segments (engines whose heads all keep full history), and `retrieval` (a retrieval policy,
    e.g. SpeContext with its head) when given. `presses`: press names (default: every press the engine can
    run). Requests stop on length (ignore_eos)."""
    from jaxkv.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    longest = min(engine.max_model_len - 64, 4 * engine.scheduler.max_step_tokens)
    lengths = [n for n in (5, 40, 300) if n < longest // 2] + [longest // 2, longest]
    ids = lambda n: rng.integers(3, vocab, size=n).tolist()  # noqa: E731
    greedy = lambda **kw: SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)  # noqa: E731
    kinds = {}

    def plain(temperature):
        def add():
            for i, length in enumerate(lengths):
                engine.add_request(ids(length), SamplingParams(temperature=temperature, max_tokens=24,
                                                               ignore_eos=True, seed=i))
        return add

    kinds["greedy"], kinds["sampled"] = plain(0.0), plain(0.8)

    def n_samples():
        prompt = ids(min(300, longest))
        for i in range(4):
            engine.add_request(prompt, SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True,
                                                      seed=i))

    kinds["n=4"] = n_samples
    if presses is None:
        presses = [pol.name for pol in engine.compressor.precompile_policies()]
    press_len = min(600, engine.max_model_len - 64)  # past every press's window (SnapKV: 64)
    for name in presses:
        kinds[f"press:{name}"] = functools.partial(
            lambda name: engine.add_request(ids(press_len), greedy(), kv_policy=name, kv_budget=0.25),
            name)
    if not engine.tables.local.any():  # segment reuse needs every head's full history
        seg_len, question = max(16, min(512, longest // 4)), min(40, longest // 4)
        segments = [engine.register_segment(ids(seg_len), frozen=True) for _ in range(2)]
        for method in REUSE_METHODS:
            kinds[f"reuse:{method}"] = functools.partial(
                lambda m: engine.add_reuse_request(ids(question // 2), segments, ids(question), reuse=m,
                                                   sampling=greedy()),
                method)
    if retrieval is not None:
        kinds[f"retrieval:{retrieval.name}"] = lambda: [
            engine.add_request(ids(n), greedy(), kv_policy=retrieval) for n in lengths[-2:]]
    return kinds


def request_mix(engine, vocab: int, seed: int = 0, retrieval=None, compilations=None, presses=None,
                kinds=None) -> dict:
    """Runs `request_kinds` one kind after another; returns requests finished, a digest of every request's
    tokens (equal across runs when the programs compute the same: seeded sampling) and, with
    `compilations` (jaxkv.engine.compilations), the programs each kind compiled (should be none). `kinds`:
    only the kinds of these names."""
    import hashlib

    out, tokens, per_kind = {"requests": 0}, {}, {}
    for name, add in request_kinds(engine, vocab, seed, retrieval, presses).items():
        if kinds is not None and name not in kinds:
            continue
        before = None if compilations is None else (compilations.step_programs(),
                                                    compilations.xla_programs()["compiled"])
        log.info("mix kind %s", name)  # JAX_LOG_COMPILES's lines that follow are this kind's
        add()
        got = _run(engine)
        out["requests"] += len(got)
        tokens.update({f"{name}/{k}": v for k, v in got.items()})
        if before is not None:
            per_kind[name] = {"step_programs": compilations.step_programs() - before[0],
                              "xla_compiled": compilations.xla_programs()["compiled"] - before[1]}
            got_kind = per_kind[name]
            print(f"  {name}: {len(got)} requests; compiled after ready: {got_kind['step_programs']} step "
                  f"programs, {got_kind['xla_compiled']} XLA programs", flush=True)
    out["digest"] = hashlib.sha256(repr([tokens[k] for k in sorted(tokens)]).encode()).hexdigest()[:16]
    out["compiled_per_kind"] = per_kind
    return out


def random_retrieval_head(model, tap_layer: int = 1):
    """SpeContext with a random retrieval head of the model's shape (`specontext.init_head`, a fixed key),
    written as `save_head` does to one directory per model shape under the temporary directory: the random
    model ships none, and a restart finds the same head at the same path, as a server's would be, so the
    step cache keeps its programs."""
    import tempfile
    from pathlib import Path

    import jax

    from jaxkv.policies.retrieve import specontext as sc

    tap = min(tap_layer, model.config.num_layers - 1)
    cfg = sc.HeadConfig.for_model(model.config, tap_layer=tap, model_id=model.model_id)
    head = sc.init_head(cfg, jax.random.key(1))
    c = model.config
    name = f"jaxkv-random-head-{c.num_layers}x{c.hidden_size}x{c.num_kv_heads}-{c.vocab_size}-tap{tap}"
    path = sc.save_head(Path(tempfile.gettempdir()) / name, head, {"random": True})
    return sc.SpeContext(head_dir=str(path))


def _seconds(compilations) -> dict:
    """Where compile time went: per stage, and the five slowest functions."""
    if not hasattr(compilations, "seconds"):
        return {}
    stages, programs = compilations.seconds()
    top = sorted(programs.items(), key=lambda kv: -kv[1])[:5]
    return {"stage_s": {k.rsplit("/", 1)[-1]: round(v, 1) for k, v in stages.items()},
            "slowest_s": {k: round(v, 1) for k, v in top}}


def speed(engine, vocab: int, max_model_len: int) -> dict:
    """Time to first token of one prompt of max_model_len / 4 tokens (median of 3 after one untimed) and the
    wall time of 32 greedy streams of 1,000 prompt tokens + 256 decoded, all on the precompiled programs."""
    import statistics

    from jaxkv.sampling import SamplingParams

    rng = np.random.default_rng(1)
    n = max_model_len // 4
    ttft = []
    for _ in range(4):
        ids = rng.integers(3, vocab, n).tolist()
        t0 = time.perf_counter()
        rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            if any(o.request_id == rid and o.new_token_ids for o in engine.step()):
                ttft.append(time.perf_counter() - t0)
    streams, prompt = [], min(1000, max_model_len // 2)
    for _ in range(2):
        for _ in range(32):
            engine.add_request(rng.integers(3, vocab, prompt).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=min(256, max_model_len // 4),
                                              ignore_eos=True))
        t0 = time.perf_counter()
        _run(engine)
        streams.append(time.perf_counter() - t0)
    return {"ttft_prompt_tokens": n, "ttft_s": round(statistics.median(ttft[1:]), 4),
            "streams_32x1000x256_s": round(streams[-1], 3)}


def parse_args(argv=None) -> argparse.Namespace:
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
    ap.add_argument("--precompile-reuse", default="all", type=reuse_methods,
                    metavar="METHODS",
                    help="segment-reuse methods whose programs precompile, comma-separated, or 'all' (every "
                         f"method of the mix: {','.join(REUSE_METHODS)}; at the GPU configuration 19 RedKnot "
                         "passes, one page copy for naive and EPIC, 7 selection programs and 6 steps "
                         "CacheBlend and SparseX share); '' = none (default: all)")
    ap.add_argument("--no-retrieval", action="store_true",
                    help="no SpeContext (random retrieval head) in the precompile and the mix")
    ap.add_argument("--retrieval-max-seqs", type=int, default=PER_REQUEST_RETRIEVAL_ROWS, metavar="N",
                    help="SpeContext state rows (requests running at once), as the server's default")
    ap.add_argument("--autotune-max-rows", type=int, default=None, metavar="ROWS",
                    help="XLA GEMM autotuning only for precompiled programs of at most ROWS rows "
                         "(EngineConfig.autotune_max_rows; default: every program)")
    ap.add_argument("--speed", action="store_true",
                    help="after startup: time to first token of a max-model-len/4 prompt (median of 3) and "
                         "the wall time of 32 streams of 1,000 prompt tokens + 256 decoded, on the "
                         "precompiled programs (what --autotune-max-rows costs in speed), once the step "
                         "cache has been written")
    ap.add_argument("--background", action="store_true",
                    help="programs kept in the step cache load on a background thread after ready, as the "
                         "server loads them (`all_loaded_s`: when the last one is in)")
    ap.add_argument("--reuse-apart", action="store_true",
                    help="compile the reuse passes after the step programs, not in the same pool run (the "
                         "server's way)")
    ap.add_argument("--page-classes", type=int, default=None, metavar="N",
                    help="page-table width classes (EngineConfig.page_classes; default: 1 on an accelerator)")
    ap.add_argument("--rolled-from-tokens", type=int, default=0, metavar="N",
                    help="ragged steps of at least N tokens roll their layers "
                         "(EngineConfig.rolled_from_tokens)")
    ap.add_argument("--segment-as-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="naive, EPIC and full reuse requests run as the engine's ragged steps (their "
                         "precompile is one page-copy program per page-table width class); "
                         "--no-segment-as-steps: their passes")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="trace the host threads while precompiling (jax.profiler, under DIR) and write the "
                         "compiler stages with the most self time (host_self_s)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--progress", action="store_true", help="progress bar while compiling")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
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
                      enable_prefix_caching=False, autotune_max_rows=args.autotune_max_rows,
                      **({"page_classes": args.page_classes} if args.page_classes else {}),
                      **({"rolled_from_tokens": args.rolled_from_tokens} if args.rolled_from_tokens else {}),
                      segment_as_steps=args.segment_as_steps, retrieval_max_seqs=args.retrieval_max_seqs)

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
    retrieval = None if args.no_retrieval else random_retrieval_head(model)
    presses = engine.compressor.precompile_policies()  # every press, also on the CPU
    t0 = time.perf_counter()
    # As the server does: the reuse passes on the same pool run as the steps (`--reuse-apart`: after them)
    together = list(args.precompile_reuse) if not args.reuse_apart else []
    with host_trace.traced(args.trace) as host:
        programs = engine.precompile(progress=args.progress, presses=presses, background=args.background,
                                     retrieval=[] if retrieval is None else [retrieval], reuse=together)
        steps_s = time.perf_counter() - t0
        precompiled_at = time.perf_counter()
    t0 += time.perf_counter() - precompiled_at  # reading the trace is not startup
    reuse_passes = {}
    if args.precompile_reuse:  # the count per method: pass_shapes
        from jaxkv.engine.reuse import pass_shapes
        from jaxkv.policies.reuse import resolve_reuse

        limit = engine.max_pages_per_head * engine.page_size
        reuse_passes = {m: len(engine.reuser.calls(pol)) if engine.reuser.as_steps(pol)  # page copies
                        else len(pass_shapes(pol, limit))
                        for m, pol in ((m, resolve_reuse(m)) for m in args.precompile_reuse)}
        if args.reuse_apart:
            reuse_passes["ready"] = engine.precompile_reuse(args.precompile_reuse, progress=args.progress)
    ready = time.perf_counter() - t0
    loader = getattr(engine, "program_loader", None)
    if loader is not None:
        loader.join()
    all_loaded = time.perf_counter() - t0
    before_xla, before_steps = compilations.xla_programs(), compilations.step_programs()
    row = dict(shape=args.shape, max_num_seqs=args.max_num_seqs, max_step_tokens=args.max_step_tokens,
               max_model_len=args.max_model_len, variants=variants, programs=programs,
               press_programs=len(warmup.press_programs(engine, presses)), reuse_passes=reuse_passes,
               steps_s=round(steps_s, 1), reuse_s=round(ready - steps_s, 1), ready_s=round(ready, 1),
               all_loaded_s=round(all_loaded, 1),
               since_start_s=round(time.perf_counter() - start, 1),
               step_cache_hits=getattr(engine, "step_cache_hits", None),
               compile_leaders=getattr(warmup, "leaders_first", lambda: None)(), reuse_apart=args.reuse_apart,
               page_widths=list(getattr(engine, "page_widths", ())),
               rolled_from_tokens=args.rolled_from_tokens, segment_as_steps=args.segment_as_steps,
               retrieval_max_seqs=engine.retriever.max_rows, kv_cache_gib=args.kv_cache_gib,
               programs_by_kind=getattr(engine, "precompiled_by_variant", None),
               xla_programs_at_ready=before_xla, **_seconds(compilations),
               compile_timeline=getattr(getattr(engine, "compile_timeline", None), "summary", dict)(),
               precompile_cpu_s=host["cpu_s"], precompile_cores_busy=host["cores_busy"],
               **({"host_self_s": host["host_self_s"]} if "host_self_s" in host else {}))
    if args.speed:
        writer = getattr(engine, "program_writer", None)
        if writer is not None:  # the step cache's writer would share the host with the timed requests
            writer.join()
        row.update(speed(engine, model.config.vocab_size, args.max_model_len))
    if not args.no_mix:
        t0 = time.perf_counter()
        mix = request_mix(engine, model.config.vocab_size, retrieval=retrieval, compilations=compilations)
        row["mix_requests"], row["mix_tokens_digest"] = mix["requests"], mix["digest"]
        row["compiled_per_kind"] = mix["compiled_per_kind"]
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
