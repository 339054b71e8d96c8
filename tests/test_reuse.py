"""Segment reuse through the engine: store contract, RoPE shift, method degenerate cases, bad input,
no leaks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.head_classes import HeadClass, HeadClassMap, all_global
from jaxkv.cache.segments import SegmentError, SegmentStore
from jaxkv.engine.engine import Engine
from jaxkv.engine.reuse import (
    pass_shape,
    pass_shapes,
    row_bucket,
    row_ladder,
    token_bucket,
    token_rows_bucket,
)
from jaxkv.models import llama, rope
from jaxkv.policies.reuse import REUSE_POLICIES, get_reuse_policy
from jaxkv.policies.reuse.apply import num_compilations
from jaxkv.sampling import SamplingParams
from pallas_kernels.rope_shift.api import rope_shift
from tests.hf_tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-reuse")))


@pytest.fixture(scope="module")
def pieces(model):
    rng = np.random.default_rng(0)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (5, 19, 13, 7)]


def make_engine(model, **kw):
    cfg = model.config
    eng = Engine(model, page_size=4, max_model_len=kw.pop("max_model_len", 128),
                 head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), attn_impl="reference", **kw)
    eng.reuser.keep_logits = True
    return eng


def run(eng, prefix, segments, suffix, reuse, sampling=GREEDY, **kw):
    rid = eng.add_reuse_request(prefix, segments, suffix, reuse=reuse, sampling=sampling, **kw)
    out = []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out += o.new_token_ids
    return out, eng.reuser.stats[rid]


def dense_last_logits(model, ids):
    return np.asarray(model.logits(np.array([ids])))[0, -1]


def test_rope_shift_of_a_segment_equals_keys_computed_at_the_new_position(model):
    # Layer 0's keys depend only on the token and its position: K(p + d) = R(d) K(p) exactly (fp32).
    cfg, p = model.config, llama.layer_params(model.params, 0)
    rng = np.random.default_rng(1)
    toks = rng.integers(3, cfg.vocab_size, size=8)
    x = llama.rms_norm(model.params["embed"][toks][None], p["attn_norm"], cfg.rms_norm_eps)

    def keys(start):
        _, k, _ = llama._qkv(p, cfg, x, jnp.arange(start, start + 8)[None], rope.inv_freq(cfg))
        return np.asarray(k[0, :, 0])  # [8, D] KV head 0

    k0, k37 = keys(0), keys(37)
    pages = jnp.zeros((2, 8, cfg.head_dim)).at[0].set(k0)
    pos = jnp.full((2, 8), -1, jnp.int32).at[0].set(jnp.arange(8))
    kk, _, pp = rope_shift(pages, pages, pos, jnp.array([0]), jnp.array([1]), jnp.array([37]),
                           jnp.asarray(rope.inv_freq(cfg)), implementation="reference")
    np.testing.assert_allclose(np.asarray(kk[1]), k37, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(pp[1]), np.arange(37, 45))


def test_full_and_engine_equal_dense_and_recompute_all_equals_full(model, pieces):
    pre, s1, s2, suf = pieces
    prompt = pre + s1 + s2 + suf
    dense = dense_last_logits(model, prompt)
    out_full, st = run(make_engine(model), pre, [s1, s2], suf, "full")
    np.testing.assert_allclose(st.first_logits, dense, atol=1e-4)
    # The ordinary step loop gives the same greedy tokens.
    outs = jaxkv.generate(model, [prompt], GREEDY, page_size=4, attn_impl="reference",
                          head_classes=all_global(model.config.num_layers, model.config.num_kv_heads))
    assert outs[0].token_ids == out_full
    # Every reuse method degenerates to full when everything is recomputed.
    for name, fields in [("cacheblend", {"ratio": 1.0}), ("sparsex", {"ratio": 1.0}), ("epic", {"first": 64}),
                         ("naive", {"full_layers": 99}),
                         ("redknot", {"dense_until": 99, "edge_thresh": 0.0})]:
        out, st = run(make_engine(model), pre, [s1, s2], suf, get_reuse_policy(name, **fields))
        np.testing.assert_allclose(st.first_logits, dense, atol=1e-4, err_msg=name)
        assert out == out_full, name


def test_naive_reuse_at_position_zero_equals_full(model, pieces):
    # A segment reused where it was prefilled (position 0, nothing before it) is exact; so is the copy
    # of a segment after a page-aligned prefix (holes) when nothing before it changes its K/V.
    _, s1, _, suf = pieces
    dense = dense_last_logits(model, s1 + suf)
    out, st = run(make_engine(model, segment_anchor=None), [], [s1], suf, "naive")
    np.testing.assert_allclose(st.first_logits, dense, atol=1e-4)
    assert st.reused_tokens == len(s1) and st.recompute_fraction == 0.0


def test_segment_prefilled_after_its_anchor_is_exact_after_the_same_prefix(model, pieces):
    # A segment prefilled after anchor A (positions len(A)..) and reused right after a prefix equal to A
    # is exactly what a full prefill computes: the anchor's K/V are not stored, the segment's are, and the
    # layout's hole between the prefix and the page-aligned segment is invisible. Without the anchor the
    # same reuse is approximate (the segment saw no prefix).
    _, s1, s2, suf = pieces
    anchor = [s2[0], s2[1], s2[2]]  # 3 tokens: the anchor's last page is part hole (page size 4)
    dense = dense_last_logits(model, anchor + s1 + suf)
    eng = make_engine(model, segment_anchor=anchor)
    out, st = run(eng, anchor, [s1], suf, "naive")
    np.testing.assert_allclose(st.first_logits, dense, atol=1e-4)
    assert st.reused_tokens == len(s1) and st.recompute_fraction == 0.0
    e = eng.reuser.store.find(s1)
    assert e.start == len(anchor)
    _, bare = run(make_engine(model, segment_anchor=None), anchor, [s1], suf, "naive")
    assert np.abs(bare.first_logits - dense).max() > 1e-2
    # The anchor is part of the identity: the same tokens under another anchor get another id.
    other = make_engine(model, segment_anchor=anchor[:1])
    assert other.reuser.store.id_for(s1) != eng.reuser.store.id_for(s1)
    # The anchor's scratch pages go back to the pool once the segment is registered.
    free = other.allocator.num_free
    e2 = other.reuser.register(s1)
    L, H = model.config.num_layers, model.config.num_kv_heads
    assert other.allocator.num_free == free - e2.pages.size == free - L * H * -(-len(s1) // 4)
    with pytest.raises(ValueError, match="segment_anchor"):
        make_engine(model, segment_anchor=[model.config.vocab_size])


def test_naive_is_approximate_and_recompute_fraction_orders_the_methods(model, pieces):
    pre, s1, s2, suf = pieces
    dense = dense_last_logits(model, pre + s1 + s2 + suf)
    _, naive = run(make_engine(model), pre, [s1, s2], suf, "naive")
    _, blend = run(make_engine(model), pre, [s1, s2], suf, get_reuse_policy("cacheblend", ratio=0.5))
    assert np.abs(naive.first_logits - dense).max() > 1e-2  # context-blind reuse really differs
    assert 0 < blend.recompute_fraction < 1
    assert naive.recompute_fraction == 0.0


def test_redknot_repairs_local_heads_only_near_segment_starts(model, pieces):
    cfg = model.config
    L, H = cfg.num_layers, cfg.num_kv_heads
    hc = HeadClassMap(L, H, tuple(tuple(HeadClass.global_() if h == 0 else HeadClass.local(2, 4)
                                        for h in range(H)) for _ in range(L)))
    eng = make_engine(model)
    eng.reuser.__init__(eng, reuse_head_classes=hc, keep_logits=True)
    pre, s1, s2, suf = pieces
    _, st = run(eng, pre, [s1, s2], suf, get_reuse_policy("redknot", edge_thresh=1.0, dense_until=99))
    n, new = st.prompt_tokens, len(pre) + len(suf)
    # Global head: every token; local heads: new text + first 4 of each segment (sinks 0, 1 are new).
    assert st.kv_writes == [n + (H - 1) * (new + 4 + 4)] * L


def test_segment_store_namespaces_frozen_delete_and_errors(model, pieces):
    pre, s1, s2, suf = pieces
    eng = make_engine(model)
    a = eng.register_segment(s1, extra_key="tenant-a", frozen=True)
    b = eng.register_segment(s1, extra_key="tenant-b")
    assert a != b
    ea, eb = eng.reuser.store.get(a, "tenant-a"), eng.reuser.store.get(b, "tenant-b")
    assert not set(ea.pages.ravel()) & set(eb.pages.ravel())  # namespaces never share pages
    with pytest.raises(SegmentError, match="unknown segment"):
        eng.add_reuse_request(pre, ["seg-nope"], suf, sampling=GREEDY)
    with pytest.raises(SegmentError, match="does not exist in namespace"):
        eng.add_reuse_request(pre, [a], suf, sampling=GREEDY, extra_key="tenant-b")
    with pytest.raises(SegmentError, match="context holds"):
        eng.add_reuse_request(pre, [list(range(3, 3 + 200))], suf, sampling=GREEDY)
    with pytest.raises(ValueError, match="unknown reuse method"):
        eng.add_reuse_request(pre, [a], suf, reuse="nope", sampling=GREEDY, extra_key="tenant-a")
    out, _ = run(eng, pre, [a], suf, "naive", extra_key="tenant-a")
    assert len(out) == GREEDY.max_tokens
    eng.delete_segment(a, "tenant-a")
    with pytest.raises(SegmentError, match="was deleted"):
        eng.add_reuse_request(pre, [a], suf, sampling=GREEDY, extra_key="tenant-a")
    assert not eng._requests


def test_pool_free_count_returns_to_start(model, pieces):
    pre, s1, s2, suf = pieces
    eng = make_engine(model)
    free0 = eng.allocator.num_free
    for name in REUSE_POLICIES:
        run(eng, pre, [s1, s2], suf, name)
    seg = eng.register_segment(s2, frozen=True)
    rid = eng.add_reuse_request(pre, [seg, s1], suf, reuse="sparsex", sampling=GREEDY)
    eng.step()
    eng.abort(rid)
    eng.delete_segment(seg)
    assert eng.allocator.num_free < free0  # s1, s2 stay cached (LRU) ...
    eng.reuser.store.clear()
    assert eng.allocator.num_free == free0  # ... and nothing else holds a page


def test_lru_eviction_under_pressure_keeps_frozen_longest(model):
    alloc = PageAllocator(12)
    store = SegmentStore(alloc, 4, "m")
    ids = []
    for i, frozen in enumerate([True, False, False]):
        ids.append(store.insert([i] * 4, None, alloc.allocate(4).reshape(2, 2, 1), frozen=frozen).segment_id)
    store.acquire(store.get(ids[2]))
    assert store.evict(4) == 4  # the idle ordinary entry goes first
    assert ids[1] not in store and ids[0] in store and ids[2] in store
    assert store.evict(4) == 4 and ids[0] not in store  # then the frozen one; the used one never
    assert store.evict(4) == 0 and ids[2] in store


def test_policy_fields_are_validated():
    with pytest.raises(ValueError, match="ratio"):
        get_reuse_policy("cacheblend", ratio=1.5)
    with pytest.raises(ValueError, match="no field"):
        get_reuse_policy("epic", ratio=0.1)
    with pytest.raises(ValueError, match="full_layers"):
        get_reuse_policy("sparsex", full_layers=-1)
    assert dataclasses.replace(get_reuse_policy("redknot"), edge_thresh=1.0).edge_thresh == 1.0
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="ffn_capacity"):
            get_reuse_policy("redknot", ffn_capacity=bad)


def test_row_buckets_are_fine_and_bounded():
    assert row_bucket(100, floor=128) == 128 and row_bucket(1500, floor=8) == 2048
    assert row_bucket(33040, floor=128) == 36864 and row_bucket(5220, floor=8) == 5632
    sizes = {row_bucket(n, floor=128) for n in range(1, 131073, 7)}
    assert len(sizes) <= 5 + 8 * 6  # powers of two to 2K, then 8 per doubling to 128K
    for n in range(2049, 131073, 97):
        assert n <= row_bucket(n, floor=128) <= 1.125 * n


def local_heads_map(cfg, sink=2, window=4):
    L, H = cfg.num_layers, cfg.num_kv_heads
    row = tuple(HeadClass.global_() if h == 0 else HeadClass.local(sink, window) for h in range(H))
    return HeadClassMap(L, H, (row,) * L)


def test_redknot_sparse_ffn_gathers_up_to_its_capacity(model, pieces):
    pre, s1, s2, suf = pieces
    kw = dict(edge_thresh=0.0, dense_until=0, recent_n=2, mass_thresh=0.2, ffn_dilate=0)
    redknot = lambda cap: get_reuse_policy("redknot", ffn_capacity=cap, **kw)  # noqa: E731
    _, uncapped = run(make_engine(model), pre, [s1, s2], suf, redknot(1.0))
    n = uncapped.prompt_tokens  # 44 tokens, in a 128-row bucket
    # A capacity above what the mass selection keeps changes nothing (gather + scatter-add = masked FFN).
    roomy_policy = redknot(0.5)
    assert max(uncapped.ffn_rows) <= roomy_policy.ffn_capacity_rows(n) < n
    _, roomy = run(make_engine(model), pre, [s1, s2], suf, roomy_policy)
    np.testing.assert_allclose(roomy.first_logits, uncapped.first_logits, atol=1e-4)
    assert roomy.ffn_rows == uncapped.ffn_rows and roomy.ffn_dropped == [0] * model.config.num_layers
    assert max(uncapped.ffn_rows) < n  # the selection really is sparse
    # A tight capacity runs exactly its share of the prompt's rows and reports the rest as dropped.
    _, tight = run(make_engine(model), pre, [s1, s2], suf, redknot(0.1))
    cap = redknot(0.1).ffn_capacity_rows(n)
    assert tight.ffn_rows == [cap] * model.config.num_layers
    assert tight.ffn_rows[0] + tight.ffn_dropped[0] == uncapped.ffn_rows[0]  # same choice, then capped
    # The share is of the prompt's rows, not of its bucket: in a 512-row bucket the same request runs the
    # same rows and gives the same logits.
    wide = make_engine(model, max_model_len=1024)
    buckets = [token_rows_bucket(n, e.max_pages_per_head * e.page_size) for e in (make_engine(model), wide)]
    assert buckets == [128, 512]
    _, wide_tight = run(wide, pre, [s1, s2], suf, redknot(0.1))
    assert wide_tight.ffn_rows == tight.ffn_rows and wide_tight.ffn_dropped == tight.ffn_dropped
    np.testing.assert_allclose(wide_tight.first_logits, tight.first_logits, atol=1e-5)


def test_redknot_ffn_dilation_adds_the_successors_of_selected_rows():
    from jaxkv.policies.reuse.redknot import _dilate

    positions = jnp.array([0, 1, 2, 3, 4, 5, 9, 10, 11, -1, -1], jnp.int32)  # a gap after 5, then padding
    sel = jnp.array([0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0], bool)
    share = jnp.array([0, .5, 0, 0, 0, .2, 0, 0, 0, 0, 0], jnp.float32)
    got, pri = _dilate(sel, share, positions, 2)
    # Row 1 reaches positions 2, 3; row 5 reaches 6, 7, which no row holds (position 9 is 4 away).
    np.testing.assert_array_equal(np.asarray(got), [0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(pri)[[1, 2, 3, 5]], [.5, .5, .5, .2])
    same, pri0 = _dilate(sel, share, positions, 0)
    assert same is sel and pri0 is share


def test_spread_forward_takes_the_max_of_the_rows_just_before():
    from jaxkv.policies.reuse.base import spread_forward

    positions = jnp.array([0, 1, 2, 3, 7, 8, -1], jnp.int32)
    score = jnp.array([[5., 0.], [0., 1.], [0., 0.], [0., 0.], [0., 0.], [2., 0.], [9., 9.]])  # per head
    got = np.asarray(spread_forward(score, positions, 2))
    # Row 0's 5 reaches positions 1, 2; row 1's 1 (head 1) reaches 2, 3; position 7 is 4 after 3; padding
    # keeps its own value and gives none.
    np.testing.assert_array_equal(got, [[5, 0], [5, 1], [5, 1], [0, 1], [0, 0], [2, 0], [9, 9]])
    # a width beyond the rows (RedKnot's default dilation 16 over an 8-row pass): every earlier row reaches
    wide = np.asarray(spread_forward(score[:4], positions[:4], 16))
    np.testing.assert_array_equal(wide, [[5, 0], [5, 1], [5, 1], [5, 1]])


def test_redknot_ffn_dilation_runs_the_ffn_on_more_rows(model, pieces):
    pre, s1, s2, suf = pieces
    kw = dict(edge_thresh=0.0, dense_until=0, recent_n=2, mass_thresh=0.2, ffn_capacity=1.0)
    _, plain = run(make_engine(model), pre, [s1, s2], suf, get_reuse_policy("redknot", ffn_dilate=0, **kw))
    _, wide = run(make_engine(model), pre, [s1, s2], suf, get_reuse_policy("redknot", ffn_dilate=3, **kw))
    assert all(w >= p for w, p in zip(wide.ffn_rows, plain.ffn_rows))
    assert sum(wide.ffn_rows) > sum(plain.ffn_rows)
    with pytest.raises(ValueError, match="ffn_dilate"):
        get_reuse_policy("redknot", ffn_dilate=-1)


def test_sparsex_dilate_recomputes_the_successors_of_its_top_tokens(model, pieces):
    """Same k: spreading the score forward trades lone top tokens for runs after the best ones."""
    pre, s1, s2, suf = pieces
    kw = dict(ratio=0.25, block=0, tail=0)
    eng = make_engine(model)
    _, plain = run(eng, pre, [s1, s2], suf, get_reuse_policy("sparsex", **kw))
    _, wide = run(make_engine(model), pre, [s1, s2], suf, get_reuse_policy("sparsex", dilate=4, **kw))
    assert wide.recomputed_rows == plain.recomputed_rows  # the budget is the same k
    assert not np.allclose(wide.first_logits, plain.first_logits, atol=1e-5)  # a different set of tokens
    with pytest.raises(ValueError, match="dilate"):
        get_reuse_policy("sparsex", dilate=1.5)


def test_redknot_local_heads_attend_to_their_window_only(model, pieces):
    cfg = model.config
    pre, s1, s2, suf = pieces
    eng = make_engine(model)
    eng.reuser.__init__(eng, reuse_head_classes=local_heads_map(cfg), keep_logits=True)
    _, st = run(eng, pre, [s1, s2], suf, get_reuse_policy("redknot", edge_thresh=1.0, dense_until=99))
    n, H = st.prompt_tokens, cfg.num_kv_heads
    full_keys = n * (n + 1) // 2
    local_keys = sum(min(p + 1, 2 + 4) for p in range(n))
    assert st.keys_seen == [round((full_keys + (H - 1) * local_keys) / H)] * cfg.num_layers
    # Promoted heads (restore on everywhere) see the whole history again.
    eng = make_engine(model)
    eng.reuser.__init__(eng, reuse_head_classes=local_heads_map(cfg), keep_logits=True)
    _, st = run(eng, pre, [s1, s2], suf, get_reuse_policy("redknot", edge_thresh=0.0, dense_until=99))
    assert st.keys_seen == [full_keys] * cfg.num_layers


def test_selection_size_is_data_so_prompts_share_a_compilation(model, pieces):
    pre, s1, s2, suf = pieces
    eng = make_engine(model)
    pol = get_reuse_policy("sparsex", ratio=0.3, block=0, tail=0)
    before = num_compilations()
    _, a = run(eng, pre, [s1, s2], suf, pol)
    _, b = run(eng, pre, [s1[:-2], s2], suf, pol)  # 2 fewer reused tokens, same pages: other k, same buckets
    assert num_compilations() - before <= 1
    assert a.recomputed_rows[-1] - b.recomputed_rows[-1] == 1  # ceil(0.3 * 32) - ceil(0.3 * 30) = 10 - 9


def test_layouts_in_one_token_bucket_share_a_compilation(model, pieces):
    """Every size of the pass but the rows follows the token bucket (pages per head, copy and clear lists,
    probes): one segment or two, a 19- or a 7-token question, 43 or 44 tokens, one compiled pass."""
    pre, s1, s2, suf = pieces
    eng = make_engine(model)
    pol = get_reuse_policy("redknot")   # every token a row (T = R): the rows follow the token bucket too
    run(eng, pre, [s1], s1, pol)
    before = num_compilations()
    run(eng, pre, [s1, s2], suf, pol)
    assert num_compilations() == before


def test_row_buckets_follow_the_token_bucket():
    """A method that picks its rows gets a power-of-two token bucket (floor 512, capped at the context's own
    bucket) and the smallest row bucket of it that holds its rows: at least 64, small counts padded at most
    63 rows or 2x, counts between T/16 and T/4 (the default selections) at most 1.5x. At the 8B benchmark
    layout (33,040 slots of a 33,072-slot context) naive and EPIC keep the 512 rows and SparseX / CacheBlend
    get 5,760 for 5,220 / 5,188 (5,632 when the rows were bucketed alone: +2.3 %). Counted for a 32K context
    (the GPU benchmark's): 76 passes per such method (114 with 8-row and 128-token floors), 37 at 4K (66).
    A method whose rows are its tokens (RedKnot, full) gets one bucket of both: powers of two from 512 to 2K,
    then 4 per doubling (padding at most 25 %), capped at the context's bucket: 19 and 7."""
    limit = 32768
    for n in (1, 100, 129, 300, 2049, 17000, 32768):
        T = token_bucket(n, limit)
        assert T >= n and (T == 512 or T < 2 * n) and T & (T - 1) == 0
    assert token_bucket(33040, 33072) == 36864 and token_bucket(20000, 33072) == 32768
    for T in (128, 1024, 32768, 36864):
        ladder = row_ladder(T)
        assert ladder[0] == min(64, T) and ladder[-1] == T and all(r % 8 == 0 for r in ladder)
        for rows in range(1, T + 1, 7):
            R = pass_shape(T - 3, rows, selects=True, rows_are_tokens=False, limit=T)[1]
            assert rows <= R == min(r for r in ladder if r >= rows)
            assert R <= max(64, 2 * rows - 1)
            assert R < 1.5 * rows or not T // 16 < rows <= T // 4 or T < 256   # T/32 steps: 8 rows or more
    assert pass_shape(300, 300, selects=False, rows_are_tokens=True, limit=1024) == (512, 512, 0)
    assert pass_shape(300, 12, selects=False, rows_are_tokens=False, limit=1024) == (512, 64, 0)
    assert pass_shape(300, 70, selects=True, rows_are_tokens=False, limit=1024) == (512, 80, 80)
    assert pass_shape(20, 20, selects=False, rows_are_tokens=True, limit=1024) == (512, 512, 0)
    assert pass_shape(20, 20, selects=False, rows_are_tokens=True, limit=128) == (128, 128, 0)
    for n in range(2049, 40000, 97):
        T = token_rows_bucket(n, 65536)
        assert n <= T <= 1.25 * n and T % 512 == 0
    assert token_rows_bucket(33040, 33072) == 36864 and token_rows_bucket(33040, 65536) == 40960
    layout = dict(naive=272, epic=272 + 8 * 16, cacheblend=272 + 4916, sparsex=272 + 32 + 4916)
    got = {m: pass_shape(33040, rows, m in ("cacheblend", "sparsex"), False, 33072)[:2]
           for m, rows in layout.items()}
    assert got == dict(naive=(36864, 512), epic=(36864, 512), cacheblend=(36864, 5760), sparsex=(36864, 5760))
    for limit, subset, every in ((32768, 76, 19), (4096, 37, 7)):
        counts = {m: len(pass_shapes(get_reuse_policy(m), limit)) for m in sorted(REUSE_POLICIES)}
        assert counts == {"cacheblend": subset, "epic": subset, "full": every, "naive": subset,
                          "redknot": every, "sparsex": subset}


@pytest.mark.parametrize("spec", [dict(name="naive", question=30), dict(name="epic", first=2, question=30),
                                  dict(name="cacheblend", ratio=0.15),
                                  dict(name="sparsex", ratio=0.1, block=2, tail=4, per_head=True)])
def test_padding_rows_leave_the_tokens_unchanged(model, pieces, monkeypatch, spec):
    """Rows are padded to their bucket (64 rows for 35 to 48 of a 256-token bucket); padding rows are masked,
    so the tokens, the first token's logits and the per-layer counts equal those of a pass whose rows are
    padded to every slot of the bucket (256)."""
    import jaxkv.engine.reuse as reuse_mod

    cfg = model.config
    pre, s1, s2, suf = pieces
    segments = [(s1 + s2) * 3, s1 * 3]   # 153 reused tokens, 165 to 188 in all: a 256-token bucket
    spec = dict(spec)
    suffix = (suf * 5)[:spec.pop("question", len(suf))]
    pol = get_reuse_policy(spec.pop("name"), **spec)
    shapes, ladder_pick = [], reuse_mod.pass_shape

    def spy(*args):
        shapes.append(ladder_pick(*args))
        return shapes[-1]

    def tight(n, rows, selects, rows_are_tokens, limit):
        T = row_bucket(n, floor=128)
        shapes.append((T, T, T if selects else 0))
        return shapes[-1]

    def engine():
        eng = Engine(model, page_size=4, max_model_len=256, attn_impl="reference",
                     head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))
        eng.reuser.keep_logits = True
        return eng

    monkeypatch.setattr(reuse_mod, "pass_shape", spy)
    got = run(engine(), pre, segments, suffix, pol)
    monkeypatch.setattr(reuse_mod, "pass_shape", tight)
    want = run(engine(), pre, segments, suffix, pol)
    assert shapes[0][0] == shapes[1][0] == 256 and shapes[0][1] == 64 and shapes[1][1] == 256
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1].first_logits, want[1].first_logits, atol=1e-5, rtol=1e-5)
    for field in ("recomputed_rows", "kv_writes", "ffn_rows", "keys_seen"):
        assert getattr(got[1], field) == getattr(want[1], field), field


