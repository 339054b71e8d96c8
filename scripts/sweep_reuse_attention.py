"""Launch-config sweep of the attention a sparse reuse pass runs (SparseX / CacheBlend rows), on the GPU.

After its first layers a SparseX or CacheBlend prefill recomputes ~18 % of the prompt's tokens; those query
rows sit at scattered, ascending positions and attend (causally, every head whole-history) over the request's
pages through `paged_attention(..., ordered=True)`. This script times that one call for one layer at the
issue-10 shape (33,040 keys, one sequence, pages of 16) over block sizes, split counts and Triton launch
settings, next to two anchors in the same run:

* `default`: the same call with the api's heuristic config (what `reuse_prefill` ran before this sweep);
* `cudnn full`: cuDNN flash causal attention over all 33,040 rows (what `full` pays per layer): a sparse
  pass at cuDNN's efficiency would cost its rows' share of the full call's causal (query, key) pairs.

Every config's output is checked against the default's (max |diff|), so a faster config that is wrong
shows up. Device-throughput timing (bench_kernels.timeit).

    python scripts/sweep_reuse_attention.py                  # 8B head shape: 32 q / 8 KV heads, D 128
    python scripts/sweep_reuse_attention.py --d 64           # 1B head shape
    python scripts/sweep_reuse_attention.py --small          # CPU logic check (interpret mode, tiny)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_kernels as bk  # noqa: E402

from pallas_kernels.paged_attention.api import paged_attention  # noqa: E402
from pallas_kernels.rows_attention import rows_attention  # noqa: E402


def rows_at(t: int, frac: float, suffix: int, seed: int) -> np.ndarray:
    """Ascending query positions: a random `frac` of the first t - suffix tokens plus the last `suffix`."""
    rng = np.random.default_rng(seed)
    body = t - suffix
    pick = np.sort(rng.choice(body, size=int(frac * body), replace=False))
    return np.concatenate([pick, np.arange(body, t)]).astype(np.int32)


def parse_pairs(s: str):
    return [tuple(int(x) for x in p.split("x")) for p in s.split(",") if p]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--t", type=int, default=33040)
    ap.add_argument("--frac", type=float, default=0.15, help="share of the reused tokens recomputed")
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--block-q", default="16,32,64")
    ap.add_argument("--ppb", default="2,4,8")
    ap.add_argument("--splits", default="1,0", help="0 = the api's heuristic split count")
    ap.add_argument("--launch", default="4x3,8x3,8x2", help="num_warps x num_stages, tried for the top 3")
    ap.add_argument("--split-chunks", default="64,128,256",
                    help="rows_attention's split (cuDNN prefix + paged diagonal), rows per chunk; '' = skip")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    if args.small:
        args.t, args.suffix, args.hq, args.hkv, args.d = 256, 16, 4, 2, 16
        args.block_q, args.ppb, args.launch, args.iters = "16,32", "2", "4x3", 2
        args.split_chunks = "16"
    page = 16
    t = -(-args.t // page) * page
    kp, vp, pos, pt, lens = bk.uniform_pool(jax.random.key(12), 1, args.hkv, t, page, args.d)
    qp = rows_at(args.t, args.frac, args.suffix, 0)
    r = qp.size
    q = jax.random.normal(jax.random.key(8), (r, args.hq, args.d), jnp.bfloat16)
    q_seq = jnp.zeros((r,), jnp.int32)
    q_pos = jnp.asarray(qp)
    zeros = jnp.zeros((args.hkv,), jnp.int32)
    scale = args.d ** -0.5
    bk.log(f"{r} query rows at ascending positions over {args.t} keys ({r / args.t:.3f} of the rows), "
           f"{args.hq} q / {args.hkv} KV heads, D {args.d}, pages of {page}; backend {jax.default_backend()}")

    def call(bq=None, ppb=None, ns=None, nw=None, st=None):
        return jax.jit(lambda q: paged_attention(
            q, kp, vp, pos, pt, lens, q_seq, q_pos, zeros, zeros, scale=scale, ordered=True, block_q=bq,
            pages_per_block=ppb, num_splits=ns, num_warps=nw, num_stages=st)[0])

    ref_fn = call()
    ref = np.asarray(ref_fn(q).astype(jnp.float32))
    t_def = bk.timeit(ref_fn, q, iters=args.iters)
    bk.log(f"default config: {t_def:.3f} ms")
    res = {}

    def try_cfg(key):
        bq, ppb, ns, nw, st = key
        try:
            fn = call(bq, ppb, ns or None, nw, st)
            err = float(np.max(np.abs(np.asarray(fn(q).astype(jnp.float32)) - ref)))
            ms = bk.timeit(fn, q, iters=args.iters)
        except Exception as e:  # noqa: BLE001 - one config failing (shared memory, registers) must not end the sweep
            bk.log(f"  {key}: failed {repr(e)[:200]}")
            return
        res[key] = (ms, err)
        bk.log(f"  block_q {bq} ppb {ppb} splits {ns or 'auto'} launch {nw}x{st}: {ms:.3f} ms  "
               f"max|diff| {err:.2e}")

    first = [int(x) for x in args.block_q.split(",")], [int(x) for x in args.ppb.split(",")], \
        [int(x) for x in args.splits.split(",")]
    for bq, ppb, ns in itertools.product(*first):
        try_cfg((bq, ppb, ns, None, None))
    top = sorted(res, key=lambda k: res[k][0])[:3]
    for (bq, ppb, ns, _, _), (nw, st) in itertools.product(top, parse_pairs(args.launch)):
        try_cfg((bq, ppb, ns, nw, st))

    # The split: this layer's K/V gathered into position order (as reuse_prefill's attend_rows), then
    # cuDNN over each chunk's prefix and the paged kernel on the diagonal, merged by LSE.
    splits = {}
    for c in [int(x) for x in args.split_chunks.split(",") if x]:
        def split(q, c=c):
            kd_, vd_ = (x[pt[0]].reshape(args.hkv, t, args.d).transpose(1, 0, 2)[:args.t] for x in (kp, vp))
            return rows_attention(q, kd_, vd_, q_pos, scale=scale, implementation="split", chunk=c)[0]
        fn = jax.jit(split)
        try:
            err = float(np.max(np.abs(np.asarray(fn(q).astype(jnp.float32)) - ref)))
            ms = bk.timeit(fn, q, iters=args.iters)
        except Exception as e:  # noqa: BLE001 - e.g. no cuDNN SDPA in this jax: the table says so
            bk.log(f"  split chunk {c}: failed {repr(e)[:300]}")
            continue
        splits[c] = (ms, err)
        bk.log(f"  split chunk {c}: {ms:.3f} ms  max|diff| {err:.2e}")

    kd = jax.random.normal(jax.random.key(1), (1, args.t, args.hkv, args.d), jnp.bfloat16)
    vd = jax.random.normal(jax.random.key(2), (1, args.t, args.hkv, args.d), jnp.bfloat16)
    qd = jax.random.normal(jax.random.key(3), (1, args.t, args.hq, args.d), jnp.bfloat16)
    dense = jax.jit(lambda q, k, v: bk.dpa(q, k, v, scale=scale, is_causal=True))
    t_full = bk.timeit(dense, qd, kd, vd, iters=args.iters)
    best = min(res, key=lambda k: res[k][0]) if res else None
    print("\n| config | ms | vs default | max abs diff vs default |\n|---|---|---|---|")
    print(f"| default (api heuristic) | {t_def:.3f} | 1.00x | 0 |")
    for key in sorted(res, key=lambda k: res[k][0])[:8]:
        bq, ppb, ns, nw, st = key
        print(f"| block_q {bq}, ppb {ppb}, splits {ns or 'auto'}, launch {nw or '-'}x{st or '-'} | "
              f"{res[key][0]:.3f} | {t_def / res[key][0]:.2f}x | {res[key][1]:.1e} |")
    for c, (ms, err) in splits.items():
        print(f"| rows_attention split, chunk {c} (gather + cuDNN prefix + paged diagonal) | {ms:.3f} | "
              f"{t_def / ms:.2f}x | {err:.1e} |")
    print(f"| anchor: cuDNN flash causal, all {args.t} rows | {t_full:.3f} | | |")
    ideal = t_full * float(np.mean(qp + 1)) * r * 2 / args.t ** 2
    print(f"\nsparse rows at cuDNN's efficiency would take ~{ideal:.3f} ms "
          f"(the rows' share of the full call's causal key pairs); best "
          f"{res[best][0] if best else float('nan'):.3f} ms {best}")
    return {"rows": r, "default_ms": t_def, "cudnn_full_ms": t_full, "configs": res, "best": best,
            "splits": splits}


if __name__ == "__main__":
    main()
