"""SpeContext: the shared read rule, the retrieval head (GQA-max top-B per KV head), its loader, the
selected-attention decode path (full budget == full attention, small budget == masked dense oracle), the
distillation pieces, and the eval method."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.policies import POLICIES, get_policy
from jaxkv.policies.retrieve import Selection, overlap, select
from jaxkv.policies.retrieve import specontext as sc
from jaxkv.policies.retrieve.base import select_sorted
from tests.hf_tiny import sharp_gqa_toy

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A random 3-layer GQA model in HF layout with a random retrieval head (tap 1) beside it."""
    import jaxkv

    out = sharp_gqa_toy(tmp_path_factory.mktemp("toy"), seed=0)
    model = jaxkv.load(out)
    head = sc.init_head(sc.HeadConfig.for_model(model.config, tap_layer=1, model_id=model.model_id),
                        jax.random.PRNGKey(3), scale=0.5)
    sc.save_head(out / sc.HEAD_DIR, head, {"test": True})
    return model, head


# ------------------------------------------------------------------------------------------ select rule


@pytest.mark.parametrize("budget,sink,recent", [(8, 0, 0), (8, 2, 3), (64, 0, 0), (1, 0, 0)])
def test_select_rule(budget, sink, recent):
    rng = np.random.default_rng(budget + sink)
    s, h, n = 3, 4, 40
    scores = rng.random((s, h, n)).astype(np.float32)
    q_pos = np.array([39, 5, 20], np.int32)
    sel = select(jnp.asarray(scores), jnp.asarray(q_pos), budget=budget, sink=sink, recent=recent)
    assert sel.idx.shape == (s, h, budget) and sel.count.shape == (s, h)
    for r in range(s):
        p = q_pos[r]
        for hh in range(h):
            c = int(sel.count[r, hh])
            got = np.asarray(sel.idx[r, hh, :c])
            assert c == min(budget, p + 1)
            assert np.all(np.diff(got) > 0) and got.min() >= 0 and got.max() <= p  # sorted, unique, visible
            forced = {i for i in range(p + 1) if i == p or i < sink or i >= p - recent}
            assert forced <= set(got.tolist())
            rest = [i for i in range(p + 1) if i not in forced]
            best = sorted(rest, key=lambda i: -scores[r, hh, i])[: c - len(forced)]
            assert set(got.tolist()) == forced | set(best)


@pytest.mark.parametrize("kind", ["uniform", "ties", "nan", "signed_zeros", "negative"])
def test_select_radix_equals_sorted_twin(kind):
    """The radix select (no top-k sort) picks exactly what top_k + sort picks, ties to the lower index."""
    rng = np.random.default_rng(len(kind))
    for _ in range(6):
        s, h, n = 3, 2, int(rng.integers(5, 200))
        budget = int(rng.integers(3, n + 8))
        u = rng.random((s, h, n))
        scores = {"uniform": u, "ties": np.floor(3 * u) / 3, "nan": np.where(u < 0.2, np.nan, u),
                  "signed_zeros": np.where(u < 0.5, -0.0, 0.0), "negative": np.log(u)}[kind]
        scores = scores.astype(np.float32)
        q_pos = jnp.asarray(rng.integers(0, n, s), jnp.int32)
        a = select(jnp.asarray(scores), q_pos, budget=budget, sink=1, recent=1)
        b = select_sorted(jnp.asarray(scores), q_pos, budget=budget, sink=1, recent=1)
        np.testing.assert_array_equal(np.asarray(a.count), np.asarray(b.count))
        np.testing.assert_array_equal(np.asarray(a.idx), np.asarray(b.idx))


def test_score_rows_reads_state_rows_in_place(toy):
    """The engine's in-place scoring equals gathering the state rows and scoring them."""
    _, head = toy
    c = head.config
    n, rows_in_state = 48, 4
    pol = sc.SpeContext(budget=8)
    x = jax.random.normal(jax.random.PRNGKey(1), (rows_in_state, n, c.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows_in_state, n))
    state = pol.observe(head, pol.init_state(head, rows_in_state, 64), x, positions)
    rows = jnp.array([2, 0, 3], jnp.int32)
    qpos = jnp.array([[47], [20], [33]], jnp.int32)
    xq = x[rows][jnp.arange(3), qpos[:, 0]][:, None]
    want, _ = pol.scores(head, state[rows, :n], xq, qpos)
    for impl in ("xla", "pallas", "reference"):  # pallas: the retrieval-logits kernel, interpret mode here
        got = sc.SpeContext(budget=8, scores_impl=impl).score_rows(head, state, xq, qpos, rows, n)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="scores_impl"):
        sc.SpeContext(scores_impl="cuda")


def test_overlap_counts_shared_slots():
    prev = Selection(jnp.array([[[0, 2, 5, 9]]], jnp.int32), jnp.array([[3]], jnp.int32))  # 9 is padding
    now = Selection(jnp.array([[[2, 5, 9, 11]]], jnp.int32), jnp.array([[4]], jnp.int32))
    assert int(overlap(prev, now)[0, 0]) == 2


