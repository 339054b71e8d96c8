"""Ragged per-head paged attention: Pallas kernel (interpret mode), the per-sequence dense XLA path and
the jnp twin against a float64 oracle."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.api import paged_attention
from tests.kernels._data import oracle_attention, random_paged_case

ARGS = ("q", "k_pages", "v_pages", "slot_pos", "page_table", "lengths", "q_seq", "q_pos")
TOL = {np.float32: 2e-5, jnp.bfloat16: 2e-2}

CASES = [  # (q_lens, ring, ordered, num_splits, block_q)
    ((1, 1, 1), False, False, 1, None),     # decode
    ((1, 1, 1), False, True, 3, None),      # decode, page-range skipping, split-K + LSE merge
    ((6, 3, 0), False, True, 2, 4),         # chunked prefill, one sequence without queries
    ((9, 1, 2), True, False, 1, 4),         # ring storage: scan every page
    ((1, 1, 1), False, True, 4, 1),         # decode fast path (one block per token), empty splits skipped
    ((6, 3, 0), False, True, 3, 1),         # one-token blocks for a chunk (window / causal cut per token)
    ((2, 1, 3), True, False, 2, 1),         # decode fast path over a ring
]


@pytest.mark.parametrize("implementation", ["pallas", "reference", "dense"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_paged_attention_matches_oracle(implementation, case, dtype):
    q_lens, ring, ordered, splits, block_q = case
    rng = np.random.default_rng(zlib.crc32(repr((case, str(dtype))).encode()))  # stable across runs
    c = random_paged_case(rng, q_lens=q_lens, ring=ring)
    for k in ("q", "k_pages", "v_pages"):
        c[k] = np.asarray(jnp.asarray(c[k], dtype).astype(jnp.float32))     # round to the storage dtype
    sink, window = np.array([0, 2], np.int32), np.array([0, 5], np.int32)
    ref_out, ref_lse = oracle_attention(c, sink, window, 0.25)
    if ordered:   # poison pages the sink/window range must skip: reading them would turn the output NaN
        pass
    args = [jnp.asarray(c[k], dtype) if k in ("q", "k_pages", "v_pages") else jnp.asarray(c[k]) for k in ARGS]
    kw = dict(ordered=ordered, num_splits=splits, block_q=block_q) if implementation == "pallas" else {}
    out, lse = paged_attention(*args, jnp.asarray(sink), jnp.asarray(window), scale=0.25,
                               implementation=implementation, **kw)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert out.shape == ref_out.shape and lse.dtype == np.float32
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(out, ref_out, atol=TOL[dtype] * 5, rtol=TOL[dtype])


def test_local_heads_read_only_sink_and_window_pages():
    rng = np.random.default_rng(7)
    c = random_paged_case(rng, num_seqs=2, q_lens=(1, 2), page_size=4, max_pages=8)
    c["lengths"][:] = 32
    c = random_paged_case(np.random.default_rng(7), num_seqs=2, q_lens=(1, 2), page_size=4, max_pages=8)
    sink, window = np.array([0, 4], np.int32), np.array([0, 6], np.int32)
    ref_out, _ = oracle_attention(c, sink, window, 0.25)
    k = c["k_pages"].copy()
    # poison, for the local head 1, every page wholly outside [0, sink) and the last window of each query
    for s in range(2):
        n = c["lengths"][s, 1]
        qmin = c["q_pos"][c["q_seq"] == s].min() if (c["q_seq"] == s).any() else 0
        for j in range((n + 3) // 4):
            lo, hi = 4 * j, min(4 * j + 3, n - 1)
            if lo >= 4 and hi <= qmin - 6 - 4:
                k[c["page_table"][s, 1, j]] = np.nan
    args = [jnp.asarray(k if a == "k_pages" else c[a]) for a in ARGS]
    out, _ = paged_attention(*args, jnp.asarray(sink), jnp.asarray(window), scale=0.25,
                             implementation="pallas", ordered=True)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-4)


@pytest.mark.parametrize("implementation,splits,schedule", [
    ("reference", None, None), ("dense", None, None), ("pallas", 1, "grid"), ("pallas", 3, "grid"),
    ("pallas", 3, "compact")])
def test_slot_bias_is_added_to_every_logit(implementation, splits, schedule):
    """`slot_bias` (KVPool.bias, merged tokens) against the oracle, in every schedule and split layout."""
    from pallas_kernels.paged_attention.api import paged_attention_plan, paged_attention_with_plan

    c = random_paged_case(np.random.default_rng(11), q_lens=(1, 3, 2))
    c["slot_bias"] = np.random.default_rng(12).normal(0, 2, c["slot_pos"].shape).astype(np.float32)
    sink, window = np.array([0, 2], np.int32), np.array([0, 5], np.int32)
    ref_out, ref_lse = oracle_attention(c, sink, window, 0.25)
    args = [jnp.asarray(c[k]) for k in ARGS]
    bias = jnp.asarray(c["slot_bias"])
    if implementation in ("reference", "dense"):
        out, lse = paged_attention(*args, jnp.asarray(sink), jnp.asarray(window), scale=0.25,
                                   implementation=implementation, slot_bias=bias)
    else:
        plan = paged_attention_plan(args[3], args[4], args[5], args[6], args[7], jnp.asarray(sink),
                                    jnp.asarray(window), num_q_heads=c["q"].shape[1], ordered=False,
                                    num_splits=splits, block_q=1, schedule=schedule)
        out, lse = paged_attention_with_plan(plan, args[0], args[1], args[2], args[3], args[4], scale=0.25,
                                             slot_bias=bias)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["pallas", "reference", "dense"])
def test_bias_log_m_equals_m_copies_of_the_slot(implementation):
    """The meaning of a merged slot: one slot with bias log(m) attends exactly like m identical slots."""
    rng = np.random.default_rng(3)
    d, p, hq = 8, 4, 2
    k = rng.standard_normal((6, d)).astype(np.float32)
    v = rng.standard_normal((6, d)).astype(np.float32)
    q = jnp.asarray(rng.standard_normal((1, hq, d)).astype(np.float32))

    def run(keys, vals, bias):
        n = len(keys)
        pages = -(-n // p)
        kp = np.zeros((pages, p, d), np.float32)
        vp = np.zeros((pages, p, d), np.float32)
        pos = np.full((pages, p), -1, np.int32)
        kp.reshape(-1, d)[:n], vp.reshape(-1, d)[:n] = keys, vals
        pos.reshape(-1)[:n] = np.arange(n)
        b = np.zeros((pages, p), np.float32)
        b.reshape(-1)[:n] = bias
        return paged_attention(q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(pos),
                               jnp.asarray(np.arange(pages, dtype=np.int32)[None, None]),
                               jnp.asarray([[n]], np.int32), jnp.asarray([0], np.int32),
                               jnp.asarray([100], np.int32), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                               scale=0.5, implementation=implementation, slot_bias=jnp.asarray(b))

    copies = run(np.concatenate([k, k[2:3], k[2:3]]), np.concatenate([v, v[2:3], v[2:3]]), np.zeros(8))
    merged = run(k, v, np.array([0, 0, np.log(3), 0, 0, 0]))
    np.testing.assert_allclose(np.asarray(merged[0]), np.asarray(copies[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(merged[1]), np.asarray(copies[1]), atol=1e-5)


def test_default_off_the_gpu_is_dense_when_it_fits():
    """`implementation=None` on the CPU: the dense path (equal to the twin) until a step's query rows times
    one tile would pass dense.MAX_SCORES, then the twin; a long page list alone does not leave it."""
    from pallas_kernels.paged_attention import dense

    c = random_paged_case(np.random.default_rng(5), q_lens=(4, 1, 2))
    sink, window = jnp.asarray(np.array([0, 2], np.int32)), jnp.asarray(np.array([0, 5], np.int32))
    args = [jnp.asarray(c[k]) for k in ARGS]
    got = paged_attention(*args, sink, window, scale=0.25)
    twin = paged_attention(*args, sink, window, scale=0.25, implementation="reference")
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(twin[0]), atol=1e-5, rtol=1e-5)
    t, hq = c["q"].shape[:2]
    mp, ps = c["page_table"].shape[-1], c["k_pages"].shape[1]
    assert dense.fits(t, hq, mp, ps) and not dense.fits(dense.MAX_SCORES, hq, mp, ps)
    assert dense.fits(512, 32, 1 << 16, 16)  # a 1M-slot page list, 512 queries of 32 heads


@pytest.mark.parametrize("q_block", [2, 3, 256])
@pytest.mark.parametrize("case", CASES[:4] + [((12, 1, 5), False, False, 1, None),   # long chunks
                                                ((7, 9, 2), True, False, 1, None)])    # over rings
def test_dense_path_over_many_tiles_matches_the_oracle(case, q_block, monkeypatch):
    """The dense path over several tiles (a 4-slot tile: one page; online softmax across tiles) and, with
    `q_block` 2 or 3, several query blocks (each skipping the tiles none of its queries sees: the future half
    of a chunk's own slots, a local head's slots outside its window; a sequence runs only the blocks from its
    first row, the last moved back within the rows) equals the oracle, with every page past a
    sequence's longest head poisoned with NaN: nothing of them reaches the output."""
    from pallas_kernels.paged_attention import dense

    monkeypatch.setattr(dense, "TILE_SLOTS", 4)
    monkeypatch.setattr(dense, "DECODE_TILE_SLOTS", 4)  # steps of few rows cross as many tiles
    monkeypatch.setattr(dense, "Q_BLOCK", q_block)
    monkeypatch.setattr(dense, "DECODE_Q_BLOCK", q_block)  # these steps are decode-sized: their blocks
    q_lens, ring, _, _, _ = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    c = random_paged_case(rng, q_lens=q_lens, ring=ring, page_size=4, max_pages=8)
    sink, window = np.array([0, 2], np.int32), np.array([0, 5], np.int32)
    ref_out, ref_lse = oracle_attention(c, sink, window, 0.25)
    k, v = c["k_pages"].copy(), c["v_pages"].copy()
    used = {int(p) for s in range(c["page_table"].shape[0]) for h in range(c["page_table"].shape[1])
            for p in c["page_table"][s, h, :-(-int(c["lengths"][s].max()) // 4)] if p >= 0}
    unused = [p for p in range(k.shape[0]) if p not in used]
    assert unused, "the case should leave pages unread"
    k[unused], v[unused] = np.nan, np.nan
    args = [jnp.asarray(k if a == "k_pages" else v if a == "v_pages" else c[a]) for a in ARGS]
    out, lse = paged_attention(*args, jnp.asarray(sink), jnp.asarray(window), scale=0.25,
                               implementation="dense")
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)) and np.isfinite(out).all()
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out, ref_out, atol=1e-4, rtol=2e-5)