def test_probe_sum_reads_every_probe_in_chunks():
    """`LayerView.probe_sum` over 150 probes (three chunks of 64, holes among them) equals the dense
    softmax of every probe over the causal keys, summed; no probe gives zero."""
    from jaxkv.policies.reuse.base import PROBE_CHUNK, LayerView

    rng = np.random.default_rng(3)
    R, hq, hkv, d = 200, 4, 2, 8
    q, k = (jnp.asarray(rng.normal(size=(R, h, d)), jnp.float32) for h in (hq, hkv))
    positions = np.arange(R, dtype=np.int32)
    positions[190:] = -1                                   # padding rows
    probe = np.full(256, -1, np.int32)
    probe[:150] = np.arange(40, 190)
    probe[[3, 77]] = -1                                    # probes not among the rows
    view = LayerView(q=q, k=k, v=k, k_cached=k, v_cached=k, positions=jnp.asarray(positions),
                     is_new=jnp.zeros(R, bool), forced=jnp.zeros(R, bool), seg_offset=jnp.full(R, -1),
                     probe=jnp.asarray(probe), is_global=jnp.ones(hkv, bool), sink=jnp.zeros(hkv, jnp.int32),
                     window=jnp.zeros(hkv, jnp.int32))
    assert 150 > 2 * PROBE_CHUNK
    got = np.asarray(jax.jit(lambda v: v.probe_sum(lambda p, _: jnp.sum(p, axis=(1, 2))))(view))
    qn, kn = np.asarray(q, np.float64).reshape(R, hkv, hq // hkv, d), np.asarray(k, np.float64)
    want = np.zeros((hkv, R))
    for i in probe[probe >= 0]:
        logits = np.einsum("hgd,rhd->hgr", qn[i], kn) / np.sqrt(d)
        logits[..., (positions < 0) | (positions > positions[i])] = -np.inf
        p = np.exp(logits - logits.max(-1, keepdims=True))
        want += (p / p.sum(-1, keepdims=True)).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    none = dataclasses.replace(view, probe=jnp.full(256, -1, jnp.int32))
    assert not np.asarray(none.probe_sum(lambda p, _: jnp.sum(p, axis=(1, 2)))).any()


def test_methods_that_differ_on_the_host_only_share_their_device_pass():
    """naive, EPIC (any `first`) and full change host hooks only: one plain pass of their `full_layers`; a
    method with its own device hooks or flags (CacheBlend, SparseX, RedKnot) keeps its own."""
    from jaxkv.policies.reuse.base import PlainPass

    plain = PlainPass(full_layers=0)
    assert get_reuse_policy("naive").device_form() == get_reuse_policy("epic", first=5).device_form() == plain
    assert get_reuse_policy("full").device_form() == plain
    assert get_reuse_policy("epic", full_layers=2).device_form() == PlainPass(full_layers=2)
    for name in ("cacheblend", "sparsex", "redknot"):
        pol = get_reuse_policy(name)
        assert pol.device_form() is pol


def test_every_method_precompiles_and_then_serves_without_a_compile(model, pieces):
    """`Engine.precompile_reuse([...])` compiles every method's passes (`pass_shapes`: the token buckets x
    their row buckets, or the token buckets alone for RedKnot) on all-padding batches: the pool is
    unchanged, and requests of every method, short and long questions (more probes than one chunk), one
    segment, two, or ten short ones (their page-alignment holes take the layout past its tokens' bucket),
    then compile nothing; the tokens equal a fresh engine's. Segments in host memory would run naive's and
    EPIC's pass in two layer groups (one layer each): their programs are precompiled too."""
    pre, s1, s2, suf = pieces
    long_q = [t for _ in range(5) for t in suf + s2][:70]
    eng = make_engine(model)
    # fields no other test uses: their own compilations
    pols = [get_reuse_policy("naive"), get_reuse_policy("epic", first=5),
            get_reuse_policy("cacheblend", ratio=0.21), get_reuse_policy("sparsex", ratio=0.21, dilate=1),
            get_reuse_policy("redknot", mass_thresh=0.77)]
    pool0 = [np.asarray(x).copy() for x in (eng.runner.pool.k, eng.runner.pool.v, eng.runner.pool.pos)]
    compiled = num_compilations()
    n = eng.precompile_reuse(pols, progress=False)
    limit = eng.max_pages_per_head * eng.page_size
    assert sum(len(pass_shapes(p, limit)) for p in pols) == 4 * 2 + 1   # T 128; rows 64, 128; RedKnot 128
    # naive and EPIC run one device pass (`ReusePolicy.device_form`), compiled once with its two layer groups
    # per shape; SparseX's and CacheBlend's first group holds both layers, RedKnot reads no head of this
    # all-global map (nothing to promote): one program per shape
    assert n == 3 * 2 + 1 + 2 * 2
    assert num_compilations() - compiled == n == len(eng.reuser.compiled)  # compiled on the pool, installed
    compiled = num_compilations()
    for before, now in zip(pool0, (eng.runner.pool.k, eng.runner.pool.v, eng.runner.pool.pos)):
        np.testing.assert_array_equal(np.asarray(now), before)
    # ten 5-token segments: 60 tokens whose page-aligned layout takes 88 slots (the bucket of 128, not 64)
    many = (pre[:3], [s1[i:i + 5] for i in range(10)], suf)
    layouts = [(pre, [s1, s2], suf), (pre, [s1, s2], long_q), (pre[:2], [s2], suf + suf), many]
    got = {(p.name, i): run(eng, *lay, p)[0] for p in pols for i, lay in enumerate(layouts)}
    assert num_compilations() == compiled   # every request's shapes are precompiled ones
    fresh = make_engine(model)
    for name, i in [("sparsex", 1), ("redknot", 1), ("epic", 0)]:
        pol = next(p for p in pols if p.name == name)
        assert got[(name, i)] == run(fresh, *layouts[i], pol)[0]
    with pytest.raises(ValueError, match="unknown reuse method"):
        eng.precompile_reuse(["naive", "nope"], progress=False)


@pytest.mark.parametrize("spec", [dict(name="redknot", edge_thresh=1.0, dense_until=99),   # map windows
                                  dict(name="redknot", edge_thresh=0.0, dense_until=99),   # all promoted
                                  dict(name="full")])
def test_token_ordered_rows_through_the_flash_path_match_the_paged_path(model, pieces, spec):
    """Rows that are the prompt's tokens in order take the fresh-prefill kernel over gathered K/V (with the
    map's windows when no local head is promoted); the paged path (reference impl) gives the same logits."""
    cfg = model.config
    pre, s1, s2, suf = pieces
    spec = dict(spec)
    policy = get_reuse_policy(spec.pop("name"), **spec)
    logits = []
    for impl in ("reference", None):
        eng = Engine(model, page_size=4, max_model_len=128, attn_impl=impl,
                     head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))
        eng.reuser.__init__(eng, reuse_head_classes=local_heads_map(cfg), keep_logits=True)
        assert (eng.reuser.impl == "reference") == (impl == "reference")
        _, st = run(eng, pre, [s1, s2], suf, policy)
        logits.append(st.first_logits)
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-4, rtol=2e-4)


