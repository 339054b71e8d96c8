"""Segment reuse through the engine's step program (`SegmentConfig.as_steps`, jaxkv/engine/reuse_steps.py):
naive, EPIC and full, and CacheBlend and SparseX after their selection, give the reuse pass's tokens and
statistics, in chunks of the step size, and a request after precompile compiles nothing."""

import numpy as np
import pytest

import jaxkv
from jaxkv.cache.head_classes import all_global
from jaxkv.engine import compilations
from jaxkv.engine.engine import Engine
from jaxkv.engine.reuse import pass_shapes
from jaxkv.engine.reuse_steps import prepare_pages, row_table_calls, runs_as_steps
from jaxkv.policies.reuse import get_reuse_policy
from jaxkv.policies.reuse.apply import reuse_prefill
from jaxkv.sampling import MAX_LOGPROBS, SamplingParams
from tests.hf_tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-reuse-steps")))


def _engine(model, as_steps: bool, **kw):
    cfg = model.config
    return Engine(model, page_size=4, max_model_len=256, max_num_seqs=2, max_step_tokens=16,
                  head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), enable_prefix_caching=False,
                  segment_as_steps=as_steps, **kw)


def _ask(eng, prefix, docs, suffix, method, sampling):
    ids = [eng.register_segment(d) for d in docs]
    rid = eng.add_reuse_request(prefix, ids, suffix, reuse=method, sampling=sampling)
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return out, eng.reuser.stats[rid]


def _pieces(model, sizes, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in sizes]


@pytest.mark.parametrize("method,fields,sampling", [
    ("naive", {}, GREEDY), ("epic", {}, SAMPLED), ("full", {}, GREEDY),
    ("cacheblend", {"ratio": 0.4}, GREEDY), ("sparsex", {}, SAMPLED),
    ("sparsex", {"per_head": True, "ratio": 0.3}, GREEDY)])
def test_steps_give_the_reuse_passs_tokens_and_statistics(model, method, fields, sampling):
    """Prefix 5 tokens, segments of 19 and 13 (page-aligned: holes between them), suffix 23: the suffix alone
    is two steps of at most 16 tokens, full recomputes 60 tokens in four. CacheBlend and SparseX select at
    layer 1 (of 2); the statistics count the rows and (row, head) writes each picked, so equal statistics
    mean an equal selection."""
    prefix, s1, s2, suffix = _pieces(model, (5, 19, 13, 23), seed=1)
    policy = get_reuse_policy(method, **fields)
    got = {}
    for as_steps in (False, True):
        eng = _engine(model, as_steps)
        assert runs_as_steps(eng, policy) == as_steps
        got[as_steps] = _ask(eng, prefix, [s1, s2], suffix, policy, sampling)
    (tok_p, st_p), (tok_s, st_s) = got[False], got[True]
    assert len(tok_s) == sampling.max_tokens and tok_s == tok_p
    for field in ("recomputed_rows", "kv_writes", "ffn_rows", "promoted_heads", "keys_seen", "reused_tokens"):
        assert getattr(st_s, field) == getattr(st_p, field), field
    if method == "naive":
        assert st_s.recompute_fraction == 0.0  # the segments' K/V were reused, not recomputed


def test_selected_rows_through_the_split_kernels_give_the_passs_tokens(model):
    """With the Pallas kernels (interpret mode here) a step from the selection layer attends through
    `rows_attention`'s split over the sequence's K/V gathered in position order, holes dropped, as the
    pass's sparse phase does; the tokens and the selection stay the pass's."""
    prefix, s1, s2, suffix = _pieces(model, (5, 19, 13, 23), seed=7)
    policy = get_reuse_policy("sparsex", per_head=True, ratio=0.3)
    got = {}
    for as_steps in (False, True):
        eng = _engine(model, as_steps, attn_impl="pallas")
        got[as_steps] = _ask(eng, prefix, [s1, s2], suffix, policy, GREEDY)
    (tok_p, st_p), (tok_s, st_s) = got[False], got[True]
    assert len(tok_s) == GREEDY.max_tokens and tok_s == tok_p
    assert (st_s.recomputed_rows, st_s.kv_writes) == (st_p.recomputed_rows, st_p.kv_writes)


def test_which_methods_run_as_steps(model):
    """Plain passes without dense layers, and selecting methods whose only device hook is `score` and which
    select before the last layer; RedKnot (windows, per-layer FFN rows, promotion) keeps its pass."""
    eng = _engine(model, True)
    L = model.config.num_layers
    methods = ("naive", "epic", "full", "cacheblend", "sparsex")
    assert all(runs_as_steps(eng, get_reuse_policy(m)) for m in methods)
    assert not runs_as_steps(eng, get_reuse_policy("redknot"))
    assert not runs_as_steps(eng, get_reuse_policy("cacheblend", full_layers=L))  # nothing left after it
    assert not runs_as_steps(eng, get_reuse_policy("epic", full_layers=1))  # a dense pass of its own