def test_policy_registry_and_validation():
    assert POLICIES["specontext"] is sc.SpeContext
    assert get_policy("specontext", budget=256).budget == 256
    for bad in ({"budget": 0}, {"budget": 4, "sink": 2, "recent": 2}, {"budget": 1.5}, {"sink": -1}):
        with pytest.raises(ValueError, match="specontext"):
            get_policy("specontext", **bad)


def test_successor_spread_lifts_the_tokens_after_a_high_score():
    s = jnp.array([[[0.1, 0.9, 0.0, 0.2, 0.0, 0.05]]])
    np.testing.assert_allclose(sc.successor_spread(s, 0), s)
    np.testing.assert_allclose(sc.successor_spread(s, 2)[0, 0], [0.1, 0.9, 0.9, 0.9, 0.2, 0.2])
    np.testing.assert_allclose(sc.successor_spread(s, 1, 0.5)[0, 0], [0.1, 0.9, 0.45, 0.2, 0.1, 0.05])
    pol = get_policy("specontext", budget=3, spread=1)  # current token (5) + the best two of the spread
    sel = pol.select(s, jnp.array([5]))
    assert sel.idx[0, 0].tolist() == [1, 2, 5]
    for bad in ({"spread": -1}, {"spread": 1.5}, {"spread_weight": 0.0}, {"spread_weight": 1.5}):
        with pytest.raises(ValueError, match="spread"):
            get_policy("specontext", **bad)


# ------------------------------------------------------------------------------------- retrieval head


