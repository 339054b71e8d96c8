"""Can a host-tier gather run beside device work? Times, on the GPU, one device program (a chain of matmuls)
and one host gather of K/V rows from a host mirror, alone and together, in the ways JAX offers:

* ``xla``: the gather inside the device program (`compute_on("device_host")`, what `host_tier.load_rows`
  does); run once with the default XLA flags and once with ``--lhs`` (latency-hiding scheduler) to see
  whether XLA schedules the host computation beside independent device work;
* ``thread``: the gather out of XLA: a Python thread gathers with numpy from a numpy mirror and
  `device_put`s the rows, while the main thread runs the device program;
* ``thread-pinned``: the same, the rows gathered into a `pinned_host` staging array (written through its
  buffer pointer) and copied to the device from there (a DMA from pinned memory).

Overlap = (alone_dev + alone_gather) / together: 1.0 = serial, up to 2.0 = fully hidden.

    python scripts/probe_host_overlap.py [--lhs] [--rows 262144] [--mirror-rows 4194304]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time

if "--lhs" in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_latency_hiding_scheduler=true")

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine import host_tier as ht


def timed(f, reps=5):
    f()
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best.append(time.perf_counter() - t)
    return float(np.median(best)) * 1e3


def pointer_view(arr, shape, dtype):
    """A numpy view of a host-memory jax array's buffer (no copy)."""
    ptr = arr.addressable_data(0).unsafe_buffer_pointer()
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).reshape(shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lhs", action="store_true")
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--mirror-rows", type=int, default=1 << 22)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--matmuls", type=int, default=150)
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device {dev.device_kind}, jax {jax.__version__}, lhs={args.lhs}")
    rng = np.random.default_rng(0)
    mirror_np = rng.standard_normal((args.mirror_rows, args.dim)).astype(jnp.bfloat16)
    mirror = (ht.to_host(mirror_np), ht.to_host(mirror_np))
    rows_np = np.sort(rng.choice(args.mirror_rows, args.rows, replace=False)).astype(np.int32)
    rows = jnp.asarray(rows_np)
    a = jnp.asarray(rng.standard_normal((4096, 4096)), jnp.bfloat16)

    def chain(x):
        for _ in range(args.matmuls):
            x = jnp.tanh(x @ a)
        return x

    dev_only = jax.jit(chain)

    @jax.jit
    def gather_only(hk, hv, r):
        k, v = ht._host_gather(hk, hv, jax.device_put(r, ht.host_sharding()))
        return jax.device_put(k, ht.device_sharding()), jax.device_put(v, ht.device_sharding())

    @jax.jit
    def both(x, hk, hv, r):
        k, v = ht._host_gather(hk, hv, jax.device_put(r, ht.host_sharding()))
        return chain(x), jax.device_put(k, ht.device_sharding()), jax.device_put(v, ht.device_sharding())

    res = {}
    res["dev"] = timed(lambda: jax.block_until_ready(dev_only(a)))
    res["xla gather"] = timed(lambda: jax.block_until_ready(gather_only(*mirror, rows)))
    res["xla both"] = timed(lambda: jax.block_until_ready(both(a, *mirror, rows)))

    def np_gather():
        return jax.device_put(mirror_np[rows_np], dev), jax.device_put(mirror_np[rows_np], dev)

    res["thread gather"] = timed(lambda: jax.block_until_ready(np_gather()))

    def run_both(gather):
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("g", jax.block_until_ready(gather())))
        y = dev_only(a)
        th.start()
        jax.block_until_ready(y)
        th.join()

    res["thread both"] = timed(lambda: run_both(np_gather))

    blank = np.zeros((args.rows, args.dim), jnp.bfloat16)
    stage = [jax.device_put(blank, ht.host_sharding()) for _ in range(2)]
    views = [pointer_view(s, (args.rows, args.dim), jnp.bfloat16) for s in stage]

    def pinned_gather():
        np.take(mirror_np, rows_np, axis=0, out=views[0])
        np.take(mirror_np, rows_np, axis=0, out=views[1])
        return jax.device_put(stage[0], ht.device_sharding()), jax.device_put(stage[1], ht.device_sharding())

    got = jax.block_until_ready(pinned_gather())
    assert np.array_equal(np.asarray(got[0]), mirror_np[rows_np]), "pinned staging read back wrong rows"
    res["pinned gather"] = timed(lambda: jax.block_until_ready(pinned_gather()))
    res["pinned both"] = timed(lambda: run_both(pinned_gather))

    mb = 2 * args.rows * args.dim * 2 / 1e6
    print(f"rows {args.rows} x {args.dim} bf16, K + V = {mb:.1f} MB; mirror {args.mirror_rows} rows")
    print("| case | ms |\n|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v:.2f} |")
    for name, g, b in (("xla", "xla gather", "xla both"), ("thread", "thread gather", "thread both"),
                       ("thread-pinned", "pinned gather", "pinned both")):
        print(f"overlap {name}: {(res['dev'] + res[g]) / res[b]:.2f} (1.0 serial, 2.0 hidden)")


if __name__ == "__main__":
    main()
