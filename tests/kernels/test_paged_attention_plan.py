"""Per-step plan API of the paged-attention kernel (interpret mode): plan + run == paged_attention == twin,
and a multi-layer plan indexed at layer l == the one-layer plan."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention.api import (
    PagedAttentionPlan,
    paged_attention,
    paged_attention_pallas,
    paged_attention_plan,
    paged_attention_with_plan,
)
from pallas_kernels.paged_attention.kernel import META_WIDTH, unit_split_pages, work_list
from tests.kernels._data import random_paged_case

ARGS = ("q", "k_pages", "v_pages", "slot_pos", "page_table", "lengths", "q_seq", "q_pos")
SINK, WINDOW = np.array([0, 2], np.int32), np.array([0, 5], np.int32)    # head 0 global, head 1 local

CASES = [  # (q_lens, ring, ordered, num_splits, block_q, schedule)
    ((1, 1, 1), False, True, 3, None, "grid"),      # ragged decode, page-range skipping, split-K
    ((6, 3, 0), False, True, 2, 4, "grid"),         # chunked prefill, one sequence without queries
    ((2, 1, 3), True, False, 2, 1, "grid"),         # one-token blocks over a ring (every page scanned)
    ((1, 1, 1), False, True, 3, None, "compact"),   # work list: single-split units written directly
    ((6, 3, 0), False, True, 2, 4, "compact"),      # prefill blocks + inactive blocks skipped
    ((2, 1, 3), True, False, 1, 1, "compact"),      # one split: no merge call at all
]


def _case(q_lens, ring, seed):
    c = random_paged_case(np.random.default_rng(seed), q_lens=q_lens, ring=ring)   # empty + one-token heads
    return c, [jnp.asarray(c[k]) for k in ARGS]


def _plan_kw(case):
    _, _, ordered, splits, block_q, schedule = case
    kw = dict(ordered=ordered, num_splits=splits, block_q=block_q)
    return kw, dict(schedule=schedule, num_programs=3)   # 3 programs: each walks several items


@pytest.mark.parametrize("case", CASES)
def test_plan_then_run_equals_paged_attention_and_twin(case):
    c, a = _case(case[0], case[1], seed=len(case[0]) * 7 + case[3])
    kw, sched = _plan_kw(case)
    sink, window = jnp.asarray(SINK), jnp.asarray(WINDOW)
    plan = paged_attention_plan(a[3], a[4], a[5], a[6], a[7], sink, window, num_q_heads=a[0].shape[1], **kw,
                                **sched)
    assert isinstance(plan, PagedAttentionPlan) and plan.num_layers is None
    assert plan.schedule == sched["schedule"]
    out, lse = paged_attention_with_plan(plan, a[0], a[1], a[2], a[3], a[4], scale=0.25)
    # the grid schedule through the public API: the compact schedule gives the same bits (same merge)
    out1, lse1 = paged_attention(*a, sink, window, scale=0.25, implementation="pallas", **kw)
    out2, lse2 = paged_attention(*a, sink, window, scale=0.25, implementation="reference")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out1))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))
    out, lse, lse2 = np.asarray(out), np.asarray(lse), np.asarray(lse2)
    assert np.array_equal(np.isinf(lse), np.isinf(lse2))
    fin = np.isfinite(lse2)
    np.testing.assert_allclose(lse[fin], lse2[fin], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out, np.asarray(out2), atol=1e-4, rtol=2e-5)


def _layers(c, num_layers=3):
    """Per-layer tables over one pool: layer l keeps a prefix of each head's pages (shorter lengths)."""
    p = c["slot_pos"].shape[1]
    pts, lens = [], []
    for layer in range(num_layers):
        ln = np.maximum(c["lengths"] - 5 * layer, 0).astype(np.int32)
        ln[0, 1] = min(c["lengths"][0, 1], 1)                             # keep the one-token head
        npg = (ln + p - 1) // p
        pt = np.where(np.arange(c["page_table"].shape[-1]) < npg[..., None], c["page_table"], -1)
        pts.append(pt.astype(np.int32))
        lens.append(ln)
    sink = np.array([[0, 2], [3, 0], [1, 1]], np.int32)[:num_layers]       # global / local mixes per layer
    window = np.array([[0, 5], [7, 0], [4, 9]], np.int32)[:num_layers]
    return np.stack(pts), np.stack(lens), sink, window


