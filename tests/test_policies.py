"""Compression policies through the engine: every method against one dense oracle, plus the selection rules.

The oracle does not trust the policies' own selection: it reads back, per (layer, KV head), which original
positions the engine's pages hold after compaction and re-runs the model densely with exactly that key set
visible to the generated tokens. Greedy tokens must match, so the rewrite, the host page bookkeeping and
decoding over ragged per-head lengths are all checked for every method at once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.head_classes import HeadClass, HeadClassMap
from jaxkv.engine.engine import Engine
from jaxkv.models import llama
from jaxkv.policies import POLICIES, CompressPolicy, SelectContext, get_policy, select
from jaxkv.policies.compress.hardkv import solve_temperature, topp_count
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint

NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("policies")))


def prompts_for(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in lengths]


def kept_positions(eng, rid):
    """[L][H] -> sorted original positions the head's pages hold now."""
    pos = np.asarray(eng.runner.pool.pos)
    lengths = eng.tables.lengths(rid)
    out = []
    for layer, row in enumerate(eng.tables.page_lists(rid)):
        heads = []
        for h, pages in enumerate(row):
            p = pos[pages].reshape(-1)[:lengths[layer, h]]
            heads.append(np.sort(p[p >= 0]))
        out.append(heads)
    return out


def run_capturing(eng, prompts):
    """Runs to completion; captures each request's kept positions right after its first compression."""
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    tokens = {i: [] for i in ids}
    kept = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        for i in ids:
            req = eng._requests.get(i)
            if i not in kept and req is not None and req.kv_compressed_at is not None:
                kept[i] = kept_positions(eng, i)
    return [tokens[i] for i in ids], [kept.get(i) for i in ids]


def dense_greedy_with_keep(model, prompt, n, kept):
    """Greedy tokens when queries of generated tokens see only `kept[l][h]` among the prompt's keys."""
    cfg, params = model.config, model.params
    L, H, G = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    p = len(prompt)
    ids = list(prompt)
    def attend(layer, q, k, v, masks):
        t = q.shape[1]
        qg = q[0].reshape(t, H, G, -1)
        s = jnp.einsum("qhgd,khd->hgqk", qg, k[0]) * cfg.head_dim ** -0.5
        s = jnp.where(masks[layer][:, None], s, -jnp.inf)
        o = jnp.einsum("hgqk,khd->qhgd", jax.nn.softmax(s, axis=-1), v[0])
        return o.reshape(1, t, H * G, -1), masks

    for _ in range(n):
        t = len(ids)
        keep = np.ones((L, H, t), bool)
        for layer in range(L):
            for h in range(H):
                keep[layer, h, :p] = False
                keep[layer, h, kept[layer][h]] = True
        qpos = np.arange(t)
        causal = qpos[None, :] <= qpos[:, None]  # [Tq, Tk]
        drop = (~keep)[:, :, None, :] & (qpos[None, None, :, None] >= p)  # [L, H, Tq, Tk]
        masks = jnp.asarray(causal[None, None] & ~drop)
        hidden, _ = llama.forward(params, cfg, jnp.asarray([ids]), jnp.arange(t)[None], attend, masks)
        ids.append(int(jnp.argmax(llama.lm_head(params, cfg, hidden[0, -1]))))
    return ids[p:]


@pytest.mark.parametrize("name", sorted(n for n, c in POLICIES.items() if issubclass(c, CompressPolicy)))
def test_policy_through_engine_equals_dense_oracle(model, name):
    prompts = prompts_for(model, [150, 97])
    pol = get_policy(name, budget=48, window=16, **({"sink": 4} if name != "streaming_llm" else {}))
    pol = dataclasses.replace(pol, merge=False)  # the oracle is a keep mask (merging: its own tests below)
    eng = Engine(model, page_size=8, max_step_tokens=64, max_num_seqs=2, kv_policy=pol, attn_impl="reference")
    tokens, kept = run_capturing(eng, prompts)
    assert eng.compressor.num_compressions >= 1 and eng.compressor.pages_freed > 0
    for prompt, toks, k in zip(prompts, tokens, kept):
        counts = np.array([[len(x) for x in row] for row in k])
        assert counts.max() < len(prompt), "nothing was dropped"
        assert dense_greedy_with_keep(model, prompt, NEW, k) == toks
        # Sinks and the recent window are always there.
        for row in k:
            for heads in row:
                assert set(range(pol.sink)) <= set(heads.tolist())
                recent = len(prompt) - pol.recent_tokens(pol.target_tokens(len(prompt)))
                assert set(range(recent, len(prompt))) <= set(heads.tolist())
    assert eng.allocator.num_free == eng.allocator.num_pages  # every page back