def test_dense_tile_kind_agrees_with_the_visibility_mask():
    """The dense path's per-tile branch: 0 only where no query of the block sees a slot of the tile, 2 only
    where every query sees every slot (the product then skips the mask), over random positions, lengths,
    sinks and windows; all three kinds occur."""
    from pallas_kernels.paged_attention import dense
    from pallas_kernels.paged_attention.reference import visible_mask

    rng = np.random.default_rng(7)
    kind_of = jax.jit(dense._tile_kind)
    seen = set()
    for _ in range(300):
        hkv, j = 2, 8
        start = int(rng.integers(0, 40))
        pos = start + np.arange(j)[None, :] + rng.integers(-3, 4, size=(hkv, 1))
        empty = 0.1 if rng.random() < 0.2 else 0.0
        pos = np.where(rng.random((hkv, j)) < empty, -1, pos).astype(np.int32)
        valid = rng.random((hkv, j)) < (0.5 if rng.random() < 0.2 else 1.0)
        lo = start + int(rng.integers(-4, 16))  # the block's queries around the tile's positions
        q_pos = np.arange(max(lo, 0), max(lo, 0) + int(rng.integers(1, 12)), dtype=np.int32)
        sink = rng.integers(0, 3, size=hkv).astype(np.int32)
        window = np.where(rng.random(hkv) < 0.5, 0, rng.integers(1, 20, size=hkv)).astype(np.int32)
        vis = np.asarray(visible_mask(jnp.asarray(pos)[None], jnp.asarray(valid)[None], jnp.asarray(q_pos),
                                      jnp.asarray(sink), jnp.asarray(window)))
        kind = int(kind_of(jnp.asarray(pos), jnp.asarray(valid), q_pos.min(), q_pos.max(), jnp.asarray(sink),
                           jnp.asarray(window)))
        seen.add(kind)
        assert kind != 0 or not vis.any()
        assert kind != 2 or vis.all()
        assert kind != 1 or (vis.any() and not vis.all()) or not (window > 0).any()
    assert seen == {0, 1, 2}


