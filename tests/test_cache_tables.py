"""HeadPageTables: slot bookkeeping driven through write_kv + the reference attention vs a dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.allocator import OutOfPages, PageAllocator
from jaxkv.cache.pool import init_pool, write_kv
from jaxkv.cache.tables import HeadPageTables
from pallas_kernels.paged_attention.reference import paged_attention


def oracle(q, kd, vd, n_ctx, q_pos, sink, window, scale):
    """q [Hq, D] at position p over a head's full history kd/vd [H, n_ctx, D]; float64."""
    Hq, D = q.shape
    H = kd.shape[0]
    G = Hq // H
    k = np.arange(n_ctx)
    out = np.zeros((Hq, D))
    for qh in range(Hq):
        h = qh // G
        vis = k <= q_pos
        if window[h] > 0:
            vis &= (k > q_pos - window[h]) | (k < sink[h])
        s = kd[h, :n_ctx][vis].astype(np.float64) @ q[qh] * scale
        w = np.exp(s - s.max())
        out[qh] = w @ vd[h, :n_ctx][vis] / w.sum()
    return out


@jax.jit
def _layer(pool, k, v, pos, slots, q, pt, lens, q_seq, sink, window):
    pool = write_kv(pool, k, v, pos, slots)
    out, _ = paged_attention(q, pool.k, pool.v, pool.pos, pt, lens, q_seq, pos, sink, window,
                             scale=8 ** -0.5)
    return pool, out