def test_streaming_llm_keeps_sinks_and_the_newest(model):
    prompt = prompts_for(model, [120])[0]
    eng = Engine(model, page_size=8, max_step_tokens=64, kv_policy="streaming_llm", kv_budget=40,
                 attn_impl="reference")
    _, (kept,) = run_capturing(eng, [prompt])
    want = list(range(4)) + list(range(120 - 36, 120))
    assert all(row[h].tolist() == want for row in kept for h in range(len(row)))


def test_budget_above_prompt_changes_nothing(model):
    prompts = prompts_for(model, [60, 33], seed=1)
    base = jaxkv.generate(model, prompts, GREEDY, page_size=8, attn_impl="reference")
    eng = Engine(model, page_size=8, kv_policy="snapkv", kv_budget=4096, attn_impl="reference")
    tokens, _ = run_capturing(eng, prompts)
    assert tokens == [o.token_ids for o in base]
    assert eng.compressor.pages_freed == 0


def test_hardkv_counts_differ_per_head_within_caps(model):
    prompt = prompts_for(model, [200], seed=2)[0]
    eng = Engine(model, page_size=8, max_step_tokens=64, kv_policy=get_policy("hardkv", budget=128, p=0.5),
                 attn_impl="reference")
    _, (kept,) = run_capturing(eng, [prompt])
    counts = np.array([[len(h) for h in row] for row in kept])
    assert counts.min() >= 64 and counts.max() <= 128  # lower = 0.5 x budget, upper = budget
    assert len(np.unique(counts)) > 1  # truly head-variable


def test_decode_interval_bounds_the_cache_during_long_generation(model):
    prompt = prompts_for(model, [40], seed=3)[0]
    pol = get_policy("hardkv", budget=48, window=8, decode_interval=16)
    eng = Engine(model, page_size=8, max_step_tokens=64, kv_policy=pol, attn_impl="reference")
    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        if rid in eng.tables:
            peak = max(peak, int(eng.tables.lengths(rid).max()))
    assert eng.compressor.num_compressions >= 5
    assert peak <= 48 + 16  # the budget plus one interval of new tokens
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_local_heads_stay_rings_under_a_policy(model):
    cfg = model.config
    local = HeadClass.local(4, 16)
    classes = tuple(tuple(local if h == 0 else HeadClass.global_() for h in range(cfg.num_kv_heads))
                    for _ in range(cfg.num_layers))
    hc = HeadClassMap(cfg.num_layers, cfg.num_kv_heads, classes)
    prompt = prompts_for(model, [130], seed=4)[0]
    eng = Engine(model, page_size=8, max_step_tokens=32, head_classes=hc, kv_policy="snapkv", kv_budget=80,
                 attn_impl="reference")
    _, (kept,) = run_capturing(eng, [prompt])
    for row in kept:
        ring = row[0].tolist()
        assert set(range(4)) <= set(ring) and set(range(130 - 15, 130)) <= set(ring)
        assert all(len(h) <= 80 for h in row[1:])  # global heads compressed to the budget


def test_per_request_policy_override(model):
    prompts = prompts_for(model, [90, 90], seed=5)
    eng = Engine(model, page_size=8, attn_impl="reference")  # prefix caching on, no engine policy
    eng.add_request(prompts[0], GREEDY, kv_policy="snapkv", kv_budget=40)
    eng.add_request(prompts[1], GREEDY)
    while eng.has_unfinished():
        eng.step()
    assert eng.compressor.num_compressions == 1 and eng.compressor.pages_freed > 0


def test_select_rule_forced_then_best_ascending():
    S, L, H, N = 1, 1, 2, 16
    pos = jnp.broadcast_to(jnp.arange(N), (S, L, H, N)).astype(jnp.int32)
    scores = jnp.stack([jnp.arange(N)[::-1], jnp.arange(N)], 0)[None, None].astype(jnp.float32)
    ctx = SelectContext(lengths=jnp.full((S, L, H), N, jnp.int32), positions=pos, target=jnp.array([6]),
                        recent_from=jnp.array([14]), compressible=jnp.ones((L, H), bool),
                        lower=jnp.zeros((L, H), jnp.int32), upper=jnp.zeros((L, H), jnp.int32))
    keep = select(scores, jnp.full((S, L, H), 6), ctx, sink=2, kmax=8)
    got = [keep.idx[0, 0, h, :int(keep.count[0, 0, h])].tolist() for h in range(H)]
    assert got[0] == [0, 1, 2, 3, 14, 15]  # sinks, best two (low positions score high), recent
    assert got[1] == [0, 1, 12, 13, 14, 15]
    # Fewer than the forced slots is impossible; more than the length is clipped; kmax caps.
    keep = select(scores, jnp.full((S, L, H), 1), ctx, sink=2, kmax=8)
    assert keep.count.tolist() == [[[4, 4]]]