def test_reuse_first_token_returns_before_any_decode_call(model, pieces):
    """The step that runs a reuse prefill returns its first token at once (TTFT); decoding starts in the next
    step. Bundling the next multi-step decode call into that step delayed the first token by a whole call."""
    pre, s1, s2, suf = pieces
    eng = make_engine(model, decode_steps=4)
    rid = eng.add_reuse_request(pre, [s1, s2], suf, reuse="naive", sampling=GREEDY)
    first = [o for o in eng.step() if o.request_id == rid]
    assert [len(o.new_token_ids) for o in first] == [1]
    assert len(eng._requests[rid].output_ids) == 1     # no decode ran inside that step
    rest = []
    while eng.has_unfinished():
        rest += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert len(rest) == GREEDY.max_tokens - 1


@pytest.mark.parametrize("spec", [dict(name="sparsex", ratio=0.3, block=0, tail=0),
                                  dict(name="cacheblend", ratio=0.3)])
def test_sparse_rows_through_the_split_attention_match_the_paged_path(model, pieces, monkeypatch, spec):
    """SparseX / CacheBlend rows over the whole history take `rows_attention`'s split (prefix chunks +
    paged diagonal + LSE merge; here its twin prefix and the interpret-mode Pallas diagonal, small chunks
    so several chunks see a prefix); the first token's logits equal the reference paged path's."""
    import jaxkv.policies.reuse.apply as apply_mod
    import pallas_kernels.rows_attention.api as rows_api

    monkeypatch.setattr(rows_api, "CHUNK", 4)
    monkeypatch.setattr(rows_api, "PAGE", 4)
    calls = []

    def spy(*a, **kw):   # the rows' positions, when the compiled step runs
        jax.debug.callback(lambda p: calls.append(np.asarray(p)), a[3])
        return rows_api.rows_attention(*a, **kw)

    monkeypatch.setattr(apply_mod, "rows_attention", spy)
    pre, s1, s2, suf = pieces
    spec = dict(spec)
    policy = get_reuse_policy(spec.pop("name"), **spec)
    logits = []
    for impl in ("reference", "pallas"):
        eng = make_engine(model)
        eng.reuser.impl = impl
        _, st = run(eng, pre, [s1, s2], suf, policy)
        logits.append(st.first_logits)
    assert calls, "the split path was not traced"
    assert st.recomputed_rows[-1] < st.prompt_tokens
    starts = np.asarray(rows_api.chunk_starts(jnp.asarray(calls[0]), 4, 4))
    assert np.sum(starts > 0) >= 2        # several chunks have a non-empty prefix part
    np.testing.assert_allclose(logits[1], logits[0], atol=2e-4, rtol=2e-4)


