"""Host -> device bandwidth of pinned host arrays by transfer size: what one segment-tier promotion can
reach. The same bytes as N pinned arrays moved by one `jax.device_put`, beside one pageable numpy array.

    python -m benchmarks.host_link --mib 512      # GPU
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


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_link", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="bytes moved per measurement (MiB)")
    args = ap.parse_args(argv)
    rows = measure(args.mib * 2**20)
    print("| pinned arrays | MiB each | pinned GB/s | one pageable numpy array GB/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['arrays']} | {r['mib_each']:.2f} | {r['pinned_gbps']:.1f} | {r['pageable_gbps']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