def test_pyramid_schedule_averages_to_the_budget():
    pol = get_policy("pyramidkv", budget=128, window=16)
    L, H, N = 8, 2, 512
    ctx = SelectContext(lengths=jnp.full((1, L, H), N), positions=jnp.zeros((1, L, H, N), jnp.int32),
                        target=jnp.array([128]), recent_from=jnp.array([N]),
                        compressible=jnp.ones((L, H), bool), lower=jnp.zeros((L, H), jnp.int32),
                        upper=jnp.zeros((L, H), jnp.int32))
    c = np.asarray(pol.counts(jnp.zeros((1, L, H, N)), ctx))[0, :, 0]
    assert (np.diff(c) <= 0).all() and c[0] > 128 > c[-1]
    assert abs(c.mean() - 128) <= 8


def test_adakv_shares_the_layer_budget_across_heads():
    pol = get_policy("adakv", budget=40, window=8, sink=0, alpha=0.25)
    L, H, N = 1, 4, 64
    rng = np.random.default_rng(0)
    scores = rng.random((1, L, H, N)).astype(np.float32)
    scores[0, 0, 0] += 10  # head 0 is "concentrated": all its scores beat the others'
    pos = np.broadcast_to(np.arange(N), (1, L, H, N)).astype(np.int32)
    ctx = SelectContext(lengths=jnp.full((1, L, H), N), positions=jnp.asarray(pos), target=jnp.array([40]),
                        recent_from=jnp.array([N - 8]), compressible=jnp.ones((L, H), bool),
                        lower=jnp.zeros((L, H), jnp.int32), upper=jnp.zeros((L, H), jnp.int32))
    c = np.asarray(pol.counts(jnp.asarray(scores), ctx))[0, 0]
    assert c.sum() == H * 40 or abs(int(c.sum()) - H * 40) <= H  # the layer's total is kept
    assert c[0] > 40 and c[1:].min() >= 8 + int(0.25 * 32)  # head 0 gets more; floors hold


def test_hardkv_temperature_hits_the_target_mass():
    rng = np.random.default_rng(0)
    g = jnp.asarray(-np.sort(-rng.normal(size=(3, 4, 200)) * 3, axis=-1).astype(np.float32))  # [H, W, N]
    n_star = jnp.full((3, 4), 20)
    t = solve_temperature(g, n_star, jnp.ones((3, 4), bool), 0.9)
    pr = jax.nn.softmax(g / t[:, None, None], axis=-1)
    mass = np.asarray(jnp.sum(pr[..., :20], axis=-1)).mean(-1)
    assert np.allclose(mass, 0.9, atol=0.01)
    assert np.asarray(topp_count(jnp.array([[0.5, 0.3, 0.1, 0.1]]), 0.8)).tolist() == [2]


def test_bad_policy_input_is_a_clear_error(model):
    with pytest.raises(ValueError, match="unknown KV policy"):
        Engine(model, kv_policy="nope")
    with pytest.raises(ValueError, match="budget"):
        get_policy("snapkv", budget=-1)
    with pytest.raises(ValueError, match="no field"):
        get_policy("snapkv", temperature=3)
    with pytest.raises(ValueError, match="kv_budget needs a kv_policy"):
        Engine(model, kv_budget=0.5)
    # The engine runs retrieval policies; this model has no retrieval head beside it.
    with pytest.raises(ValueError, match="not a retrieval head directory"):
        Engine(model, kv_policy="specontext")
    assert dataclasses.replace(get_policy("hardkv"), budget=0.5).budget == 0.5


