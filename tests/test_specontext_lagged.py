"""The lagged SpeContext head: keys from a deeper stream than the step selects from, the query reading the
previous token's key stream. Checked: its state update, that the serving score equals the distillation
loss's attention (one definition, trained and served), the loader, and the engine against the library
decode (chunked prefill, so the newest-token stream crosses chunks)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.policies.retrieve import specontext as sc
from tests.hf_tiny import sharp_gqa_toy
from tests.test_specontext import _engine_run, _full_reference, _prompt


@pytest.fixture(scope="module")
def lagged(tmp_path_factory):
    """The 3-layer toy with a lagged head beside it: selects after layer 1, keys after layer 2."""
    import jaxkv

    out = sharp_gqa_toy(tmp_path_factory.mktemp("lagged"), seed=0)
    model = jaxkv.load(out)
    cfg = sc.HeadConfig.for_model(model.config, tap_layer=1, key_layer=2, model_id=model.model_id)
    head = sc.init_head(cfg, jax.random.PRNGKey(5), scale=0.5)
    sc.save_head(out / sc.HEAD_DIR, head, {"test": True})
    return model, head


def test_config_shapes_and_validation(lagged):
    model, head = lagged
    c = head.config
    assert c.lagged and c.keys_layer == 2 and c.tap_layer == 1
    h = model.config.hidden_size
    assert head.params["wq"].shape == (2 * h, c.num_heads * c.head_dim)
    assert head.params["norm_k"].shape == (h,)
    assert not sc.HeadConfig.for_model(model.config, tap_layer=1, key_layer=1).lagged  # same stream
    with pytest.raises(ValueError, match="key_layer"):
        sc.HeadConfig.for_model(model.config, tap_layer=2, key_layer=1)
    with pytest.raises(ValueError, match="key_layer"):
        sc.HeadConfig.for_model(model.config, tap_layer=1, key_layer=model.config.num_layers)
    with pytest.raises(ValueError, match="two streams"):
        sc.head_qk(head, jnp.zeros((1, 4, h)), jnp.zeros((1, 4), jnp.int32))


def test_observe_writes_keys_and_each_rows_newest_stream(lagged):
    _, head = lagged
    c = head.config
    pol = sc.SpeContext(budget=4)
    rng = np.random.default_rng(0)
    # Ragged tokens of rows 2 and 0 in shuffled order, plus padding (row -1) and a position past the state.
    pos = np.array([5, 3, 9, 4, 0, 7, 6, 2], np.int32)
    rows = np.array([2, 2, 2, 0, -1, 0, 2, 0], np.int32)
    pos[4] = 1
    x = jnp.asarray(rng.normal(size=(len(pos), c.hidden_size)), jnp.float32)
    state = pol.init_state(head, 3, 16)
    keys, last = pol.observe_tokens(head, state, x, jnp.asarray(pos), jnp.asarray(rows))
    k = np.asarray(sc.head_keys(head, x[None], jnp.asarray(pos)[None])[0])
    for i, (p, r) in enumerate(zip(pos, rows, strict=True)):
        if r >= 0:
            np.testing.assert_allclose(np.asarray(keys[r, p]), k[i], rtol=1e-6)
    assert not np.any(np.asarray(keys[1]))  # row 1 got nothing; the padding token wrote nowhere
    np.testing.assert_allclose(np.asarray(last[2]), np.asarray(x[2]))  # row 2's newest: position 9
    np.testing.assert_allclose(np.asarray(last[0]), np.asarray(x[5]))  # row 0's newest: position 7
    assert not np.any(np.asarray(last[1]))


def test_served_score_is_the_distilled_attention(lagged):
    """The policy's decode score (query: step stream + previous token's key stream from the state; the
    step's own key not scored) equals the GQA-max of the distillation's head attention at the same position
    (teacher forcing), so what is trained is what is served."""
    from jaxkv.policies.retrieve.distil import head_log_probs, teacher_attention

    model, head = lagged
    cfg = model.config
    n = 40
    toks = jnp.asarray(np.random.default_rng(2).integers(10, cfg.vocab_size, (1, n)), jnp.int32)
    qidx = jnp.array([n - 1], jnp.int32)
    x_key, xq, _ = teacher_attention(model.params, cfg, toks, qidx, tap_layer=1, mean=True, key_layer=2)
    logp = head_log_probs(head, x_key[None], qidx[None], xq[None])  # [1, Hq, 1, T]
    g = cfg.num_heads // cfg.num_kv_heads
    want = np.asarray(jnp.max(jnp.exp(logp).reshape(1, cfg.num_kv_heads, g, n), axis=2))
    assert np.all(want[..., n - 1] == 0)  # the own key is not scored

    pol = sc.SpeContext(budget=8)
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    state = pol.observe(head, pol.init_state(head, 1, 64), x_key[None, : n - 1], positions[:, : n - 1])
    got, _ = pol.scores(head, state, xq[None], qidx[None])
    np.testing.assert_allclose(np.asarray(got)[..., :n], want, rtol=1e-4, atol=1e-6)
    rows = jnp.array([0], jnp.int32)
    for impl in ("xla", "pallas", "reference"):  # pallas: the retrieval-logits kernel, interpret mode here
        pol_i = sc.SpeContext(budget=8, scores_impl=impl)
        in_place = pol_i.score_rows(head, state, xq[None], qidx[None], rows, 64)
        np.testing.assert_allclose(np.asarray(in_place)[..., :n], want, rtol=1e-4, atol=1e-6)
    # The previous token's stream matters: another one changes the scores.
    other = (state[0], state[1] + 1.0)
    assert not np.allclose(np.asarray(pol.scores(head, other, xq[None], qidx[None])[0])[..., :n], want)


def test_lagged_loader_round_trip(lagged, tmp_path):
    model, head = lagged
    loaded = sc.load_for_model(model)
    assert loaded.config == head.config and set(loaded.params) == {"norm", "norm_k", "wq", "wk"}
    sc.save_head(tmp_path / "h", head)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["key_layer"] = None  # the weights are a lagged head's: refused
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not match"):
        sc.load_head(tmp_path / "h")


def test_library_decode_full_budget_is_full_attention(lagged):
    from jaxkv.policies.retrieve import decode

    model, head = lagged
    ids = _prompt(model, 50, 0)
    out = decode.generate(model, sc.SpeContext(budget=256), head, ids, 10)
    ref = _full_reference(model, ids + out["token_ids"])
    assert out["token_ids"] == [int(ref[len(ids) - 1 + i].argmax()) for i in range(10)]


@pytest.mark.parametrize("attn_impl", [None, "pallas"])
def test_engine_small_budget_equals_library_decode(lagged, attn_impl):
    """Chunked prefill (16 tokens per step) writes keys and the newest stream at layer 2; each decode step
    selects at layer 1 from the previous step's stream; same tokens as the library decode, and the budget
    changes them."""
    from jaxkv.policies.retrieve import decode

    model, head = lagged
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    for seed in (0, 1):
        ids = _prompt(model, 50, seed)
        want = decode.generate(model, pol, head, ids, 12)["token_ids"]
        (got,), _ = _engine_run(model, [(ids, None, None)], kv_policy=pol, attn_impl=attn_impl)
        assert got == want
        (full,), _ = _engine_run(model, [(ids, None, None)], attn_impl=attn_impl)
        assert got != full


def test_distil_loss_drops_the_own_key_and_the_tool_trains_a_lagged_head(lagged, tmp_path):
    """The teacher's mass on the query's own key (which a lagged head never scores) is dropped, so the
    loss is finite; the distillation tool trains and exports a lagged head that loads for this model."""
    from jaxkv.policies.retrieve.distil import distil_loss, teacher_attention
    from tools import distil_retrieval_head

    model, head = lagged
    cfg = model.config
    toks = jnp.asarray(np.random.default_rng(3).integers(10, cfg.vocab_size, (1, 32)), jnp.int32)
    qidx = jnp.array([10, 31], jnp.int32)
    x_key, xq, target = teacher_attention(model.params, cfg, toks, qidx, tap_layer=1, mean=True, key_layer=2)
    assert np.all(np.asarray(target[:, 0, 10]) > 0)  # the teacher does attend the own token
    loss = distil_loss(head, x_key[None], qidx[None], target[None], xq=xq[None], power=2.0)
    assert np.isfinite(float(loss))

    out = tmp_path / "head"
    distil_retrieval_head.main([
        "--model", str(model.path), "--tap-layer", "1", "--key-layer", "2", "--context", "512",
        "--num-seqs", "3", "--queries", "8", "--steps", "2", "--batch", "2", "--eval-every", "1",
        "--ckpt-dir", str(tmp_path / "ck"), "--log", str(tmp_path / "l.jsonl"), "--plot", "",
        "--export", str(out)])
    got = sc.load_head(out, model)
    assert got.config.lagged and got.config.keys_layer == 2
    assert all(np.isfinite(json.loads(r)["loss"]) for r in (tmp_path / "l.jsonl").read_text().splitlines())


@pytest.mark.parametrize("host", [False, True])
def test_engine_two_rows_multi_step_decode_keep_their_own_previous_stream(lagged, host):
    """Two requests decoding together, 4 steps per dispatch (in place, or through the host tier's buffer):
    each row's query reads its own previous-token stream, so both give the library decode's tokens."""
    from jaxkv.policies.retrieve import decode

    model, head = lagged
    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    a, b = _prompt(model, 50, 0), _prompt(model, 37, 1)
    got, _ = _engine_run(model, [(a, pol, None), (b, pol, None)], decode_steps=4, retrieval_host_tier=host)
    assert got == [decode.generate(model, pol, head, p, 12)["token_ids"] for p in (a, b)]
