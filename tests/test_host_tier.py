"""SpeContext's selection buffer and host tier: the diff plan, diff loads from the host mirror or the pool
keep the buffer equal to the selection, the host gather runs on the host over host memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.pool import KVPool
from jaxkv.engine import host_tier as ht


def test_plan_diff_keeps_held_slots_and_fills_free_ones():
    buf_pos = jnp.asarray([[[3, 7, -1, 9]]], jnp.int32)
    idx = jnp.asarray([[[1, 3, 9, 12]]], jnp.int32)
    pos, need, dest = ht.plan_diff(buf_pos, idx, jnp.asarray([[4]], jnp.int32))
    assert need[0, 0].tolist() == [True, False, False, True]
    assert dest[0, 0].tolist() == [1, 0, 3, 2]  # 3 and 9 stay; 1, 12 take the slots of 7 and the empty one
    assert pos[0, 0].tolist() == [3, 1, 12, 9]


def _setup(rng, s=2, lsel=2, hkv=2, ps=4, d=8, n_pos=40):
    pages = n_pos // ps
    perm = rng.permutation(s * lsel * hkv * pages).reshape(s, lsel, hkv, pages).astype(np.int32)
    k = rng.standard_normal((s * lsel * hkv * pages * ps, d)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    return perm, k, v


def test_diff_loads_keep_the_buffer_equal_to_the_selection():
    rng = np.random.default_rng(0)
    s, lsel, hkv, ps, d, b = 2, 2, 2, 4, 8, 8
    perm, k_np, v_np = _setup(rng, s, lsel, hkv, ps, d)
    pool = KVPool(jnp.asarray(k_np).reshape(-1, ps, d), jnp.asarray(v_np).reshape(-1, ps, d),
                  jnp.zeros((k_np.shape[0] // ps, ps), jnp.int32), ps)
    host = (ht.to_host(jnp.asarray(k_np)), ht.to_host(jnp.asarray(v_np)))
    assert host[0].sharding.memory_kind == ht.host_memory_kind()
    rows = jnp.asarray([1, 0], jnp.int32)  # buffer rows of the two sequences
    sel = np.stack([np.stack([np.sort(rng.choice(20, b, replace=False)) for _ in range(hkv)]) for _ in range(s)])
    for src, chunk in ((pool, 5), (pool, None), (host, 5)):  # None: one round of every entry, no loop
        buf = ht.init_buffer(lsel, 2, hkv, b, d, jnp.float32)
        moved = 0
        for step in range(6):
            if step:  # churn 1-3 entries per head
                for r in range(s):
                    for h in range(hkv):
                        c = rng.integers(1, 4)
                        out = rng.choice(b, c, replace=False)
                        sel[r, h, out] = rng.choice(np.setdiff1d(np.arange(20 + step), sel[r, h]), c, replace=False)
                        sel[r, h] = np.sort(sel[r, h])
            idx = jnp.asarray(sel, jnp.int32)
            pos, need, dest = ht.plan_diff(buf.pos[rows], idx, jnp.full((s, hkv), b, jnp.int32))
            buf, n = ht.load_rows(buf, src, jnp.asarray(perm), rows, idx, dest, need, page_size=ps, chunk=chunk)
            buf = ht.SelBuffer(buf.k, buf.v, buf.pos.at[rows].set(pos))
            need_n = int(np.asarray(need).sum())
            assert int(n) == need_n if chunk is None else need_n <= int(n) < need_n + chunk  # whole rounds
            moved += int(n)
            bp, bk, bv = np.asarray(buf.pos), np.asarray(buf.k), np.asarray(buf.v)
            for r in range(s):
                br = int(rows[r])
                for h in range(hkv):
                    assert sorted(bp[br, h].tolist()) == sel[r, h].tolist()
                    for j, p in enumerate(bp[br, h]):
                        for layer in range(lsel):
                            slot = perm[r, layer, h, p // ps] * ps + p % ps
                            np.testing.assert_array_equal(bk[layer, br, h, j], k_np[slot])
                            np.testing.assert_array_equal(bv[layer, br, h, j], v_np[slot])
        assert moved < 6 * s * hkv * b  # after the first step only the churn (plus one round's padding) moves


def test_mirror_copies_written_slots_and_the_gather_runs_on_the_host():
    n, d = 32, 4
    pool_k = jnp.arange(n * d, dtype=jnp.float32).reshape(8, 4, d)
    host = (ht.to_host(jnp.zeros((n, d))), ht.to_host(jnp.zeros((n, d))))
    hk, hv = ht.mirror_slots(*host, pool_k, -pool_k, jnp.asarray([[3, -1], [17, 5]], jnp.int32))
    got = np.asarray(hk)
    assert set(np.flatnonzero(got.any(-1)).tolist()) == {3, 5, 17}
    np.testing.assert_array_equal(got[17], np.asarray(pool_k).reshape(n, d)[17])
    np.testing.assert_array_equal(np.asarray(hv)[5], -np.asarray(pool_k).reshape(n, d)[5])
    buf = ht.init_buffer(1, 1, 1, 4, d, jnp.float32)
    one = jnp.ones((1, 1, 4), bool)
    text = _load_text(buf, (hk, hv), one)
    assert "pinned_host" in text or "unpinned_host" in text
    assert '_xla_compute_type = "host"' in text


def _load_text(buf, host, load):
    """The lowered program of a diff load from the host mirror."""
    f = functools.partial(ht.load_rows, page_size=4, chunk=2)
    args = (buf, host, jnp.zeros((1, 1, 1, 8), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.zeros((1, 1, 4), jnp.int32), jnp.zeros((1, 1, 4), jnp.int32), load)
    return jax.jit(f).lower(*args).as_text()


@pytest.mark.parametrize("form", ["context", "keyword"])
def test_both_compute_on_forms_gather_on_the_host(form):
    """jax <= 0.10's compute_on("device_host") and the keyword form jax 0.11 has (compute_type=,
    out_memory_spaces=): the same rows, computed on the host, the results left in host memory."""
    n, d = 16, 4
    hk = ht.to_host(jnp.arange(n * d, dtype=jnp.float32).reshape(n, d))
    hv = ht.to_host(-jnp.arange(n * d, dtype=jnp.float32).reshape(n, d))
    rows = jax.device_put(jnp.asarray([[3, 0], [15, 7]], jnp.int32), ht.host_sharding())
    try:
        gather = ht._on_host(ht._gather_host_rows, 2, form=form)
    except TypeError as e:
        pytest.skip(f"this jax has no {form} form of compute_on: {e}")
    k, v = jax.jit(gather)(hk, hv, rows)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(hk)[np.asarray(rows)])
    np.testing.assert_array_equal(np.asarray(v), np.asarray(hv)[np.asarray(rows)])
    text = jax.jit(gather).lower(hk, hv, rows).as_text()
    assert '_xla_compute_type = "host"' in text