def test_redknot_ffn_reuse_is_exact_where_the_segment_context_is_unchanged(model, pieces):
    # Right after a prefix equal to the anchor, a segment's own prefill *is* the full prompt's computation,
    # so its cached FFN outputs are the ones a dense FFN would give: RedKnot with a tiny FFN buffer and
    # `ffn_reuse` equals full, while the paper's rule (skipped rows add nothing) does not.
    _, s1, s2, suf = pieces
    anchor = [s2[0], s2[1], s2[2]]
    dense = dense_last_logits(model, anchor + s1 + suf)
    sparse = dict(dense_until=0, ffn_capacity=0.4, mass_thresh=0.05, ffn_dilate=0, recent_n=1)
    eng = make_engine(model, segment_anchor=anchor)
    out, st = run(eng, anchor, [s1], suf, get_reuse_policy("redknot", ffn_reuse=True, **sparse))
    assert max(st.ffn_rows) <= st.prompt_tokens - 8 and max(st.ffn_dropped) == 0  # segment rows skipped
    np.testing.assert_allclose(st.first_logits, dense, atol=1e-4)
    e = eng.reuser.store.find(s1)
    assert e.ffn.rows().shape == (model.config.num_layers, len(s1), model.config.hidden_size)
    _, zero = run(make_engine(model, segment_anchor=anchor), anchor, [s1], suf,
                  get_reuse_policy("redknot", **sparse))
    assert np.abs(zero.first_logits - dense).max() > 1e-2
    # Ranked by K deviation instead (zero here: nothing moved), the skipped rows are exact the same way.
    _, dev = run(make_engine(model, segment_anchor=anchor), anchor, [s1], suf,
                 get_reuse_policy("redknot", ffn_reuse=True, ffn_select="deviation", **sparse))
    np.testing.assert_allclose(dev.first_logits, dense, atol=1e-4)
    assert max(dev.ffn_rows) < dev.prompt_tokens
    with pytest.raises(ValueError, match="ffn_reuse must be a bool"):
        get_reuse_policy("redknot", ffn_reuse="yes")
    with pytest.raises(ValueError, match="ffn_select"):
        get_reuse_policy("redknot", ffn_select="random")