def test_a_request_after_precompile_compiles_nothing(model):
    """Precompile compiles the steps and, for naive and EPIC, one page-copy program per page-table width
    class and the program that builds a step's page table of more than one row on the device (none of their
    passes); their requests then run on those programs."""
    eng = _engine(model, True)
    eng.precompile(progress=False, step_cache=False)
    n = eng.precompile_reuse(["naive", "epic"], progress=False)
    tables = len(row_table_calls(eng.reuser))  # a step's page table of two rows, per width class
    assert tables == len(eng._page_buckets) and n == len(eng._page_buckets) + tables
    before = (compilations.step_programs(), reuse_prefill._cache_size(), prepare_pages._cache_size())
    prefix, s1, s2, suffix = _pieces(model, (3, 30, 9, 11), seed=2)
    for method in ("naive", "epic"):
        tokens, _ = _ask(eng, prefix, [s1, s2], suffix, method, GREEDY)
        assert len(tokens) == GREEDY.max_tokens
    assert (compilations.step_programs(), reuse_prefill._cache_size(), prepare_pages._cache_size()) == before


def test_a_selecting_request_after_precompile_compiles_nothing(model):
    """CacheBlend and SparseX precompile one selection program per token bucket for both (each method's score
    a branch of it, `ScoreUnion`) and the steps from layer 1 once for both (one per step shape of at least
    256 tokens, or the largest); their requests, greedy and sampled, then run on those and give the tokens
    and selections of an engine that compiles each method's own selection as it goes."""
    from jaxkv.engine.reuse_steps import score_form
    from jaxkv.engine.warmup import sampler_forms
    from jaxkv.policies.reuse.base import ScoreUnion

    eng = _engine(model, True)
    eng.precompile(progress=False, step_cache=False)
    n = eng.precompile_reuse(["cacheblend", "sparsex"], progress=False)
    limit = eng.max_pages_per_head * eng.page_size
    buckets = {T for T, _, _ in pass_shapes(get_reuse_policy("sparsex"), limit)}
    # steps hold at least SELECT_STEP_TOKENS (256), here the largest step bucket (16) only
    steps = len(eng._page_buckets) * len(sampler_forms(eng))
    assert n == len(buckets) + steps + len(row_table_calls(eng.reuser))
    forms = [score_form(eng.reuser, get_reuse_policy(m)) for m in ("cacheblend", "sparsex")]
    assert isinstance(forms[0][0], ScoreUnion) and forms[0][0] is forms[1][0] and forms[0][1] != forms[1][1]
    before = (compilations.step_programs(), reuse_prefill._cache_size())
    prefix, s1, s2, suffix = _pieces(model, (3, 30, 9, 11), seed=2)
    got = []
    for method, sampling in (("cacheblend", GREEDY), ("sparsex", SAMPLED)):
        tokens, stats = _ask(eng, prefix, [s1, s2], suffix, method, sampling)
        assert len(tokens) == sampling.max_tokens
        got.append((tokens, stats.recomputed_rows, stats.kv_writes))
    assert (compilations.step_programs(), reuse_prefill._cache_size()) == before
    lazy = _engine(model, True)  # nothing precompiled: each method's own selection program
    sparsex = get_reuse_policy("sparsex")
    assert score_form(lazy.reuser, sparsex)[0] == sparsex.device_form()
    for (method, sampling), want in zip((("cacheblend", GREEDY), ("sparsex", SAMPLED)), got):
        tokens, stats = _ask(lazy, prefix, [s1, s2], suffix, method, sampling)
        assert (tokens, stats.recomputed_rows, stats.kv_writes) == want


def test_as_steps_must_be_a_bool():
    from jaxkv.engine.config import EngineConfig

    with pytest.raises(ValueError, match="segment_as_steps"):
        EngineConfig.from_kwargs(segment_as_steps=1)


def test_steps_give_the_first_tokens_alternatives(model):
    """A request that asks for logprob alternatives keeps the step path: its first token's alternatives are
    the pass's (the pass reads them from its logits on the host, the step from its logprob variant)."""
    prefix, s1, s2, suffix = _pieces(model, (5, 19, 13, 23), seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3)
    first = {}
    for as_steps in (False, True):
        eng = _engine(model, as_steps)
        ids = [eng.register_segment(d) for d in (s1, s2)]
        widths, run = [], eng.runner.dispatch  # every step, synced or not, goes through `dispatch`
        eng.runner.dispatch = lambda b, *a, run=run, w=widths: w.append(b.top_width) or run(b, *a)
        rid = eng.add_reuse_request(prefix, ids, suffix, reuse="naive", sampling=sp)
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.request_id == rid and o.new_token_ids]
        first[as_steps] = outs[0].new_top_logprobs[0]
        if as_steps:  # the suffix's two steps, the second the logprob variant
            assert widths[:2] == [0, MAX_LOGPROBS]
    assert len(first[True]) == 3 and [i for i, _ in first[True]] == [i for i, _ in first[False]]
    np.testing.assert_allclose([x for _, x in first[True]], [x for _, x in first[False]], atol=1e-4)


def test_segments_in_host_memory_come_up_whole_before_the_steps(model):
    """Segments moved to host memory come back to the device in one piece (no layer groups) and the steps
    give the pass's tokens over them."""
    prefix, s1, s2, suffix = _pieces(model, (4, 21, 17, 9), seed=5)
    got = {}
    for as_steps in (False, True):
        eng = _engine(model, as_steps)
        ids = [eng.register_segment(d) for d in (s1, s2)]
        eng.reuser.tiers.evict(eng.allocator.num_pages)
        assert all(eng.reuser.tiers.tiers(eng.reuser.store.get(s)) == ["host"] for s in ids)
        rid = eng.add_reuse_request(prefix, ids, suffix, reuse="naive", sampling=GREEDY)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
        got[as_steps] = (out, eng.reuser.stats[rid].reused_tokens)
    assert got[True] == got[False] and got[True][1] == len(s1) + len(s2)