def test_hardkv_sharp_temperature_still_ranks_every_slot():
    # T = 0.01 underflows every probability but the best one to 0 in fp32; the log-scores still rank the
    # rest by their logits (as probabilities they tied and the keep rule took the earliest positions).
    from jaxkv.policies.base import Observation

    z = np.array([0.0, 5.0, 1.0, 4.0, 2.0, 3.0, 10.0, -1.0], np.float32)
    logits = jnp.asarray(np.broadcast_to(z, (1, 1, 1, 2, 8)))  # [S, H, G, W, N]
    pol = get_policy("hardkv", budget=4, window=2, transform="vanilla", calibration=((0.01,),))
    sc = np.asarray(pol.score(Observation(None, None, None, None, None, logits, 0)))[0, 0]
    assert np.isfinite(sc).all() and np.argsort(-sc).tolist() == np.argsort(-z).tolist()
    assert np.exp(sc).sum() == pytest.approx(1.0, abs=1e-6)  # still a distribution (top-p counts)
    ctx = SelectContext(lengths=jnp.full((1, 1, 1), 8),
                        positions=jnp.arange(8, dtype=jnp.int32)[None, None, None], target=jnp.array([4]),
                        recent_from=jnp.array([8]), compressible=jnp.ones((1, 1), bool),
                        lower=jnp.zeros((1, 1), jnp.int32), upper=jnp.zeros((1, 1), jnp.int32))
    keep = select(jnp.asarray(sc)[None, None], jnp.full((1, 1, 1), 4), ctx, sink=0, kmax=4)
    assert keep.idx[0, 0, 0].tolist() == [1, 3, 5, 6]  # the four best logits, not positions 0-3


def test_hardkv_calibration_file_round_trips_and_rejects_other_models(model, tmp_path):
    from jaxkv.policies.compress.hardkv import HardKV, load_calibration, save_calibration

    cfg = model.config
    temps = np.linspace(0.2, 2.0, cfg.num_layers * cfg.num_kv_heads).reshape(cfg.num_layers, cfg.num_kv_heads)
    path = tmp_path / "hardkv_calibration.json"
    save_calibration(path, model, HardKV(), temps)
    pol = load_calibration(path, model)
    np.testing.assert_allclose(np.array(pol.calibration), temps, rtol=1e-5)
    other = dataclasses.replace(model, model_id="someone-else")
    with pytest.raises(ValueError, match="fitted on model"):
        load_calibration(path, other)
    with pytest.raises(ValueError, match="transform"):
        load_calibration(path, model, HardKV(transform="vanilla"))
    with pytest.raises(ValueError, match="window"):
        load_calibration(path, model, HardKV(window=32))
    # A path given as the field (`--policy-arg calibration=FILE`) loads that file, with the same checks.
    bound = HardKV(calibration=str(path)).bind(model)
    np.testing.assert_allclose(np.array(bound.calibration), temps, rtol=1e-5)
    with pytest.raises(ValueError, match="window"):
        HardKV(calibration=str(path), window=32).bind(model)
    # Beside the model, a file fitted for another window is left alone (temperatures solved online).
    import shutil
    mdir = tmp_path / "m"
    shutil.copytree(model.path, mdir)
    save_calibration(mdir / "hardkv_calibration.json", model, HardKV(), temps)
    here = dataclasses.replace(model, path=str(mdir))
    assert HardKV().bind(here).calibration is not None
    assert HardKV(window=32).bind(here).calibration is None
    assert HardKV(gqa="mean").bind(here).calibration is None  # fitted on GQA-max logits
    with pytest.raises(ValueError, match="gqa"):
        load_calibration(path, model, HardKV(gqa="mean"))
    # A calibrated policy runs through the engine and still keeps within its caps.
    prompt = prompts_for(model, [150], seed=6)[0]
    eng = Engine(model, page_size=8, max_step_tokens=64, kv_policy=dataclasses.replace(pol, budget=80),
                 attn_impl="reference")
    _, (kept,) = run_capturing(eng, [prompt])
    assert max(len(h) for row in kept for h in row) <= 80  # (the forced sink + window 64 fit in 80)


def test_pipelined_decode_under_a_compression_policy(model):
    # Calls chain between compressions (every 40 tokens, calls of 8) and drain before each one: same
    # tokens and compressions as one call at a time.
    prompts = prompts_for(model, [40, 33], seed=9)
    pol = get_policy("hardkv", budget=48, window=8, decode_interval=40)
    sp = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    runs = []
    for pipeline in (False, True):
        eng = Engine(model, page_size=8, max_step_tokens=64, kv_policy=pol, attn_impl="reference",
                     decode_steps=8, pipeline_decode=pipeline)
        ids = [eng.add_request(p, sp) for p in prompts]
        got, overlapped = {i: [] for i in ids}, 0
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
            overlapped += eng._inflight is not None
        assert eng.allocator.num_free == eng.allocator.num_pages
        runs.append(([got[i] for i in ids], eng.compressor.num_compressions, overlapped))
    (serial, n_serial, none), (piped, n_piped, some) = runs
    assert piped == serial and n_piped == n_serial >= 2  # at prefill end, then every 40 tokens
    assert none == 0 and some >= 5


