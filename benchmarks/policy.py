"""Decode throughput under a KV compression policy against the full cache, same engine, same run.

Random-weight Llama checkpoint saved with transformers (`benchmarks.harness.make_checkpoint`), loaded with
`jaxkv.load`; a batch of prompts generates a long continuation (greedy, EOS ignored, fresh engine per run,
prefix caching off). Each method runs twice and the second run is timed (the first compiles every page-list
bucket the run reaches; a policy's compile run is shorter, `--policy-warm-new`, since its page lists stay
short). The policy compresses at the end of prefill and every `decode_interval` generated
tokens, so the cache each head holds stays near `budget x prompt` however long the generation grows;
the full cache grows to prompt + generated. Weights are random, so the scores pick arbitrary tokens: this
measures speed and memory, not quality (docs/eval.md has the quality table).

    python -m benchmarks.policy --out results.md            # GPU: 1B shape, 32 x 2K -> 16K
    python -m benchmarks.policy --small                             # CPU smoke mode
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.harness import (
    command_line,
    describe_device,
    make_checkpoint,
    markdown_table,
    write_json,
    write_section,
)


def run(model, policy, *, batch, prompt, new, page_size, kv_cache_bytes, decode_interval, engine_kwargs=None,
        max_len=None):
    """Fresh engine, one batch to completion -> (seconds, tokens generated, peak pages held, compressions,
    step variants compiled during the run). `max_len` (default prompt + new + 1) sizes the engine: a
    shorter warm-up run must keep the timed run's, since the device page tables' shapes (and so every
    step variant) depend on it."""
    import numpy as np

    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine
    from jaxkv.engine.runner import num_compilations
    from jaxkv.eval.__main__ import _parse_opts
    from jaxkv.policies import POLICIES, CompressPolicy, get_policy
    from jaxkv.sampling import SamplingParams

    cfg = model.config
    pol = None
    if policy != "full":  # name@budget[:field=value...]
        spec, *extra = policy.split(":")
        name, _, budget = spec.partition("@")
        cls = POLICIES[name]
        fields = {"decode_interval": decode_interval} if "decode_interval" in cls.__dataclass_fields__ else {}
        fields |= _parse_opts(",".join(extra))
        budget = float(budget) if issubclass(cls, CompressPolicy) else int(float(budget))  # retrieval: tokens
        pol = get_policy(name, budget=budget, **fields)
    eng = Engine(model, page_size=page_size, max_num_seqs=batch, max_model_len=max_len or prompt + new + 1,
                 max_step_tokens=max(prompt, 512), enable_prefix_caching=False,
                 head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), kv_cache_bytes=kv_cache_bytes,
                 kv_policy=pol, **(engine_kwargs or {}))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, prompt).tolist() for _ in range(batch)]
    # tokens only, as the server asks for them: the random checkpoint's word-level tokenizer would
    # otherwise turn every token into text on the host between steps
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    free0 = eng.allocator.num_free
    compiled0 = num_compilations()
    t0 = time.perf_counter()
    for p in prompts:
        eng.add_request(p, sp)
    generated, peak = 0, 0
    while eng.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in eng.step())
        peak = max(peak, free0 - eng.allocator.num_free)
    secs = time.perf_counter() - t0
    return (secs, generated, peak, eng.compressor.num_compressions, num_compilations() - compiled0,
            eng.runner.pool.bias is not None)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.policy", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on CPU (smoke mode)")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--methods", default="full,hardkv@0.125,snapkv@0.125,streaming_llm@0.125")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=16384)
    ap.add_argument("--policy-warm-new", type=int, default=2048,
                    help="a policy's compile run generates this many tokens "
                         "(its compressed page lists stay in "
                         "the buckets a short run reaches); the full cache's compile run is full length")
    ap.add_argument("--decode-interval", type=int, default=512, help="policies compress every N new tokens")
    ap.add_argument("--out", default=None, help="markdown file whose section is replaced")
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine", default="{}",
                    help='extra Engine keyword arguments as JSON, e.g. \'{"pipeline_decode": false}\'')
    args = ap.parse_args(argv)
    if args.small:
        args.shape, args.batch, args.prompt, args.new, args.decode_interval = "small", 4, 64, 48, 16
    import jaxkv

    dtype = "float32" if args.small else "bfloat16"
    page_size = 16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(args.shape, Path(tmp), args.prompt + args.new + 1)
        model = jaxkv.load(tmp, dtype=dtype)
        cfg = model.config
        token_bytes = 2 * cfg.head_dim * (4 if args.small else 2) * cfg.num_layers * cfg.num_kv_heads
        kv_cache_bytes = int(1.1 * args.batch * (args.prompt + args.new + 2 * page_size) * token_bytes)
        for method in args.methods.split(","):
            kw = dict(batch=args.batch, prompt=args.prompt, new=args.new, page_size=page_size,
                      kv_cache_bytes=kv_cache_bytes, decode_interval=args.decode_interval,
                      engine_kwargs=json.loads(args.engine), max_len=args.prompt + args.new + 1)
            warm = kw if method == "full" else dict(kw, new=min(args.new, args.policy_warm_new))
            run(model, method, **warm)  # compiles
            secs, gen, peak, ncomp, ncompiled, bias = run(model, method, **kw)
            page_bytes = page_size * (2 * cfg.head_dim * (4 if args.small else 2) + 4 * bias)  # + merge bias
            row = {"method": method, "seconds": secs, "tokens": gen, "tok_s": gen / secs,
                   "peak_kv_gb": peak * page_bytes / 1e9, "compressions": ncomp,
                   "compiled_in_timed_run": ncompiled}
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]["tok_s"] if rows and rows[0]["method"] == "full" else None
    cmd = command_line("benchmarks.policy", argv)
    header = ["method", "wall s", "tok/s", "vs full", "peak KV GB held", "compressions",
              "variants compiled in the timed run"]
    table = markdown_table(header, [
        [r["method"], f"{r['seconds']:.2f}", f"{r['tok_s']:.0f}",
         f"{r['tok_s'] / base:.2f}x" if base else "-", f"{r['peak_kv_gb']:.2f}",
         r["compressions"], r["compiled_in_timed_run"]] for r in rows])
    lines = [f"Command: `{cmd}`", "", f"{describe_device()} {args.shape} shape, random weights ({dtype}), "
             f"batch {args.batch}, {args.prompt}-token prompts, {args.new} generated each, greedy, "
             f"policies compress every {args.decode_interval} new tokens; second run of each timed.", "",
             table]
    print("\n".join(lines))
    if args.out:
        write_section(Path(args.out), "Decode throughput under KV compression", "\n".join(lines))
    if args.json:
        write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