def test_segment_ffn_cache_stays_within_its_budget(model, pieces):
    """RedKnot ffn_reuse's per-segment FFN outputs live outside the pool under their own byte budget: the
    least recently used entry loses its outputs first, an evicted entry's go with it, and a dropped output
    is recomputed on its next use with the same answer."""
    pre, s1, s2, suf = pieces
    pol = get_reuse_policy("redknot", ffn_reuse=True, dense_until=0, ffn_capacity=0.4, mass_thresh=0.05,
                           ffn_dilate=0, recent_n=1)
    cfg = model.config
    # fp32 [L, W, hidden]: an entry keeps its forward's padded output (BOS anchor + segment, bucketed)
    one = cfg.num_layers * row_bucket(1 + max(len(s1), len(s2)), floor=128) * cfg.hidden_size * 4
    eng = make_engine(model, segment_ffn_cache_bytes=one)   # room for one segment's outputs
    first, st1 = run(eng, pre, [s1], suf, pol)
    e1 = eng.reuser.store.find(s1)
    assert e1.ffn is not None and eng.reuser.ffn_cache.nbytes <= one
    run(eng, pre, [s2], suf, pol)
    e2 = eng.reuser.store.find(s2)
    assert e1.ffn is None and e2.ffn is not None            # s1 was least recently used
    assert eng.reuser.ffn_cache.nbytes == e2.ffn.nbytes <= one
    again, st2 = run(eng, pre, [s1], suf, pol)              # recomputed, same answer
    assert again == first
    np.testing.assert_allclose(st2.first_logits, st1.first_logits, atol=1e-6)
    assert e1.ffn is not None and e2.ffn is None
    eng.reuser.store.clear()                                # the store drops the entries, and their outputs
    assert e1.ffn is None and eng.reuser.ffn_cache.nbytes == 0
    run(eng, pre, [s2], suf, pol)
    assert eng.reuser.ffn_cache.nbytes <= one and len(eng.reuser.ffn_cache) == 1
    # A budget of 0 keeps nothing and still answers the same.
    zero = make_engine(model, segment_ffn_cache_bytes=0)
    out, st0 = run(zero, pre, [s1], suf, pol)
    assert out == first and zero.reuser.store.find(s1).ffn is None and zero.reuser.ffn_cache.nbytes == 0
    with pytest.raises(ValueError, match="segment_ffn_cache_bytes"):
        make_engine(model, segment_ffn_cache_bytes=-1)


