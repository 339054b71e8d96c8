"""SpeContext host tier building block: K/V in pinned_host memory, diff prefetch == the selection."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine import host_tier as ht


def test_diff_prefetch_keeps_the_buffer_equal_to_the_selection():
    rng = np.random.default_rng(0)
    s, lh, hkv, ps, d, b, cap = 2, 2, 2, 4, 8, 8, 4
    n_pos = 40
    pages = n_pos // ps
    n_slots = s * lh * hkv * pages * ps
    perm = rng.permutation(s * lh * hkv * pages).reshape(s, lh, hkv, pages).astype(np.int32)
    host_k_np = rng.standard_normal((lh, n_slots, d)).astype(np.float32)
    host_v_np = rng.standard_normal((lh, n_slots, d)).astype(np.float32)
    host_k, host_v = ht.to_host(jnp.asarray(host_k_np)), ht.to_host(jnp.asarray(host_v_np))
    assert host_k.sharding.memory_kind == "pinned_host"
    pt = jnp.asarray(perm)
    buf_k = jnp.zeros((s, lh, hkv, b, d), jnp.float32)
    buf_v = jnp.zeros_like(buf_k)
    buf_pos = jnp.full((s, hkv, b), -1, jnp.int32)
    sel = np.stack([np.stack([np.sort(rng.choice(20, b, replace=False)) for _ in range(hkv)])
                    for _ in range(s)])
    count = jnp.full((s, hkv), b, jnp.int32)
    moved_diff = moved_full = 0
    for step in range(8):
        if step:  # churn: replace 1-3 entries per head by unselected positions, as a decoding selection does
            for r in range(s):
                for h in range(hkv):
                    k = rng.integers(1, 4)
                    out = rng.choice(b, k, replace=False)
                    pool = np.setdiff1d(np.arange(20 + step), sel[r, h])
                    sel[r, h, out] = rng.choice(pool, k, replace=False)
                    sel[r, h] = np.sort(sel[r, h])
        idx = jnp.asarray(sel, jnp.int32)
        load, dest, n_load = ht.diff_plan(buf_pos, idx, count, cap)
        if int(n_load.max()) > cap:
            buf_k, buf_v, buf_pos = ht.full_update(host_k, host_v, buf_k, buf_v, buf_pos, pt, idx, count,
                                                   page_size=ps)
            moved_diff += ht.transfer_bytes(s, lh, hkv, b, d, 4)
        else:
            buf_k, buf_v, buf_pos = ht.elastic_update(host_k, host_v, buf_k, buf_v, buf_pos, pt, load, dest,
                                                      page_size=ps)
            moved_diff += ht.transfer_bytes(s, lh, hkv, cap, d, 4)
        moved_full += ht.transfer_bytes(s, lh, hkv, b, d, 4)
        bp, bk, bv = np.asarray(buf_pos), np.asarray(buf_k), np.asarray(buf_v)
        for r in range(s):
            for h in range(hkv):
                assert sorted(bp[r, h][bp[r, h] >= 0].tolist()) == sel[r, h].tolist()
                for j in np.flatnonzero(bp[r, h] >= 0):
                    p = bp[r, h, j]
                    for layer in range(lh):
                        slot = perm[r, layer, h, p // ps] * ps + p % ps
                        np.testing.assert_array_equal(bk[r, layer, h, j], host_k_np[layer, slot])
                        np.testing.assert_array_equal(bv[r, layer, h, j], host_v_np[layer, slot])
    assert moved_diff < moved_full  # the first step loads everything (full); later steps move `cap` rows


def test_diff_plan_counts_only_missing_positions():
    buf_pos = jnp.asarray([[[3, 7, -1, 9]]], jnp.int32)
    idx = jnp.asarray([[[1, 3, 9, 12]]], jnp.int32)
    load, dest, n = ht.diff_plan(buf_pos, idx, jnp.asarray([[4]], jnp.int32), cap=3)
    assert int(n[0, 0]) == 2
    assert load[0, 0].tolist() == [1, 12, -1]
    assert dest[0, 0].tolist() == [1, 2, -1]  # slots holding 7 (dropped) and the empty one
    assert jax.devices()[0].memory("pinned_host") is not None


def test_gather_runs_on_the_host_over_pinned_memory():
    """Only the gathered [S, Lh, Hkv, cap, D] block crosses to the device: the gather is a host computation
    over the pinned_host arrays."""
    lh, n, d, s, hkv, b, cap, ps = 2, 64, 8, 1, 2, 8, 4, 4
    host_k = ht.to_host(jnp.zeros((lh, n, d), jnp.float32))
    args = (host_k, host_k, jnp.zeros((s, lh, hkv, b, d)), jnp.zeros((s, lh, hkv, b, d)),
            jnp.full((s, hkv, b), -1, jnp.int32), jnp.zeros((s, lh, hkv, n // ps), jnp.int32),
            jnp.zeros((s, hkv, cap), jnp.int32), jnp.zeros((s, hkv, cap), jnp.int32))
    text = ht.elastic_update.lower(*args, page_size=ps).as_text()
    assert 'memory_kind = "pinned_host"' in text and '_xla_compute_type = "host"' in text
