"""The paged-attention reference twin against an independent dense numpy oracle.

The oracle never sees pages: it holds dense K/V ``[B, Hkv, Tk, D]`` indexed by token position plus a
``present[B, Hkv, Tk]`` mask (which positions a head stores), and applies the contract's causal / window
/ sink rule in float64. The paged layouts are packed here by hand (scrambled page ids, ring orders) so
the test does not depend on jaxkv's own bookkeeping.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.pool import init_pool, write_kv
from pallas_kernels.paged_attention.reference import paged_attention

RTOL = ATOL = 1e-5


def dense_oracle(q, kd, vd, present, q_seq, q_pos, sink, window, scale):
    """q [T, Hq, D]; kd, vd [B, Hkv, Tk, D]; present [B, Hkv, Tk]. Returns out [T, Hq, D], lse [T, Hq]."""
    T, Hq, D = q.shape
    _, Hkv, Tk, _ = kd.shape
    G = Hq // Hkv
    out = np.zeros((T, Hq, D))
    lse = np.full((T, Hq), -np.inf)
    k_pos = np.arange(Tk)
    for t in range(T):
        b, p = q_seq[t], q_pos[t]
        if b < 0:
            continue
        for qh in range(Hq):
            h = qh // G
            vis = present[b, h] & (k_pos <= p)
            if window[h] > 0:
                vis &= (k_pos > p - window[h]) | (k_pos < sink[h])
            if not vis.any():
                continue
            s = (kd[b, h][vis].astype(np.float64) @ q[t, qh].astype(np.float64)) * scale
            m = s.max()
            w = np.exp(s - m)
            out[t, qh] = (w / w.sum()) @ vd[b, h][vis].astype(np.float64)
            lse[t, qh] = m + np.log(w.sum())
    return out, lse


def pack_pages(stored, kd, vd, page_size, num_pages, rng, max_pages=None):
    """Pack per-(b, h) stored position lists (in storage order) into scrambled pages.

    stored[b][h] is a list of positions. Returns numpy k_pages, v_pages, slot_pos, page_table, lengths.
    """
    B, Hkv, _, D = kd.shape
    need = [[-(-len(stored[b][h]) // page_size) for h in range(Hkv)] for b in range(B)]
    mp = max_pages or max(1, max(max(r) for r in need))
    free = list(rng.permutation(num_pages))
    assert sum(map(sum, need)) <= num_pages
    k_pages = rng.standard_normal((num_pages, page_size, D)).astype(np.float32)  # garbage in unused slots
    v_pages = rng.standard_normal((num_pages, page_size, D)).astype(np.float32)
    slot_pos = rng.integers(0, 4, (num_pages, page_size)).astype(np.int32)  # stale, masked by length
    page_table = np.full((B, Hkv, mp), -1, np.int32)
    lengths = np.zeros((B, Hkv), np.int32)
    for b in range(B):
        for h in range(Hkv):
            pages = [free.pop() for _ in range(need[b][h])]
            page_table[b, h, : len(pages)] = pages
            for i, p in enumerate(stored[b][h]):
                pg, off = pages[i // page_size], i % page_size
                k_pages[pg, off] = kd[b, h, p]
                v_pages[pg, off] = vd[b, h, p]
                slot_pos[pg, off] = p
            lengths[b, h] = len(stored[b][h])
    return k_pages, v_pages, slot_pos, page_table, lengths


def present_from(stored, B, Hkv, Tk):
    present = np.zeros((B, Hkv, Tk), bool)
    for b in range(B):
        for h in range(Hkv):
            present[b, h, list(stored[b][h])] = True
    return present


def run_both(rng, stored, q_seq, q_pos, Hq, sink, window, *, page_size=4, D=8, Tk=None, num_pages=None,
             max_pages=None, jit=False):
    B, Hkv = len(stored), len(stored[0])
    Tk = Tk or (max([max(s, default=0) for r in stored for s in r] + list(q_pos)) + 1)
    kd = rng.standard_normal((B, Hkv, Tk, D)).astype(np.float32)
    vd = rng.standard_normal((B, Hkv, Tk, D)).astype(np.float32)
    q = rng.standard_normal((len(q_seq), Hq, D)).astype(np.float32)
    num_pages = num_pages or sum(-(-len(s) // page_size) for r in stored for s in r) + 3
    kp, vp, sp, pt, ln = pack_pages(stored, kd, vd, page_size, num_pages, rng, max_pages)
    q_seq = np.asarray(q_seq, np.int32)
    q_pos = np.asarray(q_pos, np.int32)
    sink = np.asarray(sink, np.int32)
    window = np.asarray(window, np.int32)
    scale = D**-0.5
    fn = paged_attention
    if jit:
        fn = jax.jit(paged_attention, static_argnames=("scale",))
    out, lse = fn(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(sp), jnp.asarray(pt),
                  jnp.asarray(ln), jnp.asarray(q_seq), jnp.asarray(q_pos), jnp.asarray(sink),
                  jnp.asarray(window), scale=scale)
    present = present_from(stored, B, Hkv, Tk)
    ref_out, ref_lse = dense_oracle(q, kd, vd, present, q_seq, q_pos, sink, window, scale)
    return np.asarray(out), np.asarray(lse), ref_out, ref_lse


def check(out, lse, ref_out, ref_lse):
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, rtol=RTOL, atol=ATOL)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_decode_ragged(G):
    rng = np.random.default_rng(G)
    Hkv = 2
    lens = [[5, 9], [1, 1], [13, 2]]  # incl. single-token heads; one query per sequence at its last token
    stored = [[list(range(n)) for n in r] for r in lens]
    q_seq = [0, 1, 2]
    q_pos = [8, 0, 12]
    # Per-head lengths differ within a sequence: head 1 of seq 0 stores 9 tokens but the query is at 8.
    check(*run_both(rng, stored, q_seq, q_pos, Hkv * G, [0] * Hkv, [0] * Hkv, jit=True))


def test_prefill_and_padding_queries():
    rng = np.random.default_rng(1)
    n = 11
    stored = [[list(range(n)), list(range(n))]]
    q_seq = [0] * n + [-1, -1, -1]
    q_pos = list(range(n)) + [0, 5, 0]
    out, lse, ro, rl = run_both(rng, stored, q_seq, q_pos, 4, [0, 0], [0, 0])
    check(out, lse, ro, rl)
    assert (out[n:] == 0).all() and np.isneginf(lse[n:]).all()


def test_chunked_prefill_two_sequences():
    rng = np.random.default_rng(2)
    # seq 0 has 7 cached tokens and appends 5 (positions 7..11); seq 1 is fresh with 3 tokens.
    stored = [[list(range(12))] * 2, [list(range(3))] * 2]
    q_seq = [0] * 5 + [1] * 3 + [-1]
    q_pos = list(range(7, 12)) + [0, 1, 2] + [0]
    check(*run_both(rng, stored, q_seq, q_pos, 4, [0, 0], [0, 0], jit=True))


def test_empty_heads_and_empty_sequence():
    rng = np.random.default_rng(3)
    stored = [[[], list(range(4))], [[], []]]
    q_seq = [0, 0, 1]
    q_pos = [2, 3, 0]
    out, lse, ro, rl = run_both(rng, stored, q_seq, q_pos, 4, [0, 0], [0, 0], Tk=4)
    check(out, lse, ro, rl)
    # KV head 0 (query heads 0, 1) is empty: nothing visible.
    assert np.isneginf(lse[:, :2]).all() and (out[:, :2] == 0).all()
    assert np.isneginf(lse[2]).all()


def test_per_head_subsets():
    """Compressed heads keep arbitrary per-head position subsets (different lengths per head)."""
    rng = np.random.default_rng(4)
    n = 20
    stored = [[sorted(rng.choice(n, size=k, replace=False).tolist()) for k in (20, 7, 1, 12)]]
    q_seq = [0] * 4
    q_pos = [16, 17, 18, 19]
    check(*run_both(rng, stored, q_seq, q_pos, 8, [0] * 4, [0] * 4))


def test_sink_window_heads_full_storage():
    rng = np.random.default_rng(5)
    n = 30
    stored = [[list(range(n))] * 4, [list(range(9))] * 4]
    sink = [0, 2, 0, 4]
    window = [0, 5, 3, 1]
    q_seq = [0] * 10 + [1] * 9
    q_pos = list(range(20, 30)) + list(range(9))
    check(*run_both(rng, stored, q_seq, q_pos, 8, sink, window, jit=True))


def ring_order(n, sink, cap):
    """Storage order of a sink + ring head after writing positions 0..n-1 with total capacity cap."""
    slots = [None] * min(n, cap)
    ring = cap - sink
    for p in range(n):
        i = p if p < sink else sink + (p - sink) % ring
        if i < len(slots):
            slots[i] = p
    return slots


@pytest.mark.parametrize("n", [6, 23, 40])
def test_ring_equals_full_storage(n):
    """A local head stored as a ring (slot order != position order) gives the full-storage answer."""
    sink, window, page_size, step = 2, 5, 4, 4
    cap = -(-(sink + window - 1 + step) // page_size) * page_size
    ring = ring_order(n, sink, cap)
    assert n <= cap or ring != sorted(ring)
    q_pos = list(range(max(0, n - step), n))  # the last step's queries (chunked prefill)
    q_seq = [0] * len(q_pos)
    full = [[list(range(n)), list(range(n))]]
    rings = [[list(range(n)), ring]]  # head 0 global, head 1 local ring
    sinks, windows = [0, sink], [0, window]
    a = run_both(np.random.default_rng(n), full, q_seq, q_pos, 4, sinks, windows, page_size=page_size)
    b = run_both(np.random.default_rng(n), rings, q_seq, q_pos, 4, sinks, windows, page_size=page_size,
                 Tk=n)
    check(*a)
    check(*b)
    np.testing.assert_allclose(a[0], b[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(a[1], b[1], rtol=RTOL, atol=ATOL)


def test_lse_equals_dense_logsumexp_and_extra_pages():
    """max_pages larger than needed (-1 padding); lse equals the dense logsumexp."""
    rng = np.random.default_rng(6)
    n, D = 9, 16
    stored = [[list(range(n))]]
    out, lse, ro, rl = run_both(rng, stored, [0] * n, list(range(n)), 2, [0], [0], D=D, max_pages=7)
    check(out, lse, ro, rl)


def test_write_kv_roundtrip_scatter():
    """write_kv scatters per-(token, head) into flat slots, skips -1, records positions."""
    rng = np.random.default_rng(7)
    pool = init_pool(6, 4, 8, jnp.float32)
    T, Hkv = 5, 2
    k = rng.standard_normal((T, Hkv, 8)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, 8)).astype(np.float32)
    pos = np.arange(10, 10 + T, dtype=np.int32)
    slots = np.array([[0, 23], [1, 22], [-1, -1], [9, 4], [2, -1]], np.int32)
    new = jax.jit(write_kv, donate_argnums=0)(pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                                              jnp.asarray(slots))
    kf = np.asarray(new.k).reshape(24, 8)
    vf = np.asarray(new.v).reshape(24, 8)
    pf = np.asarray(new.pos).reshape(24)
    expect_pos = np.full(24, -1)
    for t in range(T):
        for h in range(Hkv):
            s = slots[t, h]
            if s >= 0:
                np.testing.assert_array_equal(kf[s], k[t, h])
                np.testing.assert_array_equal(vf[s], v[t, h])
                expect_pos[s] = pos[t]
    np.testing.assert_array_equal(pf, expect_pos)
    assert new.page_size == 4 and jax.tree_util.tree_leaves(new)[0].shape == (6, 4, 8)


def test_fully_masked_no_nan():
    """All-padding page table and padding query: zeros and -inf, no NaN."""
    q = jnp.ones((2, 2, 4))
    kp = jnp.ones((2, 4, 4))
    sp = jnp.full((2, 4), -1, jnp.int32)
    pt = jnp.full((1, 1, 2), -1, jnp.int32)
    out, lse = paged_attention(q, kp, kp, sp, pt, jnp.zeros((1, 1), jnp.int32), jnp.array([0, -1]),
                               jnp.array([3, 0]), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), scale=0.5)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()


@pytest.mark.parametrize("window", [0, 5])
def test_dense_attention_query_blocks_equal_one_block(window, monkeypatch):
    # Query blocks (the memory guard for long prompts) change no row: each row's softmax is its own.
    from jaxkv.models import attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 24, 2, 8)), jnp.float32) for _ in range(2))
    q_pos = jnp.asarray(np.stack([np.arange(16) + 4, np.arange(16)]), jnp.int32)
    k_pos = jnp.asarray(np.stack([np.arange(24), np.where(np.arange(24) < 16, np.arange(24), -1)]), jnp.int32)
    one = attention.dense_attention(q, k, v, q_pos, k_pos, window=window, sink=1, q_block=0)
    blocked = attention.dense_attention(q, k, v, q_pos, k_pos, window=window, sink=1, q_block=4)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(one), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(attention, "MAX_SCORES", 64)  # the automatic guard takes the blocked path
    monkeypatch.setattr(attention, "Q_BLOCK", 8)
    auto = attention.dense_attention(q, k, v, q_pos, k_pos, window=window, sink=1)
    np.testing.assert_allclose(np.asarray(auto), np.asarray(one), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="does not divide"):
        attention.dense_attention(q, k, v, q_pos, k_pos, q_block=5)
