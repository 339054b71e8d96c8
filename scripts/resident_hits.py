"""Rows a SpeContext selection buffer must load per decode step, by buffer width (issue 12 item 2).

Greedy-decodes eval instances with the shipped retrieval head (`jaxkv.policies.retrieve.decode.generate`,
the library decode the engine's tests check against), records every step's per-KV-head selection, and
replays it through a buffer of W = resident x B slots per KV head with the engine's rule
(`host_tier.plan_resident`: a selected position no slot holds is loaded into an empty slot, else into the
least recently selected one). W = B is the adjacent-step diff (rows loaded = 1 - overlap); a wider buffer
also keeps positions that leave the selection and come back. Reported: rows loaded / rows re-fetched
(every selected row, every step after the first) and its inverse, the host-tier bytes ratio.

    python scripts/resident_hits.py --tasks chain,mq_niah --context 8192 --num 2 --budget 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def replay(selections, width: int) -> tuple[int, int]:
    """selections: per step (idx [Hkv, B], count [Hkv]) -> (rows loaded, rows re-fetched) after step 0."""
    import jax.numpy as jnp

    from jaxkv.engine import host_tier

    hkv = selections[0][0].shape[0]
    held = jnp.full((1, hkv, width), -1, jnp.int32)
    seen = jnp.full((1, hkv, width), -1, jnp.int32)
    loaded = refetch = 0
    for t, (idx, count) in enumerate(selections):
        _, held, seen, need, _ = host_tier.plan_resident(held, seen, jnp.asarray(idx)[None],
                                                         jnp.asarray(count)[None], jnp.asarray([t]))
        if t:
            loaded += int(need.sum())
            refetch += int(count.sum())
    return loaded, refetch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="chain,mq_niah")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--num", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--resident", default="1,1.5,2,3")
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "jaxkv", "assets",
                                                    "default_model"))
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    import jaxkv
    from jaxkv.eval import tasks
    from jaxkv.policies.retrieve import decode
    from jaxkv.policies.retrieve import specontext as sc

    model = jaxkv.load(args.model)
    head = sc.load_for_model(model)
    tok = model.tokenizer
    stop = tuple(model.config.eos_token_ids)
    factors = [float(x) for x in args.resident.split(",")]
    steps: list = []
    step_fn = decode.decode_step

    def recording(*a, **k):   # the library decode's selection of every step
        out = step_fn(*a, **k)
        steps.append((np.asarray(out[-1].idx[0]), np.asarray(out[-1].count[0])))
        return out

    decode.decode_step = recording
    rows = []
    try:
        for task in args.tasks.split(","):
            insts = tasks.make_instances(task, args.context, args.num, seed=args.seed)
            for i, inst in enumerate(tqdm(insts, desc=task, file=sys.stderr)):
                ids = tok.encode(inst.prompt, add_special_tokens=False)
                tgt = tok.encode(inst.target, add_special_tokens=False)
                steps.clear()
                decode.generate(model, sc.SpeContext(budget=args.budget), head, ids, len(tgt) + 8, stop)
                row = {"task": task, "index": i, "prompt_tokens": len(ids), "steps": len(steps)}
                for f in factors:
                    width = int(np.ceil(f * args.budget))
                    row[f"{f:g}"] = replay(steps, width)
                rows.append(row)
    finally:
        decode.decode_step = step_fn
    print(f"\n{' '.join(sys.argv)}\n")
    print("| task | n | decode steps | prompt tokens | " + " | ".join(f"W = {f:g}B: loaded / re-fetch (ratio)"
                                                           for f in factors) + " |")
    print("|---|---|---|---|" + "---|" * len(factors))
    for task in args.tasks.split(","):
        rs = [r for r in rows if r["task"] == task]
        cells = []
        for f in factors:
            lo = sum(r[f"{f:g}"][0] for r in rs)
            re = sum(r[f"{f:g}"][1] for r in rs)
            cells.append(f"{lo / max(re, 1):.3f} ({re / max(lo, 1):.1f}x)")
        print(f"| {task} | {len(rs)} | {sum(r['steps'] for r in rs)} | "
              f"{int(np.mean([r['prompt_tokens'] for r in rs]))} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
