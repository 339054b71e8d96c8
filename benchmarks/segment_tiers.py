"""Segment tiers: what bringing a segment back to the device costs next to prefilling it again.

For each segment length: the engine's prefill of the segment (registration), then the segment moved off the
device and promoted back (every KV head) from host memory and, with `--store DIR`, from the persistent store.
Best of `--repeat` promotions; the first compiles the copy for its size.

    python -m benchmarks.segment_tiers --model smollm2 --tokens 512 1024
    python -m benchmarks.segment_tiers --model smollm2 --tokens 512 --store /tmp/segments
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.segment_tiers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--store", default=None, help="a segment store directory (adds the store tier's row)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    import jaxkv
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine

    model = jaxkv.load(args.model)
    cfg = model.config
    eng = Engine(model, max_model_len=max(args.tokens) * 2, num_pages=None,
                 head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), segment_store=args.store)
    tiers = eng.reuser.tiers
    every = np.ones((cfg.num_layers, cfg.num_kv_heads), bool)
    rng = np.random.default_rng(0)
    for n in args.tokens:
        eng.register_segment(rng.integers(10, cfg.vocab_size, n).tolist())  # compiles this length's steps
        t = time.perf_counter()
        e = eng.reuser.store.get(eng.register_segment(rng.integers(10, cfg.vocab_size, n).tolist()))
        jax.block_until_ready(eng.runner.pool.k)
        row = {"tokens": n, "bytes": tiers.L * tiers.H * tiers.head_bytes(e),
               "prefill_ms": round((time.perf_counter() - t) * 1e3, 1)}
        sources = ["host"] + (["store"] if args.store else [])
        for source in sources:
            if source == "store":
                tiers.host_bytes = 0
                tiers._host.clear()  # the store's copy is then the only one
            best = float("inf")
            for _ in range(args.repeat):
                tiers.evict(eng.allocator.num_pages)
                t = time.perf_counter()
                tiers.promote([e], every)
                jax.block_until_ready(eng.runner.pool.k)
                best = min(best, time.perf_counter() - t)
            row[f"promote_from_{source}_ms"] = round(best * 1e3, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