@pytest.mark.parametrize("case", [CASES[0], CASES[1]])
def test_multi_layer_plan_indexes_to_single_layer_plan(case):
    c, a = _case(case[0], case[1], seed=11)
    kw, _ = _plan_kw(case)
    kw["schedule"] = "compact"          # the work list is part of the plan too
    pts, lens, sink, window = _layers(c)
    hq = a[0].shape[1]
    multi = paged_attention_plan(a[3], jnp.asarray(pts), jnp.asarray(lens), a[6], a[7], jnp.asarray(sink),
                                 jnp.asarray(window), num_q_heads=hq, **kw)
    assert multi.num_layers == 3 and multi.meta.shape[0] == 3
    for layer in range(3):
        one = paged_attention_plan(a[3], jnp.asarray(pts[layer]), jnp.asarray(lens[layer]), a[6], a[7],
                                   jnp.asarray(sink[layer]), jnp.asarray(window[layer]), num_q_heads=hq, **kw)
        got = multi.layer(layer)
        for f in dataclasses.fields(PagedAttentionPlan):
            x, y = getattr(got, f.name), getattr(one, f.name)
            if isinstance(y, jax.Array):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f.name)
            else:
                assert x == y, f.name


@pytest.mark.parametrize("schedule", ["grid", "compact"])
def test_multi_layer_step_in_one_jit_matches_per_layer_calls(schedule):
    case = CASES[0]
    c, a = _case(case[0], case[1], seed=5)
    kw, _ = _plan_kw(case)
    kw["schedule"] = schedule
    pts, lens, sink, window = _layers(c)
    qs = jnp.asarray(np.random.default_rng(1).standard_normal((3, *c["q"].shape)).astype(np.float32))

    @jax.jit
    def step(qs, k, v, pos, pts, lens, sink, window):
        plan = paged_attention_plan(pos, pts, lens, a[6], a[7], sink, window, num_q_heads=qs.shape[2], **kw)

        def body(layer, acc):
            o, _ = paged_attention_with_plan(plan.layer(layer), qs[layer], k, v, pos, pts[layer], scale=0.25)
            return acc.at[layer].set(o)

        return jax.lax.fori_loop(0, 3, body, jnp.zeros_like(qs))

    got = step(qs, a[1], a[2], a[3], jnp.asarray(pts), jnp.asarray(lens), jnp.asarray(sink),
               jnp.asarray(window))
    for layer in range(3):
        ref, _ = paged_attention(qs[layer], a[1], a[2], a[3], jnp.asarray(pts[layer]),
                                 jnp.asarray(lens[layer]), a[6], a[7], jnp.asarray(sink[layer]),
                                 jnp.asarray(window[layer]), scale=0.25, implementation="reference")
        np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(ref), atol=1e-4, rtol=2e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]])
def test_layer_of_multi_layer_plan_reads_the_whole_table_in_place(case):
    """layer=l with the whole layer-major page table (no per-layer slices: the grid schedule offsets its
    metadata blocks and page-table rows) == plan.layer(l) with layer l's table, bit for bit."""
    c, a = _case(case[0], case[1], seed=23)
    kw, sched = _plan_kw(case)
    pts, lens, sink, window = _layers(c)
    qs = jnp.asarray(np.random.default_rng(2).standard_normal((3, *c["q"].shape)).astype(np.float32))
    plan = paged_attention_plan(a[3], jnp.asarray(pts), jnp.asarray(lens), a[6], a[7], jnp.asarray(sink),
                                jnp.asarray(window), num_q_heads=qs.shape[2], **kw, **sched)
    assert plan.units_per_layer == pts.shape[1] * pts.shape[2]
    for layer in range(3):
        got = paged_attention_with_plan(plan, qs[layer], a[1], a[2], a[3], jnp.asarray(pts), scale=0.25,
                                        layer=layer)
        want = paged_attention_with_plan(plan.layer(layer), qs[layer], a[1], a[2], a[3],
                                         jnp.asarray(pts[layer]), scale=0.25)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="layer-major"):
        paged_attention_with_plan(plan, qs[0], a[1], a[2], a[3], jnp.asarray(pts[0]), scale=0.25, layer=0)
    with pytest.raises(ValueError, match="multi-layer plan"):
        paged_attention_with_plan(plan, qs[0], a[1], a[2], a[3], jnp.asarray(pts), scale=0.25)


