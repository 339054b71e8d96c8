"""Decode throughput of the retrieval policies against the full cache, in the same engine (issue 12 item 5),
plus the host tier's transfer model (issue 12 item 2): bytes a diff prefetch moves per step vs re-fetching
the whole selection.

One engine per method (all heads global, prefix caching off, greedy, EOS ignored), `batch` random prompts
of `prompt` tokens, `new` tokens each. Throughput counts only the engine steps that compiled nothing
(jaxkv.engine.runner / retrieval compilation counters unchanged), so the growing page bucket's compiles do
not pollute it. Bytes per decode step and sequence (SpeContext): a host tier holding layers tap..L-1 loads
``B x (L - tap) x Hkv x 2 x D x itemsize`` per step when it re-fetches the selection, and only the slots not
selected the step before when it fetches the difference (measured overlap, `Retriever.slots_new`).

    python scripts/bench_retrieval.py --batch 16 --prompt 2048 --new 8192 --budget 1024     # GPU
    python scripts/bench_retrieval.py --batch 2 --prompt 64 --new 32 --budget 16 --page-size 4   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def run_method(model, method: str, args) -> dict:
    import jax

    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine import retrieval, runner
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    cfg = model.config
    kw = {} if method == "full" else {"kv_policy": method, "kv_budget": args.budget}
    total = args.prompt + args.new + 1
    hc = all_global(cfg.num_layers, cfg.num_kv_heads)
    eng = Engine(model, max_num_seqs=args.batch, max_model_len=total, page_size=args.page_size,
                 max_step_tokens=args.max_step_tokens, head_classes=hc, enable_prefix_caching=False, **kw)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(rng.integers(10, cfg.vocab_size, args.prompt).tolist(), sp)
    compiles = lambda: runner.num_compilations() + retrieval.num_compilations()  # noqa: E731
    steady_tokens, steady_s, all_tokens, t_all = 0, 0.0, 0, time.perf_counter()
    decode_started = False
    while eng.has_unfinished():
        c0, t0 = compiles(), time.perf_counter()
        outs = eng.step()
        jax.block_until_ready(eng.runner.pool.k)
        dt = time.perf_counter() - t0
        n = sum(len(o.new_token_ids) for o in outs)
        all_tokens += n
        decode_started = decode_started or (n > 0 and not eng.scheduler.waiting)
        if decode_started and compiles() == c0 and n:
            steady_tokens += n
            steady_s += dt
    r = eng.retriever
    row = {"method": method, "budget": None if method == "full" else args.budget, "tokens": all_tokens,
           "wall_s": time.perf_counter() - t_all, "steady_tokens": steady_tokens, "steady_s": steady_s,
           "tok_per_s": steady_tokens / steady_s if steady_s else float("nan")}
    if method == "specontext":
        item = eng.runner.pool.k.dtype.itemsize
        tap = eng.retriever.params_for(eng.kv_policy).config.tap_layer
        per_slot = (cfg.num_layers - tap) * 2 * cfg.head_dim * item  # one KV head's slot, K + V, host layers
        row |= {"sel_steps": r.steps, "overlap": 1 - r.slots_new / max(r.slots_selected, 1),
                "bytes_full_per_step": r.slots_selected * per_slot / max(r.steps, 1),
                "bytes_diff_per_step": r.slots_new * per_slot / max(r.steps, 1),
                "diff_ratio": r.slots_selected / max(r.slots_new, 1)}
    return row


def main(argv=None) -> int:
    import jaxkv

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "jaxkv" / "assets" / "default_model"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="full,specontext,quest")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-step-tokens", type=int, default=2048)
    ap.add_argument("--out", help="JSON lines file")
    args = ap.parse_args(argv)
    model = jaxkv.load(args.model, dtype=args.dtype)
    rows = []
    for method in args.methods.split(","):
        row = run_method(model, method, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"\n{' '.join(sys.argv)}")
    print("| method | budget | decode tok/s (steady) | vs full | wall s | overlap | diff bytes/step/seq "
          "| full re-fetch | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = rows[0]["tok_per_s"] if rows and rows[0]["method"] == "full" else float("nan")
    for r in rows:
        extra = (f"{r['overlap']:.3f} | {r['bytes_diff_per_step'] / 1e6:.3f} MB | "
                 f"{r['bytes_full_per_step'] / 1e6:.3f} MB | {r['diff_ratio']:.1f}x"
                 if "overlap" in r else "- | - | - | -")
        print(f"| {r['method']} | {r['budget'] or '-'} | {r['tok_per_s']:.0f} | "
              f"{r['tok_per_s'] / base:.2f} | "
              f"{r['wall_s']:.1f} | {extra} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
