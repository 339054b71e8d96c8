"""Segment tiers: what bringing a segment back to the device costs next to prefilling it again.

For each segment length: the engine's prefill of the segment (registration), then the segment moved off the
device and promoted back (every KV head) from host memory and, with `--store DIR`, from the persistent store.
Best of `--repeat` promotions; the first compiles the copy for its size. From the store, also the read's own
speed (bytes / seconds from its start to its last layer checked); `--drop-page-cache` drops the store's
files from the page cache before every promotion, so they come from the disk. `--read-floor` then times,
on the store's chunk files, what bounds a store read: the bytes alone (16 threads, page cache and disk),
their checksums alone, and `SegmentStore.get` (read and checked).

    python -m benchmarks.segment_tiers --model smollm2 --tokens 512 1024
    python -m benchmarks.segment_tiers --model smollm2 --tokens 512 --store /tmp/segments --drop-page-cache
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
    p.add_argument("--drop-page-cache", action="store_true",
                   help="drop the store's files from the page cache before every promotion from the store")
    p.add_argument("--read-floor", action="store_true",
                   help="then time the store's raw read, checksums and SegmentStore.get (needs --store)")
    args = p.parse_args(argv)
    if args.read_floor and not args.store:
        p.error("--read-floor needs --store")

    import jaxkv
    from benchmarks.reuse import drop_page_cache
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
            best, read_s = float("inf"), float("inf")
            for _ in range(args.repeat):
                tiers.evict(eng.allocator.num_pages)
                if source == "store" and args.drop_page_cache:
                    drop_page_cache(args.store)
                t = time.perf_counter()
                tiers.promote([e], every)
                jax.block_until_ready(eng.runner.pool.k)
                best = min(best, time.perf_counter() - t)
                reads = tiers.last_reads
                if source == "store" and reads and all(r.finished for r in reads):
                    read_s = min(read_s, max(r.finished for r in reads) - min(r.started for r in reads))
            row[f"promote_from_{source}_ms"] = round(best * 1e3, 1)
            if read_s < float("inf"):
                row["store_read_GBps"] = round(row["bytes"] / read_s / 1e9, 3)
        print(json.dumps(row), flush=True)
    if args.read_floor:
        print(json.dumps(read_floor(eng.reuser.persist.disk, args.store, args.repeat)), flush=True)


def read_floor(disk, store: str, repeat: int) -> dict:
    """Seconds (best of `repeat`) and GB/s of: every chunk file read into memory (16 threads: the floor for
    the bytes alone), from the page cache and after dropping it; their checksums alone (blake2b, on the
    store's hashing threads); `SegmentStore.get` of every segment (read and checked), both ways."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from benchmarks.reuse import drop_page_cache
    from jaxkv.cache.segment_store import _digests

    files = [f for f in Path(store).rglob("*") if f.is_file() and "/c/" in f.as_posix()]
    size = sum(f.stat().st_size for f in files)
    ids = [m["segment_id"] for m in disk.list()]
    bufs = [bytearray(f.stat().st_size) for f in files]

    def read(i):
        fd = os.open(files[i], os.O_RDONLY)
        try:
            os.readv(fd, [bufs[i]])
        finally:
            os.close(fd)

    pool = ThreadPoolExecutor(16)
    steps = {"raw_read": lambda: list(pool.map(read, range(len(files)))),
             "checksums": lambda: _digests([np.frombuffer(b, np.uint8) for b in bufs]),
             "get": lambda: [disk.get(i) for i in ids]}
    out = {"files": len(files), "bytes": size}
    for name, fn in steps.items():
        for cache in ("page_cache", "disk"):
            if name == "checksums" and cache == "disk":
                continue
            best = float("inf")
            for _ in range(repeat):
                if cache == "disk":
                    drop_page_cache(store)
                else:
                    fn()  # warm: the files in the page cache
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            out[f"{name}_{cache}_s"] = round(best, 4)
            out[f"{name}_{cache}_GBps"] = round(size / best / 1e9, 3)
    pool.shutdown()
    return out


if __name__ == "__main__":
    main()