@pytest.mark.parametrize("pps", [[4] * 7, [4, 4, 8, 4, 4, 4, 12]])   # uniform and per-unit split sizes
def test_work_list_covers_every_nonempty_split_once_full_splits_first(pps):
    k = 3
    nv = np.array([0, 3, 4, 9, 12, 5, 7], np.int32)            # pages per unit
    pps = np.array(pps, np.int32)
    active = np.array([1, 1, 1, 1, 1, 0, 1], bool)             # unit 5 has no queries
    meta = np.zeros((len(nv), META_WIDTH), np.int32)
    meta[:, 4], meta[:, 7] = nv, pps
    work, nw, mu, nm = (np.asarray(x)
                        for x in work_list(jnp.asarray(meta), jnp.asarray(active), num_splits=k))
    nw, nm = int(nw[0]), int(nm[0])
    want = {(u, s) for u in range(len(nv)) if active[u] for s in range(max(1, -(-nv[u] // pps[u])))}
    got = [(w // k, w % k) for w in work[:nw]]
    assert len(got) == len(set(got)) and set(got) == want
    full = [min(pps[u], nv[u] - s * pps[u]) == pps[u] for u, s in got]
    assert full == sorted(full, reverse=True)                 # full splits first
    assert sorted(mu[:nm].tolist()) == [u for u in range(len(nv)) if active[u] and nv[u] > pps[u]]


def test_unit_split_pages_fits_the_split_buffer_and_spreads_short_heads():
    ppb, k = 2, 8
    nv = jnp.array([0, 1, 7, 64, 1024, 8192], jnp.int32)
    pps = np.asarray(unit_split_pages(nv, k, ppb, programs=64))
    assert (pps % ppb == 0).all() and (pps >= ppb).all()
    assert (-(-np.asarray(nv) // pps) <= k).all()             # never more splits than the buffer holds
    # a head far below the page table's width still splits k ways when the layer's work is small
    few = np.asarray(unit_split_pages(jnp.array([1024, 20, 20], jnp.int32), k, ppb, programs=528))
    assert -(-1024 // few[0]) == k and few[1] == few[2] < 20
    # a layer with plenty of units keeps them whole (no split, no merge)
    many = np.asarray(unit_split_pages(jnp.full((1000,), 64, jnp.int32), k, ppb, programs=528))
    assert (many >= 64).all()


@pytest.mark.parametrize("schedule", ["grid", "compact"])
def test_kernels_lower_to_triton_for_cuda(schedule):
    """The Pallas -> Triton lowering (not the Triton compile) runs on CPU: catches unsupported ops early."""
    c, a = _case((1, 1, 1), False, seed=3)
    sink, window = jnp.asarray(SINK), jnp.asarray(WINDOW)
    f = jax.jit(lambda *a: paged_attention_pallas(*a, sink, window, scale=0.25, interpret=False, ordered=True,
                                                  num_splits=2, schedule=schedule))
    try:
        text = f.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
    except (TypeError, NotImplementedError, AttributeError) as e:   # API differences across jax versions
        pytest.skip(f"cross-platform lowering unavailable: {e!r}"[:200])
    assert text.count("xla.gpu.triton") == 2                   # attention + merge


def test_default_config_splits_single_sequence_prefill_only_to_fill_the_gpu():
    """One sequence's prefill (a reuse pass): many query blocks -> no key split (merge partials cost, nothing
    gained); few blocks -> splits up to ~4 programs per SM. Several sequences and decode keep key splits."""
    from pallas_kernels.paged_attention.api import SPLIT_PROGRAMS, default_config

    pages = 33040 // 16 + 1
    assert default_config(5200, 1, 8, pages, 16)[1] == 1                  # 325 blocks x 8 heads
    few = default_config(272, 1, 8, pages, 16)                             # a suffix: 17 blocks x 8 heads
    assert few[1] > 1 and -(-272 // few[0]) * 8 * few[1] >= SPLIT_PROGRAMS
    assert default_config(5200, 4, 8, pages, 16)[1] > 1                   # decode rows may ride along
    assert default_config(32, 32, 8, pages, 16)[1] > 1                    # decode: split by keys
