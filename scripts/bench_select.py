"""The per-step selection pieces of a shared retrieval policy, timed side by side (issue 12): the radix
`select` against its top_k + sort twin `select_sorted`, and SpeContext's in-place `score_rows` against
gathering the key-cache rows and calling `scores` (what the engine did before).

    python scripts/bench_select.py --batch 16 --kv-heads 8 --slots 34816 --budget 1024   # GPU
    python scripts/bench_select.py --small                                                # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def timed(f, *args, iters: int) -> float:
    """Median ms of `iters` calls after one compile call."""
    import jax
    import numpy as np

    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=2, help="retrieval-head query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64, help="retrieval-head dim")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=34816)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    if args.small:
        args.batch, args.kv_heads, args.head_dim, args.hidden, args.slots, args.budget, args.iters = \
            2, 2, 8, 32, 256, 32, 3
    import functools

    import jax
    import jax.numpy as jnp

    from jaxkv.policies.retrieve import specontext as sc
    from jaxkv.policies.retrieve.base import select, select_sorted

    s, h, n, b = args.batch, args.kv_heads, args.slots, args.budget
    key = jax.random.PRNGKey(0)
    scores = jax.nn.softmax(jax.random.normal(key, (s, h, n)) * 3, axis=-1)
    q_pos = jnp.full((s,), n - 1, jnp.int32)
    hc = sc.HeadConfig(args.hidden, args.group * h, h, args.head_dim, 1, 500000.0)
    head = sc.init_head(hc, key)
    pol = sc.SpeContext(budget=b)
    state = jax.random.normal(key, (s + 2, n, h, args.head_dim), jnp.float32)
    rows = jnp.arange(s, dtype=jnp.int32)[::-1]
    x = jax.random.normal(key, (s, 1, args.hidden), jnp.float32)
    pos = q_pos[:, None]

    sorted_ = jax.jit(functools.partial(select_sorted, budget=b))
    in_place = jax.jit(lambda st, x, p: pol.score_rows(head, st, x, p, rows, n))
    copied = jax.jit(lambda st, x, p: pol.scores(head, st[rows, :n], x, p)[0])

    def all_rows(st, x, p):  # logits over every state row by one einsum, then the rows' weights
        q, _ = sc.head_qk(head, x, p)
        qq = jnp.zeros((st.shape[0],) + q.shape[1:], q.dtype).at[rows].set(q)
        w = sc.group_weights(sc.head_logits(head, qq, st[:, :n]),
                             jnp.arange(n)[None, None, :] <= jnp.zeros((st.shape[0], 1, 1), jnp.int32) + n)
        return w[rows, :, 0]

    out = [("select: top_k + sort (twin, before)", timed(sorted_, scores, q_pos, iters=args.iters))]
    for bits in (1, 2, 4):
        f = jax.jit(functools.partial(select, budget=b, digit_bits=bits))
        out.append((f"select: radix, {bits}-bit digits", timed(f, scores, q_pos, iters=args.iters)))
    kernel = sc.SpeContext(budget=b, scores_impl="pallas" if jax.default_backend() == "gpu" else "reference")
    by_kernel = jax.jit(lambda st, x, p: kernel.score_rows(head, st, x, p, rows, n))
    out += [("scores: in place (score_rows)", timed(in_place, state, x, pos, iters=args.iters)),
            ("scores: retrieval-logits kernel (scores_impl=pallas)", timed(by_kernel, state, x, pos,
                                                                            iters=args.iters)),
            ("scores: einsum over all state rows", timed(jax.jit(all_rows), state, x, pos, iters=args.iters)),
            ("scores: row copy + scores (before)", timed(copied, state, x, pos, iters=args.iters))]
    print(f"\n{' '.join(sys.argv)}  ({jax.devices()[0].device_kind})")
    print(f"rows {s}, KV heads {h}, slots {n}, budget {b}, retrieval head {args.group * h} x {args.head_dim}")
    print("| piece | ms per step |\n|---|---|")
    for name, ms in out:
        print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
