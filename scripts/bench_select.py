"""The per-step selection pieces of a shared retrieval policy, timed side by side (issue 12): the radix
`select` against its top_k + sort twin `select_sorted`, SpeContext's in-place `score_rows` against
gathering the key-cache rows and calling `scores` (what the engine did before), and the selection buffer's
diff load (`host_tier.load_rows`, a `--churn` fraction of the selection new each step) against the
windowed scatter it replaced.

    python scripts/bench_select.py --batch 16 --kv-heads 8 --slots 34816 --budget 1024   # GPU
    python scripts/bench_select.py --small                                                # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
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


def timed_donated(f, buf, *args, iters: int) -> float:
    """As `timed` for f(buf, *args) -> buf with buf donated (the engine updates the buffer in place)."""
    import jax
    import numpy as np

    buf = jax.block_until_ready(f(buf, *args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        buf = jax.block_until_ready(f(buf, *args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def load_windowed(buf, src, page_table, buf_rows, idx, dest, load, *, page_size, chunk):
    """The buffer load before the flat row copy: one scatter with a [Lsel, 1, 1, 1, D] window per entry."""
    import jax
    import jax.numpy as jnp

    from jaxkv.engine import host_tier

    s, hkv, b = idx.shape
    flat = load.reshape(-1)
    n = jnp.sum(flat).astype(jnp.int32)
    rank = jnp.where(flat, jnp.cumsum(flat) - 1, flat.shape[0] + chunk)
    size = -(-flat.shape[0] // chunk) * chunk
    order = jnp.zeros((size,), jnp.int32).at[rank].set(jnp.arange(flat.shape[0], dtype=jnp.int32),
                                                       mode="drop")

    def one(state):
        r, k_buf, v_buf = state
        e = jax.lax.dynamic_slice(order, (r * chunk,), (chunk,))
        real = r * chunk + jnp.arange(chunk) < n
        si, hi, ji = e // (hkv * b), (e // b) % hkv, e % b
        rows = host_tier._pool_slots(page_table, (si, hi, idx[si, hi, ji]), page_size)
        k, v = host_tier._gather(src, rows)
        row = jnp.where(real, buf_rows[si], k_buf.shape[1])
        slot = dest[si, hi, ji]
        k_buf = k_buf.at[:, row, hi, slot].set(k.astype(k_buf.dtype), mode="drop")
        v_buf = v_buf.at[:, row, hi, slot].set(v.astype(v_buf.dtype), mode="drop")
        return r + 1, k_buf, v_buf

    _, k_buf, v_buf = jax.lax.while_loop(lambda st: st[0] < (n + chunk - 1) // chunk, one,
                                         (jnp.int32(0), jnp.stack(buf.k), jnp.stack(buf.v)))
    return dataclasses.replace(buf, k=tuple(k_buf), v=tuple(v_buf))


def load_rows_table(args, iters: int) -> list[tuple[str, float]]:
    """The diff load of one step: a `--churn` fraction of every (row, KV head)'s selection is new."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.cache.pool import KVPool
    from jaxkv.engine import host_tier

    s, h, b, d, ps = args.batch, args.kv_heads, args.budget, args.kv_dim, args.page_size
    lsel, npg = args.layers, -(-args.slots // ps)
    rng = np.random.default_rng(0)
    total = s * lsel * h * npg
    kk, kv = jax.random.split(jax.random.PRNGKey(1))
    pool = KVPool(k=jax.random.normal(kk, (total, ps, d), jnp.bfloat16),
                  v=jax.random.normal(kv, (total, ps, d), jnp.bfloat16),
                  pos=jnp.zeros((total, ps), jnp.int32), page_size=ps)
    page_table = jnp.asarray(rng.permutation(total).reshape(s, lsel, h, npg), jnp.int32)
    idx = jnp.asarray(np.sort(rng.integers(0, args.slots, (s, h, b)), axis=-1), jnp.int32)
    dest = jnp.asarray(np.argsort(rng.random((s, h, b)), axis=-1), jnp.int32)
    load = jnp.asarray(rng.random((s, h, b)) < args.churn)
    buf_rows = jnp.arange(s, dtype=jnp.int32)
    chunk = max(1, s * h * b // 4)  # the windowed load's device rounds (4 per step at full churn)
    out, bufs = [], []
    for name, fn, c in (("load: windowed scatter, 4 rounds (before)", load_windowed, chunk),
                        ("load: flat row copy, one round (load_rows)",
                         lambda *a, **k: host_tier.load_rows(*a, **k)[0], None)):
        f = jax.jit(functools.partial(fn, page_size=ps, chunk=c), donate_argnums=0)
        buf = host_tier.init_buffer(lsel, s, h, b, d, jnp.bfloat16)
        out.append((f"{name}, churn {args.churn:g}",
                    timed_donated(f, buf, pool, page_table, buf_rows, idx, dest, load, iters=iters)))
        bufs.append(f(host_tier.init_buffer(lsel, s, h, b, d, jnp.bfloat16), pool, page_table, buf_rows, idx,
                      dest, load))
    for a, b_ in zip(jax.tree.leaves(bufs[0]), jax.tree.leaves(bufs[1])):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b_.astype(jnp.float32)))
    return out


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
    ap.add_argument("--layers", type=int, default=15, help="buffered layers (load rows)")
    ap.add_argument("--kv-dim", type=int, default=64, help="model head dim (load rows)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--churn", type=float, default=1.0, help="new fraction of the selection per step")
    ap.add_argument("--only-load", action="store_true", help="only the load rows")
    ap.add_argument("--key-dtype", default="float32",
                    help="the retrieval head's key cache dtype (scores rows)")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args(argv)
    if args.small:
        args.batch, args.kv_heads, args.head_dim, args.hidden, args.slots, args.budget, args.iters = \
            2, 2, 8, 32, 256, 32, 3
        args.layers, args.kv_dim = 2, 8
    if args.only_load:
        return report(args, load_rows_table(args, args.iters))
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
    pol = sc.SpeContext(budget=b, scores_impl="xla")
    kdt = jnp.dtype(args.key_dtype)
    state = jax.random.normal(key, (s + 2, n, h, args.head_dim), kdt)
    state_hm = jnp.swapaxes(state, 1, 2)  # head-major [R, Hkv, N, D]
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

    def head_major(st, x, p, how):
        """Logits over a head-major key cache: each (row, KV head)'s keys one contiguous [N, D] block."""
        q, _ = sc.head_qk(head, x, p)
        qg = q[:, 0].reshape(s, h, args.group, args.head_dim) * args.head_dim ** -0.5
        keys = st[rows, :, :n]
        if how == "reduce":
            logits = jnp.sum(qg[:, :, :, None, :] * keys[:, :, None], axis=-1)
        elif how == "dot":
            logits = jnp.einsum("shgd,shnd->shgn", qg, keys.astype(jnp.float32))
        else:  # "dot-lowp": the query in the key dtype, fp32 accumulation
            logits = jnp.einsum("shgd,shnd->shgn", qg.astype(keys.dtype), keys,
                                preferred_element_type=jnp.float32)
        return sc.group_weights(logits[:, :, :, None],
                                jnp.arange(n)[None, None, :] <= p[:, -1:, None])[:, :, 0]

    hm = {how: timed(jax.jit(functools.partial(head_major, how=how)), state_hm, x, pos, iters=args.iters)
          for how in ("reduce", "dot", "dot-lowp")}
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
    out += [(f"scores: head-major cache, {how}", ms) for how, ms in hm.items()]
    return report(args, out + load_rows_table(args, args.iters))


def report(args, out) -> int:
    import jax

    s, h, n, b = args.batch, args.kv_heads, args.slots, args.budget
    print(f"\n{' '.join(sys.argv)}  ({jax.devices()[0].device_kind})")
    print(f"rows {s}, KV heads {h}, slots {n}, budget {b}, "
          f"retrieval head {args.group * h} x {args.head_dim}, "
          f"keys {args.key_dtype}")
    print("| piece | ms per step |\n|---|---|")
    for name, ms in out:
        print(f"| {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