def test_dense_path_with_sequences_interleaved_across_query_blocks(monkeypatch):
    """Queries of several sequences interleaved in one step (the contract does not ask a sequence's tokens
    to be contiguous), split into 3-query blocks: each block sets only its own sequence's rows per pass, so
    every row ends with its own sequence's attention."""
    from pallas_kernels.paged_attention import dense

    monkeypatch.setattr(dense, "TILE_SLOTS", 8)
    monkeypatch.setattr(dense, "DECODE_TILE_SLOTS", 8)
    monkeypatch.setattr(dense, "Q_BLOCK", 3)
    c = random_paged_case(np.random.default_rng(21), q_lens=(6, 4, 5), page_size=4, max_pages=8)
    order = np.random.default_rng(22).permutation(len(c["q_seq"]))
    for k in ("q", "q_seq", "q_pos"):
        c[k] = c[k][order]
    assert len({int(s) for s in c["q_seq"][:3]}) > 1, "the first block should mix sequences"
    sink, window = np.array([0, 2], np.int32), np.array([0, 5], np.int32)
    ref_out, ref_lse = oracle_attention(c, sink, window, 0.25)
    out, lse = paged_attention(*[jnp.asarray(c[k]) for k in ARGS], jnp.asarray(sink), jnp.asarray(window),
                               scale=0.25, implementation="dense")
    fin = np.isfinite(ref_lse)
    assert np.array_equal(np.isinf(np.asarray(lse)), np.isinf(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-4, rtol=2e-5)
