"""SpeContext's selection buffer and host tier: the diff plan, diff loads from the host mirror or the pool
keep the buffer equal to the selection, the host gather runs on the host over host memory."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.pool import KVPool
from jaxkv.policies.retrieve import host_tier as ht


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


def _selections(rng, s, hkv, b, steps=8):
    """A selection per step: b ascending positions per (sequence, KV head), 1-3 entries churned per step,
    replacements drawn from positions that left the selection before as well as new ones."""
    sel = np.stack([np.stack([np.sort(rng.choice(20, b, replace=False)) for _ in range(hkv)])
                    for _ in range(s)])
    out = [sel.copy()]
    for step in range(1, steps):
        for r in range(s):
            for h in range(hkv):
                c = rng.integers(1, 4)
                drop = rng.choice(b, c, replace=False)
                sel[r, h, drop] = rng.choice(np.setdiff1d(np.arange(20 + step), sel[r, h]), c, replace=False)
                sel[r, h] = np.sort(sel[r, h])
        out.append(sel.copy())
    return out


def test_diff_loads_keep_the_buffer_equal_to_the_selection():
    """Visible slots are exactly the selection and every held slot holds its position's K/V after every
    step; a resident buffer (W = 2B) moves fewer rows: positions selected again while held need no load."""
    rng = np.random.default_rng(0)
    s, lsel, hkv, ps, d, b = 2, 2, 2, 4, 8, 8
    perm, k_np, v_np = _setup(rng, s, lsel, hkv, ps, d)
    pool = KVPool(jnp.asarray(k_np).reshape(-1, ps, d), jnp.asarray(v_np).reshape(-1, ps, d),
                  jnp.zeros((k_np.shape[0] // ps, ps), jnp.int32), ps)
    host = (ht.to_host(jnp.asarray(k_np)), ht.to_host(jnp.asarray(v_np)))
    assert host[0].sharding.memory_kind == ht.host_memory_kind()
    rows = jnp.asarray([1, 0], jnp.int32)  # buffer rows of the two sequences
    sels = _selections(rng, s, hkv, b)
    needed = {}
    for resident in (1, 2):
        # chunk None: one round of every entry, no loop; first > 0: `start_loads`, the first rows per layer
        for src, chunk, first in ((pool, 5, 0), (pool, None, 0), (host, 5, 0), (host, 5, 10)):
            buf = ht.init_buffer(lsel, 2, hkv, resident * b, d, jnp.float32)
            moved = total_need = 0
            for step, sel in enumerate(sels):
                idx = jnp.asarray(sel, jnp.int32)
                pos, held, seen, need, dest = ht.plan_resident(buf.held[rows], buf.seen[rows], idx,
                                                               jnp.full((s, hkv), b, jnp.int32),
                                                               jnp.full((s,), step, jnp.int32))
                need_n = int(np.asarray(need).sum())
                if first:
                    before = np.stack(buf.k)
                    buf, n, pending = ht.start_loads(buf, src, jnp.asarray(perm), rows, idx, dest, need,
                                                     page_size=ps, chunk=chunk, first=first)
                    later = max(0, -(-(need_n - first) // chunk))   # serial rounds past the first rows
                    assert len(pending) == lsel and int(n) == first + later * chunk
                    if need_n <= first:  # nothing written yet: every row waits for its layer's finish_load
                        np.testing.assert_array_equal(np.stack(buf.k), before)
                    for j, p in enumerate(pending):
                        buf = ht.finish_load(buf, j, p)
                else:
                    buf, n = ht.load_rows(buf, src, jnp.asarray(perm), rows, idx, dest, need, page_size=ps,
                                          chunk=chunk)
                buf = dataclasses.replace(buf, pos=buf.pos.at[rows].set(pos),
                                          held=buf.held.at[rows].set(held), seen=buf.seen.at[rows].set(seen))
                # one round of every entry, or whole rounds of `chunk` (overlapped: at least `first`)
                assert int(n) == need_n if chunk is None else need_n <= int(n) < max(need_n, first) + chunk
                moved += int(n)
                total_need += need_n if step else 0
                bp, bh = np.asarray(buf.pos), np.asarray(buf.held)
                bk, bv = np.stack(buf.k), np.stack(buf.v)
                for r in range(s):
                    br = int(rows[r])
                    for h in range(hkv):
                        assert sorted(p for p in bp[br, h].tolist() if p >= 0) == sel[r, h].tolist()
                        vis = bp[br, h] >= 0
                        np.testing.assert_array_equal(bp[br, h][vis], bh[br, h][vis])
                        for j, p in enumerate(bh[br, h]):   # every held slot, visible or not, holds its K/V
                            if p < 0:
                                continue
                            for layer in range(lsel):
                                slot = perm[r, layer, h, p // ps] * ps + p % ps
                                np.testing.assert_array_equal(bk[layer, br, h, j], k_np[slot])
                                np.testing.assert_array_equal(bv[layer, br, h, j], v_np[slot])
            assert moved < len(sels) * s * hkv * b  # after the first step only the churn (+ padding) moves
            needed.setdefault(resident, set()).add(total_need)
    assert len(needed[1]) == len(needed[2]) == 1        # the same rows whatever the source
    assert needed[2].pop() < needed[1].pop()


def test_resident_buffer_loads_less_and_evicts_the_least_recently_selected():
    """W = 2B: an entry that left the selection and comes back is a hit; a new entry takes an empty slot
    first, then the slot selected longest ago."""
    held = jnp.asarray([[[10, 20, 30, 40, -1, -1]]], jnp.int32)
    seen = jnp.asarray([[[5, 3, 5, 4, -1, -1]]], jnp.int32)
    idx = jnp.asarray([[[20, 50, 60]]], jnp.int32)   # 20 held (selected at step 3), 50 and 60 new
    pos, held2, seen2, need, dest = ht.plan_resident(held, seen, idx, jnp.asarray([[3]]), jnp.asarray([6]))
    assert need[0, 0].tolist() == [False, True, True]
    assert dest[0, 0].tolist() == [1, 4, 5]            # the two empty slots
    assert pos[0, 0].tolist() == [-1, 20, -1, -1, 50, 60]
    assert held2[0, 0].tolist() == [10, 20, 30, 40, 50, 60] and seen2[0, 0].tolist() == [5, 6, 5, 4, 6, 6]
    idx = jnp.asarray([[[10, 70, 80]]], jnp.int32)     # no empty slot left: evict 40 (seen 4), then 30 (5)
    pos, held3, _, need, dest = ht.plan_resident(held2, seen2, idx, jnp.asarray([[3]]), jnp.asarray([7]))
    assert need[0, 0].tolist() == [False, True, True] and dest[0, 0].tolist() == [0, 3, 2]
    assert held3[0, 0].tolist() == [10, 20, 80, 70, 50, 60]


def test_mirror_copies_written_slots_and_the_gather_runs_on_the_host():
    n, d = 32, 4
    pool_k = jnp.arange(n * d, dtype=jnp.float32).reshape(8, 4, d)
    host = (ht.to_host(jnp.zeros((n, d))), ht.to_host(jnp.zeros((n, d))))
    hk, hv = ht.mirror_slots(*host, pool_k, -pool_k, jnp.asarray([[3, -1], [17, 5]], jnp.int32))
    assert hk.sharding.memory_kind == hv.sharding.memory_kind == ht.host_memory_kind()  # stays on the host
    got = np.asarray(hk)
    assert set(np.flatnonzero(got.any(-1)).tolist()) == {3, 5, 17}
    np.testing.assert_array_equal(got[17], np.asarray(pool_k).reshape(n, d)[17])
    np.testing.assert_array_equal(np.asarray(hv)[5], -np.asarray(pool_k).reshape(n, d)[5])
    hk2, _ = ht.move_host_rows(hk, hv, jnp.asarray([17, 3]), jnp.asarray([30, n]))  # n: out of range, dropped
    assert hk2.sharding.memory_kind == ht.host_memory_kind()
    np.testing.assert_array_equal(np.asarray(hk2)[30], got[17])
    assert set(np.flatnonzero(np.asarray(hk2).any(-1)).tolist()) == {3, 5, 17, 30}
    hk, hv = ht.mirror_slots(ht.to_host(jnp.zeros((n, d))), ht.to_host(jnp.zeros((n, d))), pool_k, -pool_k,
                             jnp.asarray([[3, -1], [17, 5]], jnp.int32))
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



def test_layer_groups_cover_every_layer_once_in_doubling_groups():
    for n in (1, 2, 5, 15, 31):
        groups = ht.layer_groups(n)
        assert [j for g in groups for j in g] == list(range(n))
        sizes = [len(g) for g in groups]
        assert sizes[:2] == [1, 1][:n] and all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))
    assert len(ht.layer_groups(31)) == 6   # log2-many host gathers a step, not one per layer
