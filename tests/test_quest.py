"""Quest through the engine: page upper bounds, full budget == full attention, small budget == a dense
oracle that picks pages from a dense cache, per-request override, errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.policies import POLICIES, get_policy
from jaxkv.policies.retrieve.quest import Quest, page_bounds
from tests.hf_tiny import sharp_gqa_toy


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A random 3-layer GQA model with sharp attention (so page choices matter)."""
    import jaxkv

    return jaxkv.load(sharp_gqa_toy(tmp_path_factory.mktemp("quest-toy"), seed=1))


def test_registered_and_validated():
    assert POLICIES["quest"] is Quest
    q = get_policy("quest", budget=64)
    assert q.layer_wise and q.dense_layers == 2 and q.num_pages(16) == 4 and q.num_pages(128) == 1
    for bad in ({"dense_layers": -1}, {"budget": 0}, {"dense_layers": 1.5}):
        with pytest.raises(ValueError):
            get_policy("quest", **bad)


def test_page_bound_is_an_upper_bound_and_gqa_max():
    rng = np.random.default_rng(0)
    s, hkv, g, p, ps, d = 2, 2, 3, 5, 4, 8
    k = rng.standard_normal((s, hkv, p, ps, d)).astype(np.float32)
    valid = rng.random((s, hkv, p, ps)) < 0.8
    valid[..., 0] = True
    q = rng.standard_normal((s, hkv * g, d)).astype(np.float32)
    kmin, kmax = page_bounds(jnp.asarray(k), jnp.asarray(valid))
    ub = np.asarray(Quest().page_scores(jnp.asarray(q), kmin, kmax))
    for a in range(s):
        for h in range(hkv):
            for j in range(p):
                kk = k[a, h, j][valid[a, h, j]]
                lo, hi = kk.min(0), kk.max(0)
                want = max(np.maximum(q[a, h * g + i] * lo, q[a, h * g + i] * hi).sum() for i in range(g))
                assert ub[a, h, j] == pytest.approx(want, rel=1e-5, abs=1e-5)
                assert ub[a, h, j] >= (kk @ q[a, h * g:(h + 1) * g].T).max() - 1e-5


