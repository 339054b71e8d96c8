"""Host -> device bandwidth of pinned host arrays by transfer size: what one segment-tier promotion can
reach. The same bytes as N pinned arrays moved by one `jax.device_put`, beside one pageable numpy array.
`--overlap`: whether transfers run beside programs, by the order they are dispatched in (a promotion's
layer groups: every group's transfer first, or each a few programs ahead of its own), and what issuing
many small transfers costs the host.

    python -m benchmarks.host_link --mib 512                 # GPU
    python -m benchmarks.host_link --mib 4096 --overlap      # GPU
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def measure(total: int, counts=(512, 64, 8, 1), repeats: int = 4) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxkv.cache.memory_kinds import host_memory_kind

    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind=host_memory_kind())
    on_device = SingleDeviceSharding(dev, memory_kind="device")
    rows = []
    for n in counts:
        parts = [jax.device_put(np.ones(total // n // 2, np.uint16), host) for _ in range(n)]
        jax.block_until_ready(parts)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(parts, on_device))
            best = min(best, time.perf_counter() - t0)
        a = np.ones(total // 2, np.uint16)
        t0 = time.perf_counter()
        jnp.asarray(a).block_until_ready()
        pageable = time.perf_counter() - t0
        rows.append(dict(arrays=n, mib_each=total / n / 2**20, pinned_gbps=total / best / 1e9,
                         pageable_gbps=total / pageable / 1e9))
    return rows


def overlap(total: int, groups: int = 8, arrays: int = 192, compute_ms: float = 12.0,
            repeats: int = 3) -> list[dict]:
    """`groups` groups of `arrays` pinned host arrays (`total` bytes in all), each group read by one program
    of ~`compute_ms`: wall time and host time to the last dispatch, per dispatch order."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxkv.cache.memory_kinds import host_memory_kind

    dev = jax.devices()[0]
    host = SingleDeviceSharding(dev, memory_kind=host_memory_kind())
    on_device = SingleDeviceSharding(dev, memory_kind="device")
    each = total // (groups * arrays) // 2
    parts = [[jax.device_put(np.full(each, g, np.uint16), host) for _ in range(arrays)]
             for g in range(groups)]
    jax.block_until_ready(parts)

    def make(reps):
        @jax.jit
        def program(x, arrs):
            for _ in range(reps):
                x = jnp.tanh(x @ x) * 0.5
            return x + sum(a[0].astype(jnp.float32) for a in arrs)
        return program

    x = jnp.ones((4096, 4096), jnp.bfloat16)
    on_dev = [jax.device_put(p, on_device) for p in parts]
    program = make(1)
    program(x, on_dev[0]).block_until_ready()
    t0 = time.perf_counter()
    program(x, on_dev[0]).block_until_ready()
    one = time.perf_counter() - t0
    program = make(max(1, round(compute_ms / 1e3 / max(one, 1e-5))))
    program(x, on_dev[0]).block_until_ready()

    def put(g):
        return jax.device_put(parts[g], on_device)

    def run(order):
        t0 = time.perf_counter()
        out = order()
        host = time.perf_counter() - t0
        jax.block_until_ready(out)
        return host, time.perf_counter() - t0

    def compute_only():
        return [program(x, on_dev[g]) for g in range(groups)]

    def transfer_only():
        return [put(g) for g in range(groups)]

    def all_first():
        moved = [put(g) for g in range(groups)]
        return [program(x, m) for m in moved]

    def ahead(k):
        def order():
            moved = [put(g) for g in range(min(k, groups))]
            outs = []
            for g in range(groups):
                if g + k < groups:  # before program g: the transfer waits for nothing program g computes
                    moved.append(put(g + k))
                outs.append(program(x, moved[g]))
            return outs
        return order

    def serial():
        moved = jax.block_until_ready([put(g) for g in range(groups)])
        return [program(x, m) for m in moved]

    modes = [("programs only", compute_only), ("transfers only", transfer_only),
             ("transfers, then programs (waited)", serial), ("every transfer first", all_first),
             ("each transfer 1 program ahead", ahead(1)), ("each transfer 2 programs ahead", ahead(2))]
    rows = []
    for name, order in modes:
        run(order)
        best = min((run(order) for _ in range(repeats)), key=lambda r: r[1])
        rows.append(dict(order=name, host_ms=best[0] * 1e3, wall_ms=best[1] * 1e3))
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_link", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes moved per measurement (MiB)")
    ap.add_argument("--overlap", action="store_true",
                    help="transfers beside programs by dispatch order (8 groups, one short program each)")
    ap.add_argument("--arrays", type=int, nargs="+", default=[96, 24],
                    help="pinned arrays per group with --overlap (96: 8 segments x 4 layers x K, V, "
                         "positions as one array per layer; 24: one per block of 4 layers)")
    args = ap.parse_args(argv)
    if args.overlap:
        rows = []
        print(f"{args.mib} MiB in 8 groups of pinned arrays, one program per group (their time alone: "
              "'programs only')\n"
              "| arrays per group | dispatch order | host ms to the last dispatch | wall ms |\n"
              "|---|---|---|---|")
        for n in args.arrays:
            for r in overlap(args.mib * 2**20, arrays=n):
                rows.append({"arrays": n, **r})
                print(f"| {n} | {r['order']} | {r['host_ms']:.1f} | {r['wall_ms']:.1f} |", flush=True)
        return rows
    rows = measure(args.mib * 2**20)
    print("| pinned arrays | MiB each | pinned GB/s | one pageable numpy array GB/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['arrays']} | {r['mib_each']:.2f} | {r['pinned_gbps']:.1f} | {r['pageable_gbps']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
