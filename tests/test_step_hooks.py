"""A method's additions to the ragged step (`runner.StepHooks`, what the retrieval tap uses) run inside the
runner's own forward: they change no token and no stored position (K/V up to rounding), `on_write` sees
every layer's write, and the tap reads the residual stream before its layer (that of a dense forward over
the same prompt)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.engine.engine import Engine
from jaxkv.engine.runner import StepHooks, _forward_sample
from jaxkv.models import llama, rope
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-step-hooks")))


def _first_step(model, prompt):
    eng = Engine(model, page_size=4, max_model_len=64, max_num_seqs=2, max_step_tokens=32,
                 enable_prefix_caching=False)
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    chunks = eng.scheduler.schedule(eng.decode_steps, room=eng._room)
    _, (params, pool, arrays), _ = eng.runner._step_call(eng._build_batch(chunks))
    return eng.runner, params, pool, jax.device_put(arrays)


def test_hooks_change_nothing_and_see_every_write_and_the_stream_before_the_tap(model):
    cfg = model.config
    prompt = list(range(3, 23))
    runner, params, pool, b = _first_step(model, prompt)
    run = lambda pool, hooks=None: _forward_sample(  # noqa: E731
        params, pool, b, cfg, runner.attn_impl, runner.use_plan, True, hooks=hooks)
    copy = lambda pool: jax.tree.map(jnp.copy, pool)  # noqa: E731
    tokens, _, _, plain_pool = run(copy(pool))
    tap_layer, t = 1, b["tokens"].shape[0]

    def on_write(layer, k, slots, pool, state):
        writes, k_sum, x = state  # k of the prompt's tokens only (the rest of the bucket is padding)
        return writes + 1, k_sum + jnp.sum(jnp.where(slots[:, :, None] >= 0, k, 0)), x

    def tap(x, state):
        return state[0], state[1], x

    hooks = StepHooks(state=(jnp.int32(0), jnp.float32(0), jnp.zeros((t, cfg.hidden_size), jnp.float32)),
                      on_write=on_write, tap=tap, tap_layer=tap_layer)
    tokens_h, _, _, hooked_pool, (writes, k_sum, x_tap) = run(copy(pool), hooks)
    np.testing.assert_array_equal(np.asarray(tokens_h), np.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(hooked_pool.pos), np.asarray(plain_pool.pos))
    # a hook reading k changes XLA's fusion of its projection: the same values up to float32 rounding
    np.testing.assert_allclose(np.asarray(hooked_pool.k), np.asarray(plain_pool.k), rtol=1e-5, atol=1e-5)
    assert int(writes) == cfg.num_layers
    assert float(k_sum) != 0.0 and np.isfinite(float(k_sum))
    # the stream before layer `tap_layer`, from a dense forward of the prompt alone
    ids = jnp.asarray(prompt)[None]
    pos = jnp.arange(len(prompt))[None]
    x, _ = llama.run_layers(params["layers"], cfg, params["embed"][ids], pos, rope.inv_freq(cfg),
                            llama.dense_attend(cfg), pos, stop=tap_layer)
    want = np.asarray(x[0], np.float32)
    got = np.asarray(x_tap)[:len(prompt)]
    assert got.shape == want.shape
    # paged and dense attention differ by rounding; a stream one layer off differs by its whole update
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    one_more, _ = llama.run_layers(params["layers"], cfg, x, pos, rope.inv_freq(cfg), llama.dense_attend(cfg),
                                   pos, start=tap_layer, stop=tap_layer + 1)
    assert not np.allclose(got, np.asarray(one_more[0], np.float32), rtol=1e-2, atol=1e-2)


def test_a_tap_past_the_last_layer_never_runs(model):
    cfg = model.config
    runner, params, pool, b = _first_step(model, list(range(5, 17)))
    hooks = StepHooks(state=jnp.int32(0), tap=lambda x, s: s + 1, tap_layer=cfg.num_layers)
    *_, taps = _forward_sample(params, pool, b, cfg, runner.attn_impl, runner.use_plan, True, hooks=hooks)
    assert int(taps) == 0