def _quest_oracle(model, ids, n_new, *, budget, page_size, dense_layers):
    """Greedy decode over a dense per-layer cache; layers >= dense_layers pick, per KV head, the top
    budget // page_size pages of consecutive positions by the min/max bound (GQA max; the current page
    forced; ties to the lower page) and attend over those positions only. Numpy, one query per step."""
    from jaxkv.models import llama
    from jaxkv.models.attention import dense_attention

    cfg, params = model.config, model.params
    g = cfg.num_heads // cfg.num_kv_heads
    cache = {}

    def prefill_attend(layer, q, k, v, st):
        cache[layer] = (np.asarray(k[0]), np.asarray(v[0]))
        pos = jnp.arange(q.shape[1], dtype=jnp.int32)[None]
        return dense_attention(q, k, v, pos, pos), st

    tokens = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    hidden, _ = llama.forward(params, cfg, tokens, pos, prefill_attend, None)
    tok = int(np.asarray(llama.lm_head(params, cfg, hidden[0, -1])).argmax())
    out = [tok]
    while len(out) < n_new:
        p = len(ids) + len(out) - 1

        def attend(layer, q, k, v, st, p=p):
            kc = np.concatenate([cache[layer][0], np.asarray(k[0])])  # [p+1, Hkv, D]
            vc = np.concatenate([cache[layer][1], np.asarray(v[0])])
            cache[layer] = (kc, vc)
            qq = np.asarray(q[0, 0])  # [Hq, D]
            res = np.zeros_like(qq)
            npages = -(-(p + 1) // page_size)
            for qh in range(cfg.num_heads):
                h = qh // g
                allowed = np.ones(p + 1, bool)
                if layer >= dense_layers:
                    ub = np.full(npages, -np.inf)
                    for j in range(npages):
                        kk = kc[j * page_size:(j + 1) * page_size, h]
                        lo, hi = kk.min(0), kk.max(0)
                        ub[j] = max(np.maximum(qq[i] * lo, qq[i] * hi).sum() for i in range(h * g, h * g + g))
                    ub[npages - 1] = np.inf
                    top = np.argsort(-ub, kind="stable")[:min(budget // page_size, npages)]
                    allowed[:] = False
                    for j in top:
                        allowed[j * page_size:(j + 1) * page_size] = True
                    allowed = allowed[:p + 1]
                logit = kc[allowed, h] @ qq[qh] / np.sqrt(cfg.head_dim)
                w = np.exp(logit - logit.max())
                res[qh] = (w / w.sum()) @ vc[allowed, h]
            return jnp.asarray(res)[None, None], st

        tok = jnp.asarray([[out[-1]]], jnp.int32)
        hidden, _ = llama.forward(params, cfg, tok, jnp.asarray([[p]]), attend, None)
        out.append(int(np.asarray(llama.lm_head(params, cfg, hidden[0, -1])).argmax()))
    return out


def _run(model, requests, **kw):
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    kw = {"page_size": 4, "max_model_len": 128, "max_num_seqs": 4, "max_step_tokens": 16,
          "enable_prefix_caching": False, **kw}
    eng = Engine(model, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [eng.add_request(p, sp, kv_policy=pol, kv_budget=b) for p, pol, b in requests]
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    return [got[i] for i in ids]


def _prompt(model, n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(10, model.config.vocab_size, n)]


def test_full_budget_equals_full_attention(toy):
    ids = _prompt(toy, 45, 0)
    (full,) = _run(toy, [(ids, None, None)])
    assert _run(toy, [(ids, None, None)], kv_policy="quest", kv_budget=256) == [full]
    assert _run(toy, [(ids, Quest(budget=128, dense_layers=0), None)], decode_steps=1) == [full]


@pytest.mark.parametrize("dense_layers", [0, 1])
def test_small_budget_equals_dense_page_oracle(toy, dense_layers):
    pol = Quest(budget=12, dense_layers=dense_layers)
    for seed in (1, 2):
        ids = _prompt(toy, 45, seed)
        (got,) = _run(toy, [(ids, pol, None)])
        want = _quest_oracle(toy, ids, 10, budget=12, page_size=4, dense_layers=dense_layers)
        assert got == want
    (full,) = _run(toy, [(ids, None, None)])
    assert got != full


def test_per_request_override(toy):
    a, b = _prompt(toy, 45, 1), _prompt(toy, 30, 3)
    got = _run(toy, [(a, "quest", 12), (b, None, None)], decode_steps=3)
    assert got[0] == _run(toy, [(a, Quest(budget=12), None)])[0]
    assert got[1] == _run(toy, [(b, None, None)])[0]
    with pytest.raises(ValueError, match="tokens per KV head"):
        _run(toy, [(a, "quest", 0.25)])


def test_maintained_page_bounds_equal_the_pool(toy):
    """The engine's per-page min/max (updated at every write, reset at a page's first slot) equals the
    bounds recomputed from the pool, also on pages a finished full-cache request used before."""
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    eng = Engine(toy, page_size=4, max_model_len=128, max_num_seqs=4, max_step_tokens=16,
                 enable_prefix_caching=False, decode_steps=3)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request(_prompt(toy, 40, 5), sp)
    while eng.has_unfinished():
        eng.step()
    rid = eng.add_request(_prompt(toy, 37, 6), dataclasses.replace(sp, max_tokens=20), kv_policy="quest",
                          kv_budget=8)
    for _ in range(8):
        eng.step()
    assert rid in eng.tables
    ps = eng.page_size
    lists, lengths = eng.tables.page_lists(rid), eng.tables.lengths(rid)
    kmin, kmax = (np.asarray(a) for a in eng.retriever._page_states[Quest.page_state])
    pool_k = np.asarray(eng.runner.pool.k)
    for layer, row in enumerate(lists):
        for h, pages in enumerate(row):
            for j, page in enumerate(pages):
                n = min(ps, int(lengths[layer, h]) - j * ps)
                np.testing.assert_array_equal(kmin[page], pool_k[page, :n].min(0))
                np.testing.assert_array_equal(kmax[page], pool_k[page, :n].max(0))


def test_eval_method_quest_runs_through_the_engine(toy, tmp_path):
    from jaxkv.eval.__main__ import main
    from jaxkv.eval.methods import EngineMethod
    from jaxkv.eval.registry import all_methods

    METHODS = all_methods()

    out = tmp_path / "r.json"
    assert main(["--task", "mq_niah", "--context", "512", "--num", "1", "--model", str(toy.path),
                 "--method", "quest", "--budget", "1024", "--max-new-tokens", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())  # B = 1024 > 512 tokens: the same tokens as full attention
    assert res["summary"]["top1_agree"] == 1.0 and res["policy"]["budget"] == 1024
    assert issubclass(METHODS["quest"], EngineMethod)


@pytest.mark.parametrize("policy", ["quest", "specontext"])
def test_local_heads_keep_their_ring_under_a_retrieval_policy(toy, tmp_path, policy):
    """With head classes that make some heads local (sink 2 + window 8, rings that wrap), a retrieval
    policy at full budget gives the full-cache engine's tokens under the same classes: ring heads keep
    their sink + window attention (their storage index is not their position)."""
    import shutil

    import jaxkv
    from jaxkv.cache.head_classes import HeadClass, HeadClassMap
    from jaxkv.policies.retrieve import specontext as sc

    model = toy
    if policy == "specontext":  # give this toy a random retrieval head
        shutil.copytree(toy.path, tmp_path / "m")
        model = jaxkv.load(tmp_path / "m")
        head = sc.init_head(sc.HeadConfig.for_model(model.config, tap_layer=1, model_id=model.model_id),
                            jax.random.PRNGKey(1), scale=0.5)
        sc.save_head(tmp_path / "m" / sc.HEAD_DIR, head)
    cfg = model.config
    loc, glo = HeadClass.local(2, 8), HeadClass.global_()
    hc = HeadClassMap(cfg.num_layers, cfg.num_kv_heads,
                      tuple((glo, loc) if layer % 2 == 0 else (loc, glo) for layer in range(cfg.num_layers)))
    ids = _prompt(model, 45, 4)
    (full,) = _run(model, [(ids, None, None)], head_classes=hc)
    pol = Quest(budget=256, dense_layers=0) if policy == "quest" else sc.SpeContext(budget=256)
    assert _run(model, [(ids, pol, None)], head_classes=hc) == [full]