def test_merge_keeps_the_observed_sum_of_exponentials_and_output():
    """One observation query: folding every evicted token into a kept one with bias log(total / own mass)
    leaves that query's softmax denominator and attention output exactly as with the full cache."""
    from jaxkv.policies.apply import merge_evicted

    rng = np.random.default_rng(0)
    n, d, kk = 24, 8, 6
    k = rng.standard_normal((n, d)).astype(np.float32)
    v = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal(d).astype(np.float32)
    s = k @ q
    keep = np.sort(np.argsort(-s)[:kk])  # the heaviest tokens: a merged token never outweighs its target
    mass = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    v_new, bias_add, merged = merge_evicted(
        jnp.asarray(k)[None, None], jnp.asarray(v)[None, None], jnp.ones((1, 1, n), bool),
        jnp.asarray(mass)[None, None], jnp.asarray(keep, jnp.int32)[None, None], jnp.asarray([[kk]]),
        jnp.asarray([[True]]), min_sim=-1.0)
    v_new, bias_add, merged = np.asarray(v_new[0, 0]), np.asarray(bias_add[0, 0]), np.asarray(merged[0, 0])
    assert merged.sum() == n - kk and (bias_add > 0).sum() == (merged > 0).sum()
    w = np.exp(s[keep] + bias_add)
    np.testing.assert_allclose(w.sum(), np.exp(s).sum(), rtol=1e-5)
    full = (np.exp(s) @ v) / np.exp(s).sum()
    np.testing.assert_allclose(w @ v_new / w.sum(), full, atol=1e-5)
    evicted_only = (np.exp(s[keep]) @ v[keep]) / np.exp(s[keep]).sum()
    assert np.abs(evicted_only - full).max() > 1e-3  # plain eviction would not have matched


def test_merge_joins_only_similar_keys_and_caps_the_bias():
    from jaxkv.policies.apply import merge_evicted

    k = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [0.99, 0.14], [-1.0, 0.05]])[None, None]  # 2 ~ 0, 3 ~ nothing
    v = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [5.0, 5.0]])[None, None]
    mass = jnp.asarray([0.1, 0.2, 0.6, 0.1])[None, None]  # the evicted token 2 outweighs its target
    v_new, bias_add, merged = merge_evicted(k, v, jnp.ones((1, 1, 4), bool), mass,
                                            jnp.asarray([[[0, 1]]], jnp.int32), jnp.asarray([[2]]),
                                            jnp.asarray([[True]]), min_sim=0.5)
    assert np.asarray(merged[0, 0]).tolist() == [1, 0]  # token 3 (cosine < 0.5 with both) is just evicted
    np.testing.assert_allclose(np.asarray(bias_add[0, 0]), [np.log(2.0), 0.0], atol=1e-6)  # capped at log 2
    np.testing.assert_allclose(np.asarray(v_new[0, 0, 0]), [0.1 / 0.7, 0.0], atol=1e-6)


def test_merging_policy_through_the_engine_leaves_no_stale_bias(model):
    """A merging request writes biases; the pages it frees and later requests reuse start from zero, so a
    plain request afterwards decodes exactly as on an engine without a bias."""
    prompts = prompts_for(model, [150, 120], seed=9)
    eng = Engine(model, page_size=8, max_step_tokens=64, max_num_seqs=2, attn_impl="reference", kv_merge=True,
                 enable_prefix_caching=False)
    pol = get_policy("snapkv", budget=40, window=16, merge=True, merge_sim=-1.0)
    rid = eng.add_request(prompts[0], GREEDY, kv_policy=pol)
    seen_bias = 0
    while eng.has_unfinished():
        eng.step()
        if rid in eng.tables:
            seen_bias = max(seen_bias, int((np.asarray(eng.runner.pool.bias) > 0).sum()))
    assert eng.compressor.pages_freed > 0 and seen_bias > 0
    assert eng.allocator.num_free == eng.allocator.num_pages
    plain = Engine(model, page_size=8, max_step_tokens=64, max_num_seqs=2, attn_impl="reference",
                   enable_prefix_caching=False)
    outs = []
    for e in (eng, plain):
        r = e.add_request(prompts[1], GREEDY)
        toks = []
        while e.has_unfinished():
            toks += [t for o in e.step() if o.request_id == r for t in o.new_token_ids]
        outs.append(toks)
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="kv_merge"):
        plain.add_request(prompts[1], GREEDY, kv_policy=pol)
    merged = Engine(model, page_size=8, kv_policy=pol, attn_impl="reference")  # on by itself for the policy
    assert merged.kv_merge and merged.runner.pool.bias is not None
    with pytest.raises(ValueError, match="merge_sim"):
        get_policy("snapkv", merge=True, merge_sim=2.0)