def test_segment_ffn_outputs_are_built_only_for_methods_that_declare_them(model, pieces):
    """The engine builds a prompt's per-segment FFN outputs when the method declares `uses_segment_ffn`
    (RedKnot: `ffn_reuse`), never by its name: a method that does not declare it leaves the cache empty."""
    from jaxkv.policies.reuse.naive import Naive

    @dataclasses.dataclass(frozen=True)
    class NaiveReadingFFN(Naive):
        @property
        def uses_segment_ffn(self) -> bool:
            return True

    assert not get_reuse_policy("naive").uses_segment_ffn
    assert not get_reuse_policy("redknot").uses_segment_ffn
    assert get_reuse_policy("redknot", ffn_reuse=True).uses_segment_ffn
    assert get_reuse_policy("sparsex", per_head=True).selects_per_head
    assert not get_reuse_policy("sparsex").selects_per_head
    pre, s1, _, suf = pieces
    plain = make_engine(model)
    out, _ = run(plain, pre, [s1], suf, "naive")
    assert plain.reuser.store.find(s1).ffn is None and len(plain.reuser.ffn_cache) == 0
    declared = make_engine(model)
    out2, _ = run(declared, pre, [s1], suf, NaiveReadingFFN())
    e = declared.reuser.store.find(s1)
    cfg = model.config
    assert e.ffn.rows().shape == (cfg.num_layers, len(s1), cfg.hidden_size)
    assert len(declared.reuser.ffn_cache) == 1
    assert declared.reuser.ffn_cache.nbytes == e.ffn.nbytes
    assert out2 == out  # naive runs every row's FFN, so the outputs it was given change nothing