def test_generation_mixed_heads_matches_dense():
    rng = np.random.default_rng(0)
    L, H, G, D, ps, mst = 2, 3, 2, 8, 4, 8
    sink = np.array([[0, 2, 0], [1, 0, 0]], np.int32)
    window = np.array([[0, 5, 3], [6, 0, 2]], np.int32)
    alloc = PageAllocator(200)
    tables = HeadPageTables(L, H, ps, alloc, sink, window, mst)
    pool = init_pool(200, ps, D, jnp.float32)
    total = {"a": 100, "b": 60}
    prompt = {"a": 37, "b": 11}
    kd = {s: rng.standard_normal((L, H, n, D)).astype(np.float32) for s, n in total.items()}
    vd = {s: rng.standard_normal((L, H, n, D)).astype(np.float32) for s, n in total.items()}
    done = {"a": 0, "b": 0}
    T, S, P = 16, 2, 32
    cap_pages = tables.capacity // ps
    max_local = 0
    while any(done[s] < total[s] for s in total):
        seqs = [s for s in total if done[s] < total[s]]
        chunks = {s: min(mst, prompt[s] - done[s]) if done[s] < prompt[s] else 1 for s in seqs}
        need = sum(tables.pages_needed(s, chunks[s]) for s in seqs)
        free_before = alloc.num_free
        slots = np.full((T, L, H), -1, np.int32)
        pos = np.zeros(T, np.int32)
        q_seq = np.full(T, -1, np.int32)
        off = 0
        for row, s in enumerate(seqs):
            n = chunks[s]
            p = np.arange(done[s], done[s] + n, dtype=np.int32)
            slots[off:off + n] = tables.append(s, p)
            pos[off:off + n], q_seq[off:off + n] = p, row
            off += n
        assert free_before - alloc.num_free == need  # pages_needed predicted the allocation
        pt = np.zeros((S, L, H, P), np.int32)
        lens = np.zeros((S, L, H), np.int32)
        tables.fill_step(seqs, pt, lens)
        q = rng.standard_normal((T, H * G, D)).astype(np.float32)
        for layer in range(L):
            k = np.zeros((T, H, D), np.float32)
            v = np.zeros((T, H, D), np.float32)
            for t in range(off):
                s = seqs[q_seq[t]]
                k[t], v[t] = kd[s][layer, :, pos[t]], vd[s][layer, :, pos[t]]
            pool, out = _layer(pool, k, v, pos, slots[:, layer], q, pt[:, layer], lens[:, layer], q_seq,
                               sink[layer], window[layer])
            out = np.asarray(out)
            for t in range(off):
                s = seqs[q_seq[t]]
                ref = oracle(q[t], kd[s][layer], vd[s][layer], pos[t] + 1, pos[t], sink[layer], window[layer],
                             8 ** -0.5)
                np.testing.assert_allclose(out[t], ref, rtol=1e-5, atol=1e-5)
            assert (out[off:] == 0).all()
        for s in seqs:
            done[s] += chunks[s]
            npages = np.array([[len(p) for p in row] for row in tables.page_lists(s)])
            local = window > 0
            assert (npages[local] <= cap_pages[local]).all()
            max_local = max(max_local, npages[local].max())
            np.testing.assert_array_equal(npages[~local], -(-done[s] // ps))
    assert max_local == cap_pages[window > 0].max()  # rings filled up and stayed bounded
    assert _layer._cache_size() == 1  # fixed bucket shapes: one compilation
    used = 200 - alloc.num_free
    tables.release("a")
    tables.release("b")
    tables.release("unknown")  # no-op
    assert alloc.num_free == 200 and used > 0


def test_out_of_pages_leaves_state_untouched():
    alloc = PageAllocator(5)
    tables = HeadPageTables(1, 2, 4, alloc, np.zeros((1, 2)), np.zeros((1, 2)), 8)
    tables.append(0, np.arange(4))  # 2 pages
    before = (alloc.num_free, tables.lengths(0).copy(), tables.page_lists(0))
    with pytest.raises(OutOfPages):
        tables.append(0, np.arange(4, 12))  # needs 4 more, 3 free
    with pytest.raises(OutOfPages):
        tables.append(1, np.arange(16))
    assert 1 not in tables
    assert alloc.num_free == before[0]
    np.testing.assert_array_equal(tables.lengths(0), before[1])
    assert tables.pages_needed(0, 8) == 4 and tables.pages_needed(None, 8) == 4
    with pytest.raises(ValueError, match="increase"):
        tables.append(0, np.array([3]))
    assert tables.num_tokens(0) == 4
    ring = HeadPageTables(1, 1, 4, alloc, np.zeros((1, 1)), np.ones((1, 1)), 2)
    with pytest.raises(ValueError, match="max_step_tokens"):
        ring.append(0, np.arange(3))


def test_slots_layout_and_fill_step_padding():
    alloc = PageAllocator(50)
    sink = np.array([[0, 1]])
    window = np.array([[0, 2]])
    tables = HeadPageTables(1, 2, 2, alloc, sink, window, 1)
    # local head capacity: round_up(1 + 2 - 1 + 1, 2) = 4 slots, ring of 3 after 1 sink slot
    assert tables.capacity.tolist() == [[0, 4]]
    slots = np.concatenate([tables.append("s", np.array([p])) for p in range(7)])  # [7, 1, 2]
    glob = tables.page_lists("s")[0][0]
    loc = tables.page_lists("s")[0][1]
    assert len(glob) == 4 and len(loc) == 2
    expect_g = [glob[i // 2] * 2 + i % 2 for i in range(7)]
    ring_idx = [0, 1, 2, 3, 1, 2, 3]
    expect_l = [loc[i // 2] * 2 + i % 2 for i in ring_idx]
    np.testing.assert_array_equal(slots[:, 0, 0], expect_g)
    np.testing.assert_array_equal(slots[:, 0, 1], expect_l)
    np.testing.assert_array_equal(tables.lengths("s"), [[7, 4]])
    pt = np.zeros((3, 1, 2, 5), np.int32)
    lens = np.ones((3, 1, 2), np.int32)
    tables.fill_step(["s"], pt, lens)
    np.testing.assert_array_equal(pt[0, 0, 0], list(glob) + [-1])
    np.testing.assert_array_equal(pt[0, 0, 1], list(loc) + [-1] * 3)
    assert (pt[1:] == -1).all() and (lens[1:] == 0).all() and lens[0].tolist() == [[7, 4]]
    assert tables.max_pages("s") == 4 and tables.max_pages("nope") == 0
    with pytest.raises(ValueError, match="bucket"):
        tables.fill_step(["s"], np.zeros((1, 1, 2, 3), np.int32), np.zeros((1, 1, 2), np.int32))
    kinds = np.array([["global", "local"]])
    assert tables.pages_in_use_by_kind(kinds) == {"global": 4, "local": 2}


def test_adopt_prefix_shares_pages():
    alloc = PageAllocator(40)
    z = np.zeros((2, 2), np.int32)
    tables = HeadPageTables(2, 2, 4, alloc, z, z, 8)
    tables.append("a", np.arange(9))  # 3 pages per head
    lists = tables.page_lists("a")
    blocks = [np.array([[lists[i][h][b] for h in range(2)] for i in range(2)]) for b in range(2)]
    tables.adopt_prefix("b", blocks, 8)
    assert tables.num_tokens("b") == 8 and (tables.lengths("b") == 8).all()
    assert (alloc.refcount(np.stack(blocks)) == 2).all()
    slots = tables.append("b", np.arange(8, 10))
    assert (slots // 4 != np.stack(blocks)).all()  # new tokens go to fresh pages
    tables.release("a")
    assert (alloc.refcount(np.stack(blocks)) == 1).all()
    tables.release("b")
    assert alloc.num_free == 40
    with pytest.raises(ValueError, match="tokens"):
        tables.adopt_prefix("c", blocks, 7)
    local = HeadPageTables(2, 2, 4, alloc, z, z + np.array([[0, 3], [0, 0]]), 8)
    with pytest.raises(ValueError, match="full history"):
        local.adopt_prefix("c", blocks, 8)


def test_host_modules_never_import_jax():
    import subprocess
    import sys

    code = ("import sys, jaxkv.cache.tables, jaxkv.cache.prefix, jaxkv.cache.head_classes, "
            "jaxkv.cache.allocator; assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_append_not_through_pool_keeps_the_last_writer_of_each_ring_slot():
    # A fresh prompt longer than the ring (attended from its own K/V): the slots a later token of the same
    # append takes are skipped, and the pages end up exactly as after token-by-token appends.
    L, H, ps = 1, 2, 4
    sink, window = np.array([[0, 2]]), np.array([[0, 5]])
    n = 40
    fast = HeadPageTables(L, H, ps, PageAllocator(64), sink, window, max_step_tokens=4)
    slow = HeadPageTables(L, H, ps, PageAllocator(64), sink, window, max_step_tokens=4)
    with pytest.raises(ValueError, match="max_step_tokens"):
        fast.append("s", np.arange(n))
    slots = fast.append("s", np.arange(n), through_pool=False)
    final_fast, final_slow = {}, {}
    slow_slots = [slow.append("s", np.array([i]))[0, 0] for i in range(n)]

    def storage(tables, h, slot):  # flat slot -> index in the head's own storage order (page ids differ)
        return tables.page_lists("s")[0][h].tolist().index(slot // ps) * ps + slot % ps

    for i in range(n):
        for h in range(H):
            if slots[i, 0, h] >= 0:
                final_fast[(h, storage(fast, h, int(slots[i, 0, h])))] = i
            final_slow[(h, storage(slow, h, int(slow_slots[i][h])))] = i
    assert final_fast == final_slow  # same storage index -> token map once the append is done
    assert (slots[:, 0, 0] >= 0).all()  # the global head writes every token
    assert (slots[:, 0, 1] >= 0).sum() == fast.lengths("s")[0, 1]  # the ring head writes only what it keeps
    np.testing.assert_array_equal(fast.lengths("s"), slow.lengths("s"))


def test_slots_follow_the_ring_rule_per_head_even_when_heads_stored_different_counts():
    # Heads of one ring rule normally share their stored count; a compaction (per-head storage) breaks
    # that, and each head must still get storage index written[h] + j under its own rule.
    L, H, ps = 2, 3, 4
    sink, window = np.array([[0, 2, 2], [0, 0, 3]]), np.array([[0, 5, 5], [0, 0, 6]])
    t = HeadPageTables(L, H, ps, PageAllocator(256), sink, window, max_step_tokens=4)
    t.append("s", np.arange(4))
    t._get("s").written[0, 1] = 2  # as if head (0, 1) had been compacted to 2 tokens
    slots = t.append("s", np.arange(4, 8))
    seq = t._get("s")
    for layer in range(L):
        for h in range(H):
            w = int(seq.written[layer, h]) - 4
            for j in range(4):
                i = w + j
                sk, ring = sink[layer, h], int(t.capacity[layer, h] - sink[layer, h])
                s = sk + (i - sk) % ring if window[layer, h] and i >= sk else i
                want = seq.table[layer, h, s // ps] * ps + s % ps
                assert slots[j, layer, h] == want
