"""Precompile covers the layer-group programs of a reuse pass (tiny random llama of five layers, CPU): a
request whose segments come up from host memory, which runs its pass in layer groups, then compiles
nothing and answers as an engine that compiles as it goes; the programs are listed only where a pass can
run in groups."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.head_classes import HeadClass, HeadClassMap, all_global
from jaxkv.engine import compilations
from jaxkv.engine.engine import Engine
from jaxkv.engine.reuse import pass_shapes
from jaxkv.policies.reuse import get_reuse_policy
from jaxkv.policies.reuse.apply import num_compilations, reuse_prefill
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PREFIX, SUFFIX = [5, 6, 7], [9, 10, 11]
# Methods that keep most reused K/V here, and the programs of one pass shape in five one-layer groups: the
# first, the middle ones (one shared program: their layer offset is data), the last; RedKnot too (its
# `dense_until` is data in its one layer body).
METHODS = {"naive": (dict(name="naive"), 3),
           "redknot": (dict(name="redknot", edge_thresh=1.0, ffn_dilate=4), 3)}


@pytest.fixture(scope="module")
def model5(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-5"), num_hidden_layers=5))


@pytest.fixture(scope="module")
def docs(model5):
    rng = np.random.default_rng(7)
    return [rng.integers(3, model5.config.vocab_size, 16).tolist()]


def engine(model, **kw):
    """Head 0 global, the others local (sink 2 + window 4) in the reuse map, so RedKnot promotes them; naive
    keeps its pass (not the ragged steps), whose layer groups these tests read."""
    L, H = model.config.num_layers, model.config.num_kv_heads
    kw.setdefault("segment_as_steps", False)
    hc = HeadClassMap(L, H, tuple(tuple(HeadClass.global_() if h == 0 else HeadClass.local(2, 4)
                                        for h in range(H)) for _ in range(L)))
    return Engine(model, page_size=4, max_model_len=32, num_pages=600, attn_impl="reference",
                  head_classes=all_global(L, H), segment_head_classes=hc, **kw)


def ask(eng, ids, policy):
    rid = eng.add_reuse_request(PREFIX, ids, SUFFIX, reuse=policy, sampling=GREEDY)
    out = []
    while eng.has_unfinished():
        out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    assert len(out) == GREEDY.max_tokens
    return out, eng.reuser.stats[rid]


def to_host(eng, ids):
    store, tiers = eng.reuser.store, eng.reuser.tiers
    for s in ids:
        tiers.place(store.get(s), "host")
        assert tiers.tiers(store.get(s)) == ["host"]


@pytest.mark.parametrize("method", list(METHODS))
def test_a_request_promoting_its_segments_compiles_nothing_after_precompile(model5, docs, method):
    spec, per_shape = METHODS[method]
    policy = get_reuse_policy(**spec)
    eng = engine(model5)
    shapes = len(pass_shapes(policy, eng.max_pages_per_head * eng.page_size))
    before = num_compilations()
    n = eng.precompile_reuse(policy, progress=False)
    # every pass shape's single program and its group programs, compiled on the pool and installed
    assert n == shapes * (1 + per_shape) == len(eng.reuser.calls(policy)) == len(eng.reuser.compiled)
    assert num_compilations() - before == n
    eng.device_tables.warm()  # the page-table updates of every size, as `Engine.precompile` compiles them
    ids = [eng.register_segment(d) for d in docs]
    on_device, stats = ask(eng, ids, policy)  # the single program (and the engine's decode steps) first
    assert stats.layer_groups == 1
    to_host(eng, ids)
    compiled, jitted = compilations.step_programs(), reuse_prefill._cache_size()
    tokens, stats = ask(eng, ids, policy)
    assert stats.layer_groups == 5  # promoted from host memory beside the groups' programs
    assert reuse_prefill._cache_size() == jitted
    assert compilations.step_programs() == compiled
    assert tokens == on_device
    # an engine that compiles as it goes runs the same groups through jit, with the same tokens
    lazy = engine(model5)
    lazy_ids = [lazy.register_segment(d) for d in docs]
    to_host(lazy, lazy_ids)
    jax.clear_caches()
    again, lazy_stats = ask(lazy, lazy_ids, policy)
    assert again == tokens and lazy_stats.layer_groups == 5
    assert reuse_prefill._cache_size() == per_shape and not lazy.reuser.compiled


def test_group_programs_are_listed_only_where_a_pass_can_run_in_groups(model5, tmp_path):
    """Listed (and counted by precompile) with a host budget or a segment store; not without either, with
    one layer group, or for a method that reuses nothing. SparseX's first group holds its selection layer:
    four groups, three programs."""
    naive, sparsex, full = (get_reuse_policy(m) for m in ("naive", "sparsex", "full"))
    eng = engine(model5)
    count = lambda e, pol: len(e.reuser.calls(pol))  # noqa: E731
    shapes = len(pass_shapes(naive, eng.max_pages_per_head * eng.page_size))
    assert count(eng, naive) == 4 * shapes and count(eng, sparsex) == 4 * shapes
    assert count(eng, full) == len(pass_shapes(full, eng.max_pages_per_head * eng.page_size))
    variants = [v for v, _ in eng.reuser.calls(naive)]
    assert [v[4] for v in variants[shapes:shapes + 3]] == [(0, 1), (1, 2), (4, 5)]
    assert count(engine(model5, segment_host_bytes=0), naive) == shapes  # nothing can be promoted
    assert count(engine(model5, segment_host_bytes=0, segment_store=str(tmp_path)), naive) == 4 * shapes
    eng.reuser.layer_groups = 1
    assert count(eng, naive) == shapes