def test_segments_cached_with_their_prompt_context_make_naive_reuse_exact(model, pieces):
    """SparseX's protocol: a segment registered with the text before it in an earlier prompt carries that
    text's context. Cached from this very prompt (context = prefix + the segments before), naive reuse
    equals the full prefill; cached from another order it does not, and the context is part of the id."""
    pre, s1, s2, suf = pieces
    dense = dense_last_logits(model, pre + s1 + s2 + suf)
    eng = make_engine(model, segment_anchor=None)
    free = eng.allocator.num_free
    a = eng.register_segment(s1, context=pre)
    b = eng.register_segment(s2, context=pre + s1)
    _, st = run(eng, pre, [a, b], suf, "naive")
    np.testing.assert_allclose(st.first_logits, dense, atol=1e-4)
    assert st.reused_tokens == len(s1) + len(s2) and st.recompute_fraction == 0.0
    entry = eng.reuser.store.get(b)
    assert entry.start == len(pre) + len(s1) and entry.context == tuple(pre + s1)
    # Another earlier prompt (s2 first): other ids, approximate reuse.
    b2 = eng.register_segment(s2, context=pre)
    a2 = eng.register_segment(s1, context=pre + s2)
    assert {a2, b2}.isdisjoint({a, b}) and eng.register_segment(s1, context=pre) == a  # found, not re-made
    _, st2 = run(eng, pre, [a2, b2], suf, "naive")
    assert np.abs(st2.first_logits - dense).max() > 1e-3
    # The context's scratch pages are not kept: the store holds only the segments' own pages.
    held = sum(e.pages.size for e in eng.reuser.store.entries())
    assert eng.allocator.num_free == free - held
    with pytest.raises(SegmentError, match="of context"):
        eng.register_segment(s1, context=list(range(3, 130)))