def test_head_scores_are_gqa_max_of_softmax_and_topb_is_per_kv_head(toy):
    model, head = toy
    c = head.config
    g = c.num_heads // c.num_kv_heads
    n, t = 64, 30
    x = jax.random.normal(jax.random.PRNGKey(0), (2, t, c.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    pol = sc.SpeContext(budget=8)
    state = pol.observe(head, pol.init_state(head, 2, n), x[:, :-1], positions[:, :-1])
    scores, state = pol.scores(head, state, x[:, -1:], positions[:, -1:])
    # Independent numpy oracle: per query head softmax over keys 0..t-1, max over the group.
    q, k = (np.asarray(a, np.float64) for a in sc.head_qk(head, x, positions))
    for r in range(2):
        logits = np.einsum("hd,khd->hk", q[r, -1], np.repeat(k[r], g, axis=1)) / np.sqrt(c.head_dim)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = p.reshape(c.num_kv_heads, g, t).max(axis=1)
        np.testing.assert_allclose(np.asarray(scores[r, :, :t]), want, rtol=1e-4, atol=1e-6)
        assert np.all(np.asarray(scores[r, :, t:]) == 0)  # slots past the current token score nothing
    sel = pol.select(scores, positions[:, -1])
    idx, cnt = np.asarray(sel.idx), np.asarray(sel.count)
    assert np.all(cnt == 8)
    for r in range(2):
        for h in range(c.num_kv_heads):
            assert len(set(idx[r, h].tolist())) == 8 and idx[r, h].max() < t and t - 1 in idx[r, h]
            top = np.argsort(-np.asarray(scores[r, h, : t - 1]), kind="stable")[:7]
            assert set(top.tolist()) | {t - 1} == set(idx[r, h].tolist())
    assert not np.array_equal(idx[:, 0], idx[:, 1])  # KV heads choose differently


def test_loader_round_trip_and_checks(toy, tmp_path):
    model, head = toy
    loaded = sc.load_for_model(model)
    assert loaded.config == head.config
    for k in head.params:
        np.testing.assert_array_equal(np.asarray(loaded.params[k]), np.asarray(head.params[k]))
    other = sc.RetrievalHead(head.params, sc.HeadConfig(**{**head.config.__dict__, "model_id": "other-1"}))
    sc.save_head(tmp_path / "h", other)
    with pytest.raises(ValueError, match="distilled from other-1"):
        sc.load_head(tmp_path / "h", model)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["head_dim"] = 4
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not match"):
        sc.load_head(tmp_path / "h")
    with pytest.raises(ValueError, match="not a retrieval head"):
        sc.load_head(tmp_path)


def test_shipped_head_loads_for_the_default_model():
    import jaxkv

    model = jaxkv.load(ROOT / "jaxkv" / "assets" / "default_model")
    head = sc.load_for_model(model)
    assert head.config.num_kv_heads == model.config.num_kv_heads
    assert sum(p.stat().st_size for p in (model.path / sc.HEAD_DIR).iterdir()) < 4 * 2**20


# ------------------------------------------------------------------------------------------ decode path


def _full_reference(model, ids):
    from jaxkv.models import llama

    return np.asarray(llama.dense_logits(model.params, model.config, jnp.asarray([ids], jnp.int32))[0])


def test_full_budget_decode_equals_full_attention(toy):
    from jaxkv.policies.retrieve import decode

    model, head = toy
    ids = list(np.random.default_rng(0).integers(10, model.config.vocab_size, 50))
    out = decode.generate(model, sc.SpeContext(budget=256), head, ids, 12)
    seq = ids + out["token_ids"]
    ref = _full_reference(model, seq)
    assert out["token_ids"] == [int(ref[len(ids) - 1 + i].argmax()) for i in range(len(out["token_ids"]))]
    np.testing.assert_allclose(out["first_logits"], ref[len(ids) - 1], rtol=1e-4, atol=1e-4)
    # Everything is selected every step: only the new token was not held the step before.
    n = len(ids)
    assert out["overlap"] == pytest.approx([(n + k + 1) / (n + k + 2) for k in range(len(out["overlap"]))])


def test_small_budget_decode_equals_masked_dense_oracle(toy):
    """Each layer from the tap on attends over exactly the selected slots of each KV head."""
    from jaxkv.models import llama
    from jaxkv.models.attention import dense_attention
    from jaxkv.policies.retrieve import decode

    model, head = toy
    cfg, params = model.config, model.params
    rng = np.random.default_rng(1)
    n, size, budget = 40, 64, 6
    ids = jnp.asarray(rng.integers(10, cfg.vocab_size, (1, n + 1)), jnp.int32)
    pol = sc.SpeContext(budget=budget, sink=1, recent=1)
    kc = jnp.zeros((cfg.num_layers, 1, size, cfg.num_kv_heads, cfg.head_dim), jnp.float32)
    vc = jnp.zeros_like(kc)
    hs = pol.init_state(head, 1, size)
    _, kc, vc, hs = decode.prefill(params, cfg, pol, head, ids[:, :n], kc, vc, hs, jnp.array([n]))
    logits, _, _, _, sel = decode.decode_step(params, cfg, pol, head, ids[:, n:], jnp.array([[n]]),
                                              kc, vc, hs)
    assert np.all(np.asarray(sel.count) == budget)

    # Oracle: dense forward of all n+1 tokens where layers >= tap mask, for the last query, every key of
    # KV head h outside sel.idx[0, h].
    allowed = np.zeros((cfg.num_kv_heads, n + 1), bool)
    for h in range(cfg.num_kv_heads):
        allowed[h, np.asarray(sel.idx[0, h])] = True
    g = cfg.num_heads // cfg.num_kv_heads
    pos = jnp.arange(n + 1, dtype=jnp.int32)[None]

    def attend(layer, q, k, v, st):  # `layer` is traced under the layer scan
        full = dense_attention(q, k, v, pos, pos)
        outs = []
        for qh in range(cfg.num_heads):
            h = qh // g
            kk, vv = k[0, allowed[h], h], v[0, allowed[h], h]  # [budget, D]
            w = jax.nn.softmax(q[0, -1, qh] @ kk.T / np.sqrt(cfg.head_dim))
            outs.append(w @ vv)
        return jnp.where(layer < head.config.tap_layer, full, full.at[0, -1].set(jnp.stack(outs))), st

    hidden, _ = llama.forward(params, cfg, ids, pos, attend, None)
    want = llama.lm_head(params, cfg, hidden)[0, -1]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(want), _full_reference(model, list(np.asarray(ids[0])))[-1], atol=1e-3)


def test_selected_attention_pages_match_gather(toy):
    """The selection viewed as one page per (row, KV head) — the host tier's GPU buffer shape — through
    the paged-kernel twin equals a direct softmax over the gathered slots."""
    from jaxkv.policies.retrieve import decode

    model, _ = toy
    cfg = model.config
    rng = np.random.default_rng(2)
    s, n, b = 2, 30, 5
    kc = jnp.asarray(rng.standard_normal((s, n, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((s, n, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((s, cfg.num_heads, cfg.head_dim)), jnp.float32)
    q_pos = jnp.array([29, 12], jnp.int32)
    sel = select(jnp.asarray(rng.random((s, cfg.num_kv_heads, n)), jnp.float32), q_pos, budget=b)
    out, lse = decode.selected_attention(cfg, 1, q, kc, vc, sel, q_pos, implementation="reference")
    g = cfg.num_heads // cfg.num_kv_heads
    for r in range(s):
        for qh in range(cfg.num_heads):
            idx = np.asarray(sel.idx[r, qh // g])
            logit = np.asarray(kc[r, idx, qh // g]) @ np.asarray(q[r, qh]) / np.sqrt(cfg.head_dim)
            w = np.exp(logit - logit.max())
            want = (w / w.sum()) @ np.asarray(vc[r, idx, qh // g])
            np.testing.assert_allclose(np.asarray(out[r, qh]), want, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(float(lse[r, qh]), logit.max() + np.log(w.sum()), rtol=1e-5)


# ------------------------------------------------------------------------------------------ distillation


def test_teacher_attention_matches_dense_forward(toy):
    from jaxkv.models import llama
    from jaxkv.models.attention import dense_attention
    from jaxkv.policies.retrieve.distil import teacher_attention

    model, _ = toy
    cfg, params = model.config, model.params
    t = 48
    tokens = jnp.asarray(np.random.default_rng(4).integers(10, cfg.vocab_size, (1, t)), jnp.int32)
    qidx = jnp.array([3, 20, 47], jnp.int32)
    x_tap, x_q, probs = teacher_attention(params, cfg, tokens, qidx, tap_layer=1, mean=False)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    seen = {}

    def attend(layer, q, k, v, st):
        g = cfg.num_heads // cfg.num_kv_heads
        s = jnp.einsum("qhd,khd->hqk", q[0], jnp.repeat(k[0], g, axis=1)) / np.sqrt(cfg.head_dim)
        seen[layer] = jax.nn.softmax(jnp.where(pos[0][None, :] <= pos[0][:, None], s, -jnp.inf), -1)
        return dense_attention(q, k, v, pos, pos), st

    x = params["embed"][tokens]
    p0 = llama.layer_params(params, 0)
    x, _ = llama.decoder_layer(p0, cfg, 0, x, pos, llama.rope.inv_freq(cfg), attend, None)
    np.testing.assert_allclose(np.asarray(x_tap), np.asarray(x[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(x_q), np.asarray(x[0, qidx]), rtol=1e-5, atol=1e-5)
    x_key, x_q0, _ = teacher_attention(params, cfg, tokens, qidx, tap_layer=0, mean=True, key_layer=1)
    np.testing.assert_allclose(np.asarray(x_key), np.asarray(x[0]), rtol=1e-5, atol=1e-5)  # keys: layer 1
    np.testing.assert_allclose(np.asarray(x_q0), np.asarray(params["embed"][tokens][0, qidx]), rtol=1e-6)
    llama.forward(params, cfg, tokens, pos, attend, None)
    for layer in range(1, cfg.num_layers):
        np.testing.assert_allclose(np.asarray(probs[layer - 1]), np.asarray(seen[layer][:, qidx]),
                                   rtol=1e-4, atol=1e-6)
    _, _, mean = teacher_attention(params, cfg, tokens, qidx, tap_layer=1, mean=True)
    np.testing.assert_allclose(np.asarray(mean), np.asarray(probs.mean(0)), rtol=1e-5, atol=1e-7)


def test_distil_loss_is_minimised_by_the_target(toy):
    """The cross-entropy of a head against its own attention is its entropy and below any other target."""
    from jaxkv.policies.retrieve.distil import distil_loss, head_log_probs

    _, head = toy
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, head.config.hidden_size))
    qidx = jnp.array([[5, 19], [0, 11]], jnp.int32)
    own = jnp.exp(head_log_probs(head, x, qidx))
    np.testing.assert_allclose(np.asarray(own.sum(-1)), 1.0, rtol=1e-5)
    other = jnp.exp(head_log_probs(sc.init_head(head.config, jax.random.PRNGKey(9), 0.5), x, qidx))
    assert float(distil_loss(head, x, qidx, own)) < float(distil_loss(head, x, qidx, other))


def test_sharpened_target_and_top_set_term(toy):
    """`sharpen` renormalises target**power; the top-set term is -log of the head's mass on the teacher's
    top-k keys: 0 when k covers every key, -log p_head(argmax) when k = 1."""
    from jaxkv.policies.retrieve.distil import distil_loss, head_log_probs, sharpen

    t = jnp.array([[0.5, 0.3, 0.2, 0.0]])
    np.testing.assert_allclose(np.asarray(sharpen(t, 2.0)), np.array([[0.25, 0.09, 0.04, 0.0]]) / 0.38,
                               rtol=1e-6)
    assert sharpen(t, 1.0) is t
    _, head = toy
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, head.config.hidden_size))
    qidx = jnp.array([[5, 19], [0, 11]], jnp.int32)
    target = jnp.exp(head_log_probs(sc.init_head(head.config, jax.random.PRNGKey(9), 0.5), x, qidx))
    logp = head_log_probs(head, x, qidx)
    plain = float(distil_loss(head, x, qidx, target))
    every = float(distil_loss(head, x, qidx, target, top_k=20, top_weight=1.0))
    assert every == pytest.approx(plain, rel=1e-5)
    top1 = jnp.take_along_axis(logp, jnp.argmax(target, axis=-1)[..., None], axis=-1)[..., 0]
    want = plain - 0.5 * float(jnp.mean(top1))
    one = float(distil_loss(head, x, qidx, target, top_k=1, top_weight=0.5))
    assert one == pytest.approx(want, rel=1e-5)
    sharp = float(distil_loss(head, x, qidx, target, power=3.0))
    t3 = sharpen(target, 3.0)
    ce = -jnp.mean(jnp.sum(jnp.where(t3 > 0, t3 * logp, 0.0), axis=-1))
    assert sharp == pytest.approx(float(ce), rel=1e-5)
    assert sharp != pytest.approx(plain, rel=1e-3)


# ------------------------------------------------------------------------------------------ eval method


def test_eval_method_specontext(toy, tmp_path):
    from jaxkv.eval.__main__ import main

    model, _ = toy
    out = tmp_path / "r.json"
    assert main(["--task", "mq_niah", "--context", "512", "--num", "1", "--model", str(model.path),
                 "--method", "specontext", "--max-new-tokens", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())  # B = 1024 > 512 tokens: the same tokens as full attention
    s = res["summary"]
    assert s["top1_agree"] == 1.0 and s["kv_bytes_loaded"] > 0
    assert res["policy"]["budget"] == 1024
    from jaxkv.eval.methods import EngineMethod
    from jaxkv.eval.registry import all_methods

    METHODS = all_methods()

    assert METHODS["specontext_256"].budget == 256 and METHODS["specontext_512"].budget == 512
    assert issubclass(METHODS["specontext"], EngineMethod) and issubclass(METHODS["quest"], EngineMethod)


# ------------------------------------------------------------------------------------------ distillation


def test_distil_tool_trains_exports_and_the_head_loads(toy, tmp_path):
    """`python -m tools.distil_retrieval_head` on the toy model (2 steps): it logs every step, plots, and
    exports a head that `load_head` accepts for this model, with the command that made it."""
    from tools import distil_retrieval_head

    model, _ = toy
    out = tmp_path / "head"
    distil_retrieval_head.main([
        "--model", str(model.path), "--context", "512", "--num-seqs", "3", "--queries", "8", "--steps", "2",
        "--batch", "2", "--eval-every", "1", "--ckpt-dir", str(tmp_path / "ck"),
        "--log", str(tmp_path / "l.jsonl"), "--plot", str(tmp_path / "l.png"), "--export", str(out)])
    head = sc.load_head(out, model)
    assert head.config.tap_layer == 1 and (tmp_path / "l.png").is_file()
    assert len((tmp_path / "l.jsonl").read_text().splitlines()) == 2
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["command"].startswith("python -m tools.distil_retrieval_head --model ")


# ------------------------------------------------------------------------------------------ engine


def _engine_run(model, requests, *, after=None, setup=None, **kw):
    """Runs `requests` [(prompt, kv_policy, kv_budget)] through one Engine (fp32, greedy); `after` =
    {step index: [(prompt, policy, budget)]} adds requests once that many steps ran; `setup(engine)` runs
    before the first request. Returns (token lists, engine)."""
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    kw = {"page_size": 4, "max_model_len": 128, "max_num_seqs": 4, "max_step_tokens": 16,
          "enable_prefix_caching": False, **kw}
    eng = Engine(model, **kw)
    if setup is not None:
        setup(eng)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids, got, step = [], {}, 0

    def add(batch):
        for prompt, pol, budget in batch:
            ids.append(eng.add_request(prompt, sp, kv_policy=pol, kv_budget=budget))
            got[ids[-1]] = []

    add(requests)
    while eng.has_unfinished() or (after and step <= max(after)):
        add((after or {}).get(step, []))
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        step += 1
    assert eng.allocator.num_free == eng.allocator.num_pages
    return [got[i] for i in ids], eng


def _prompt(model, n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(10, model.config.vocab_size, n)]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_engine_full_budget_equals_full_attention(toy, decode_steps):
    model, _ = toy
    ids = _prompt(model, 50, 0)
    (full,), _ = _engine_run(model, [(ids, None, None)], decode_steps=decode_steps)
    (got,), eng = _engine_run(model, [(ids, None, None)], kv_policy="specontext", kv_budget=256,
                              decode_steps=decode_steps)
    assert got == full and len(got) == 12
    ref = _full_reference(model, ids + got)
    assert got == [int(ref[len(ids) - 1 + i].argmax()) for i in range(len(got))]
    # Everything is selected: each step's selection holds the previous one plus the new token.
    r = eng.retriever.buffers
    assert r.steps > 0 and r.slots_new == r.steps * model.config.num_kv_heads


@pytest.mark.parametrize("attn_impl", [None, "pallas"])
def test_engine_full_budget_with_local_heads_equals_full_cache(toy, attn_impl):
    """Ring (local) heads keep their sink + window attention under the policy: with the whole context in
    budget, the retrieval decode (deferred K/V writes, own token by the lse) equals the full-cache engine
    with the same head-class map."""
    from jaxkv.cache.head_classes import HeadClass, HeadClassMap

    model, _ = toy
    cfg = model.config
    row = (HeadClass.global_(),) + (HeadClass.local(2, 8),) * (cfg.num_kv_heads - 1)
    classes = HeadClassMap(cfg.num_layers, cfg.num_kv_heads, (row,) * cfg.num_layers)
    ids = _prompt(model, 40, 1)
    kw = dict(head_classes=classes, attn_impl=attn_impl)
    (full,), _ = _engine_run(model, [(ids, None, None)], **kw)
    (got,), _ = _engine_run(model, [(ids, None, None)], kv_policy="specontext", kv_budget=256, **kw)
    assert got == full


def test_engine_small_budget_equals_dense_masked_oracle(toy):
    """Small budget: the engine's tokens equal the library decode over a dense cache (itself checked
    against a dense forward masked to the selected positions above)."""
    from jaxkv.policies.retrieve import decode

    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    for seed in (0, 1):
        ids = _prompt(model, 50, seed)
        want = decode.generate(model, pol, head, ids, 12)["token_ids"]
        (got,), _ = _engine_run(model, [(ids, None, None)], kv_policy=pol)
        assert got == want
        (full,), _ = _engine_run(model, [(ids, None, None)])
        assert got != full  # the budget matters on this toy


def test_key_dtype_auto_follows_the_model_and_bf16_keys_match_library_decode(toy):
    """key_dtype "auto" is the model's dtype; with a bfloat16 key cache the engine (in-place scoring) still
    gives the library decode's tokens (both score the same rounded keys)."""
    import dataclasses

    from jaxkv.policies.retrieve import decode

    model, head = toy
    assert sc.SpeContext().for_model(model).key_dtype == "float32"
    bf16 = dataclasses.replace(model, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params))
    assert sc.SpeContext().for_model(bf16).key_dtype == "bfloat16"
    pol = sc.SpeContext(budget=6, sink=1, recent=1, key_dtype="bfloat16")
    assert pol.init_state(head, 1, 8).dtype == jnp.bfloat16
    ids = _prompt(model, 50, 0)
    want = decode.generate(model, pol, head, ids, 12)["token_ids"]
    (got,), _ = _engine_run(model, [(ids, None, None)], kv_policy=pol)
    assert got == want
    with pytest.raises(ValueError, match="key_dtype"):
        sc.SpeContext(key_dtype="float16")


def test_engine_small_budget_pallas_path_equals_library_decode(toy):
    """The Pallas attention path (interpret mode here): one buffer attention plan per step, K/V written
    once after the last layer, every layer adding the token's own K/V by the lse; same tokens as the
    library decode."""
    from jaxkv.policies.retrieve import decode

    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    ids = _prompt(model, 40, 3)
    want = decode.generate(model, pol, head, ids, 12)["token_ids"]
    (got,), _ = _engine_run(model, [(ids, None, None)], kv_policy=pol, attn_impl="pallas")
    assert got == want


def test_engine_per_request_override_and_mixed_steps(toy):
    """Per-request policies next to a full-cache request; the second prompt's prefill chunks share steps
    with the first request's decode tokens (split off into the retrieval decode); state rows are reused."""
    from jaxkv.policies.retrieve import decode

    model, head = toy
    a, b, c = _prompt(model, 50, 0), _prompt(model, 40, 1), _prompt(model, 30, 2)
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    got, eng = _engine_run(model, [(a, pol, None)], after={3: [(b, None, None), (c, "specontext", 6)]},
                           decode_steps=2)
    assert got[0] == decode.generate(model, pol, head, a, 12)["token_ids"]
    (full_b,), _ = _engine_run(model, [(b, None, None)])
    assert got[1] == full_b
    assert got[2] == decode.generate(model, sc.SpeContext(budget=6), head, c, 12)["token_ids"]
    assert eng.kv_policy is None and eng.prefix is None


def test_state_rows_budget_holds_retrieval_requests_back_and_lets_others_pass(toy):
    """With 2 state rows, never more than 2 SpeContext requests run at once; the plain request queued
    behind them starts at once; every request gives the tokens it gives with a row each; the state and
    the buffer have 2 rows and the decodes compile for at most 2 sequences."""
    model, _ = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    prompts = [_prompt(model, 30 + 3 * i, 10 + i) for i in range(5)]
    reqs = [(p, pol, None) for p in prompts[:4]] + [(prompts[4], None, None)]
    want, _ = _engine_run(model, reqs, decode_steps=2)
    seen = []

    def watch(eng):
        step = eng.step

        def counted():
            out = step()
            sched = eng.scheduler
            seen.append((sum(r.kv_policy is not None for r in sched.running),
                         any(r.kv_policy is None for r in sched.running) and len(sched.waiting) > 0))
            return out

        eng.step = counted

    got, eng = _engine_run(model, reqs, decode_steps=2, retrieval_max_seqs=2, setup=watch)
    assert got == want
    assert max(n for n, _ in seen) == 2
    assert any(passed for _, passed in seen)  # the plain request ran while held ones waited before it
    r = eng.retriever
    assert r.max_rows == 2 and r._state[type(pol)].shape[0] == 2
    assert max(r.decode_seq_buckets(pol)) == 2 and max(eng._seq_buckets) == 4
    with pytest.raises(ValueError, match="retrieval_max_seqs"):
        _engine_run(model, [], retrieval_max_seqs=0)


def test_engine_retrieval_errors(toy, tmp_path):
    import shutil

    from jaxkv.engine.engine import Engine

    model, _ = toy
    with pytest.raises(ValueError, match="tokens per KV head"):
        Engine(model, max_model_len=64, kv_policy="specontext", kv_budget=0.5)
    eng = Engine(model, max_model_len=64, page_size=4)
    with pytest.raises(ValueError, match="tokens per KV head"):
        eng.add_request([11, 12], kv_policy="specontext", kv_budget=10.5)
    with pytest.raises(ValueError, match="kv_budget needs a kv_policy"):
        eng.add_request([11, 12], kv_budget=8)
    with pytest.raises(ValueError, match="exceeds the budget"):
        eng.add_request([11, 12], kv_policy=sc.SpeContext(budget=4, sink=2, recent=2))
    bare = tmp_path / "bare"
    shutil.copytree(model.path, bare, ignore=shutil.ignore_patterns(sc.HEAD_DIR))
    import jaxkv

    with pytest.raises(ValueError, match="not a retrieval head directory"):
        Engine(jaxkv.load(bare), max_model_len=64, kv_policy="specontext")


def test_engine_retrieval_decode_does_not_retrace(toy):
    from jaxkv.engine import retrieval

    model, _ = toy
    ids = _prompt(model, 50, 3)
    _engine_run(model, [(ids, None, None)], kv_policy="specontext", kv_budget=8, decode_steps=4)
    n = retrieval.num_compilations()
    _engine_run(model, [(_prompt(model, 52, 4), None, None)], kv_policy="specontext", kv_budget=8,
                decode_steps=4)
    assert retrieval.num_compilations() == n


def test_engine_reuse_request_under_a_retrieval_policy_decodes_full(toy):
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    model, _ = toy
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seg, pre, suf = _prompt(model, 24, 7), _prompt(model, 5, 8), _prompt(model, 6, 9)
    got = []
    for pol in (None, "specontext"):
        eng = Engine(model, page_size=4, max_model_len=128, max_num_seqs=2, kv_policy=pol,
                     kv_budget=None if pol is None else 4)
        rid = eng.add_reuse_request(pre, [seg], suf, reuse="naive", sampling=sp)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
        got.append(out)
    assert got[0] == got[1] and len(got[0]) == 6


def test_engine_full_budget_sampled_equals_full(toy):
    """Seeded sampling reads the same PRNG stream in the retrieval decode as in the runner's."""
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    model, _ = toy
    ids = _prompt(model, 40, 11)
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=10, seed=5, ignore_eos=True)
    got = []
    for pol in (None, "specontext", "quest"):
        eng = Engine(model, page_size=4, max_model_len=128, max_num_seqs=2, decode_steps=4,
                     enable_prefix_caching=False, kv_policy=pol, kv_budget=None if pol is None else 256)
        eng.add_request(ids, sp)
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.new_token_ids]
        got.append(out)
    assert got[0] == got[1] == got[2] and len(got[0]) == 10


@pytest.mark.parametrize("policy", ["specontext", "quest"])
def test_engine_retrieval_precompile_covers_serving(toy, policy):
    from jaxkv.engine import retrieval, runner
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    model, _ = toy
    eng = Engine(model, page_size=8, max_model_len=32, max_num_seqs=2, max_step_tokens=16, decode_steps=4,
                 kv_policy=policy, kv_budget=8)
    assert eng.precompile(progress=False) > 0
    compiled = runner.num_compilations() + retrieval.num_compilations()
    # The second prompt's chunks share steps with the first's decode tokens (the K = 1 split path).
    for n, sp in [(12, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
                  (10, SamplingParams(temperature=0.7, max_tokens=9, seed=1))]:
        eng.add_request(_prompt(model, n, n), sp)
    while eng.has_unfinished():
        eng.step()
    assert runner.num_compilations() + retrieval.num_compilations() == compiled


def test_buffer_diff_held_count_equals_overlap():
    """The selection buffer's diff: entries it already holds are exactly `overlap(prev, now)`."""
    from jaxkv.policies.retrieve.host_tier import plan_diff

    rng = np.random.default_rng(0)
    s, h, n, b = 3, 2, 50, 8
    q_pos = jnp.array([49, 5, 30], jnp.int32)
    prev = select(jnp.asarray(rng.random((s, h, n)), jnp.float32), q_pos - 1, budget=b)
    now = select(jnp.asarray(rng.random((s, h, n)), jnp.float32), q_pos, budget=b)
    buf_pos = jnp.where(prev.mask(), prev.idx, -1)[..., ::-1]  # any order inside the buffer
    _, need, _ = plan_diff(buf_pos, now.idx, now.count)
    held = np.asarray(now.count) - np.asarray(need).sum(-1)
    np.testing.assert_array_equal(held, np.asarray(overlap(prev, now)))


@pytest.mark.parametrize("host", [False, True, "keyword", "overlap", "lazy"])
def test_engine_buffer_and_host_tier_equal_library_decode(toy, host, monkeypatch):
    """Two SpeContext requests at budget 6 through the persistent selection buffer (diff loads from the
    device pool, or from the pool's host mirror) give the library decode's tokens; with the host tier the
    diff moves fewer bytes than re-fetching the selection. "keyword": the host gathers built with the
    keyword form of compute_on that jax 0.11 has. "overlap": `retrieval_host_overlap=True`, the host rows
    gathered in layer groups and written right before each layer reads them (the default loads every
    layer's rows before the first selected layer). The host-tier cases run `retrieval_host_eager=True` (every
    dispatch loads from the mirror); "lazy" is the default host tier, which with nothing offloaded reads the
    selection in place, makes no mirror and moves nothing."""
    from jaxkv.policies.retrieve import decode
    from jaxkv.policies.retrieve import host_tier as ht

    if host == "keyword":
        monkeypatch.setattr(ht, "_host_gather", ht._on_host(ht._gather_host_rows, 2, form="keyword"))
        jax.clear_caches()  # the decode and mirror programs traced with the other form must not be reused
        host = True
    overlap = host == "overlap"
    lazy = host == "lazy"
    host = bool(host)
    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    a, b = _prompt(model, 50, 0), _prompt(model, 37, 1)
    got, eng = _engine_run(model, [(a, pol, None), (b, pol, None)], decode_steps=4,
                           retrieval_host_tier=host, retrieval_inplace=False,   # the buffer path
                           retrieval_host_overlap=overlap, retrieval_host_eager=host and not lazy)
    assert got == [decode.generate(model, pol, head, p, 12)["token_ids"] for p in (a, b)]
    assert eng.retriever.buffers.overlap == bool(overlap)
    t = eng.retriever.buffers.transfer()
    assert eng.retriever.buffers.resident == (2.0 if host else 1.0)  # the host tier defaults to 2
    if lazy:
        assert eng.retriever.buffers._host is None and t == {} and eng.retriever.buffers.steps > 0
    elif host:
        assert eng.retriever.buffers._host[0].sharding.memory_kind in ("pinned_host", "unpinned_host")
        assert 0 < t["h2d_bytes_needed_per_step"] <= t["h2d_bytes_per_step"] < t["h2d_bytes_refetch_per_step"]
    else:
        assert t == {}


def test_resident_buffer_gives_the_same_tokens_and_moves_fewer_rows(toy):
    """`retrieval_resident=3`: the buffer holds 3x the budget per (sequence, KV head); attention still reads
    exactly the selection (the library decode's tokens), and the host tier loads fewer rows than the W = B
    buffer on the same requests (positions that come back while still held move nothing)."""
    from jaxkv.policies.retrieve import decode

    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    a, b = _prompt(model, 50, 0), _prompt(model, 37, 1)
    want = [decode.generate(model, pol, head, p, 12)["token_ids"] for p in (a, b)]
    needed = {}
    for resident in (1.0, 3.0):
        got, eng = _engine_run(model, [(a, pol, None), (b, pol, None)], decode_steps=4,
                               retrieval_host_tier=True, retrieval_resident=resident,
                               retrieval_host_eager=True)
        assert got == want
        (buf,) = eng.retriever.buffers._buf.values()
        assert buf.shape[3] == {1.0: 8, 3.0: 20}[resident]   # whole pages of 4
        needed[resident] = eng.retriever.buffers.transfer()["h2d_bytes_needed_per_step"]
    assert needed[3.0] < needed[1.0]
    with pytest.raises(ValueError, match="retrieval_resident"):
        _engine_run(model, [(a, pol, None)], retrieval_resident=0.5)


@pytest.mark.parametrize("attn_impl", ["reference", "pallas"])
def test_inplace_selection_reads_give_the_buffer_paths_tokens(toy, attn_impl):
    """`retrieval_inplace=True` (the default without a host tier): attention reads the selected slots in the
    pool (pages of one slot), no K/V copy into a buffer; two requests at budget 6 give the library decode's
    tokens (the Pallas path in interpret mode: one plan per step shared by the selected layers)."""
    from jaxkv.policies.retrieve import decode

    model, head = toy
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    a, b = _prompt(model, 50, 0), _prompt(model, 37, 1)
    got, eng = _engine_run(model, [(a, pol, None), (b, pol, None)], decode_steps=4, retrieval_inplace=True,
                           attn_impl=attn_impl)
    assert got == [decode.generate(model, pol, head, p, 12)["token_ids"] for p in (a, b)]
    (buf,) = eng.retriever.buffers._buf.values()
    r = eng.retriever.buffers
    assert all(k.size == 0 for k in buf.k) and r.steps > 0 and 0 < r.slots_new < r.slots_selected
    assert _inplace_is_the_default_without_a_host_tier(model)
    with pytest.raises(ValueError, match="retrieval_inplace"):
        _engine_run(model, [(a, pol, None)], retrieval_inplace=True, retrieval_host_tier=True)
    with pytest.raises(ValueError, match="retrieval_host_overlap"):
        _engine_run(model, [(a, pol, None)], retrieval_host_overlap=True)  # nothing to overlap without one
    with pytest.raises(ValueError, match="retrieval_host_eager"):
        _engine_run(model, [(a, pol, None)], retrieval_host_eager=True)
    with pytest.raises(ValueError, match="retrieval_resident"):
        _engine_run(model, [(a, pol, None)], retrieval_resident=2)      # in place by default: no buffer K/V


def _inplace_is_the_default_without_a_host_tier(model) -> bool:
    from jaxkv.engine.engine import Engine

    eng = Engine(model, page_size=4, max_model_len=64, max_num_seqs=2)
    host = Engine(model, page_size=4, max_model_len=64, max_num_seqs=2, retrieval_host_tier=True)
    return eng.retriever.buffers.inplace and not host.retriever.buffers.inplace