def test_reuse_on_a_merging_engine_leaves_no_stale_bias(model, pieces):
    """Every page of a merging engine may hold another request's biases (decode adds them to the logits). A
    reuse request's copied segment pages start from bias 0 and its new text is reset by write_kv: with the
    whole pool's bias set to garbage first, every visible slot the request holds has bias 0."""
    import dataclasses as dc

    pre, s1, s2, suf = pieces
    eng = make_engine(model, segment_anchor=None, kv_merge=True)
    for s in (s1, s2):
        eng.register_segment(s)
    pool = eng.runner.pool
    stale = np.random.default_rng(5).normal(0, 3, pool.bias.shape).astype(np.float32)
    eng.runner.pool = dc.replace(pool, bias=jnp.asarray(stale))
    rid = eng.add_reuse_request(pre, [s1, s2], suf, reuse="naive", sampling=GREEDY)
    eng.step()  # the reuse prefill
    pages = np.concatenate([np.asarray(p, np.int64) for row in eng.tables.page_lists(rid) for p in row])
    pos, bias = np.asarray(eng.runner.pool.pos)[pages], np.asarray(eng.runner.pool.bias)[pages]
    assert (pos >= 0).sum() >= len(pre + s1 + s2 + suf) and np.all(bias[pos >= 0] == 0)


@pytest.mark.parametrize("T,W,start,offset,n", [(16, 8, 3, 2, 5), (16, 8, 12, 1, 4), (8, 16, 0, 3, 8),
                                                (8, 16, 5, 10, 3), (32, 32, 0, 0, 32), (16, 8, 15, 7, 1)])
def test_segment_ffn_placement_writes_exactly_the_segment_rows(T, W, start, offset, n):
    """A segment's kept rows land at its place in the prompt, nothing else changes: a forward bucket
    narrower or wider than the pass, a window moved back at the prompt's end."""
    from jaxkv.policies.reuse.ffn_cache import _place

    rng = np.random.default_rng(T + W + start)
    out, ffn = rng.normal(size=(2, T, 3)).astype(np.float32), rng.normal(size=(2, W, 3)).astype(np.float32)
    want = out.copy()
    want[:, start:start + n] = ffn[:, offset:offset + n]
    got = _place(jnp.asarray(out), jnp.asarray(ffn), np.int32(start), np.int32(offset), np.int32(n))
    assert np.array_equal(np.asarray(got), want)
