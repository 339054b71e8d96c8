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


def _first_decode(model, prompt):
    """(runner, params, pool, d) of the engine's first decode call for `prompt` (its K-step batch)."""
    eng = Engine(model, page_size=4, max_model_len=64, max_num_seqs=2, max_step_tokens=32, decode_steps=3,
                 enable_prefix_caching=False)
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    seen = []
    decode = eng.runner.decode

    def spy(batch):
        _, (params, pool, d), _ = eng.runner._decode_call(batch)
        seen.append((params, jax.tree.map(jnp.copy, pool), d))
        return decode(batch)

    eng.runner.decode = spy
    while not seen:
        eng.step()
    return eng.runner, *seen[0]


def test_decode_hooks_that_attend_as_the_runner_change_nothing(model):
    """A method whose attention from its tap on is the runner's own (paged over the pool before the step,
    the token merged by the lse) gives the hook-free decode's tokens and pool: the tap (before layer 0 here,
    every layer the method's) sees the stream once per step and hands out one item per layer, `observe`
    runs before layer 1 (after layer 0 attended), every layer attends through the method with its item,
    and `untap` gets the items back."""
    from jaxkv.engine.runner import DecodeHooks, _decode_forward, _merge_own, decode_loop
    from pallas_kernels.paged_attention.api import paged_attention

    cfg = model.config
    L, scale = cfg.num_layers, cfg.head_dim ** -0.5
    runner, params, pool, d = _first_decode(model, list(range(4, 24)))
    impl = runner.attn_impl

    def plain(pool, b, live):
        tokens, logprobs, _, pool = _decode_forward(params, pool, b, cfg, True, attn_impl=impl,
                                                    use_plan=False)
        return pool, tokens, logprobs, None

    def hooked(pool, b, live):
        def tap(x, pool, st):
            taps, observed, attended, back = st
            return (taps + 1, observed, attended, back), [jnp.int32(i) for i in range(1, L + 1)]

        def attend(layer, q, k, v, pool, st, item):
            out, lse = paged_attention(q, pool.k, pool.v, pool.pos, b["page_table"][:, layer],
                                       b["prev_lengths"][:, layer], b["q_seq"], b["positions"],
                                       b["sink"][layer], b["window"][layer], scale=scale, implementation=impl)
            taps, observed, attended, back = st
            return _merge_own(out, lse, q, k, v, scale), (taps, observed, attended + item, back), item * 10

        def observe(x, st):
            taps, observed, attended, back = st
            return taps, observed + 1 + attended * 100, attended, back

        def untap(st, items):
            return (*st[:3], st[3] + sum(items))

        hooks = DecodeHooks(state=(jnp.int32(0),) * 4, tap_layer=0, tap=tap, attend=attend, untap=untap,
                            observe=observe, observe_layer=1)
        tokens, logprobs, _, pool, st = _decode_forward(params, pool, b, cfg, True, attn_impl=impl,
                                                        use_plan=False, hooks=hooks)
        return pool, tokens, logprobs, jnp.stack(st)

    copy = lambda p: jax.tree.map(jnp.copy, p)  # noqa: E731
    pool_a, last_a, (tok_a, _, ran_a, _) = decode_loop(d, copy(pool), plain)
    pool_b, last_b, (tok_b, _, ran_b, st) = decode_loop(d, copy(pool), hooked)
    np.testing.assert_array_equal(np.asarray(tok_b), np.asarray(tok_a))
    np.testing.assert_array_equal(np.asarray(ran_b), np.asarray(ran_a))
    np.testing.assert_array_equal(np.asarray(pool_b.pos), np.asarray(pool_a.pos))
    np.testing.assert_allclose(np.asarray(pool_b.k), np.asarray(pool_a.k), rtol=1e-6, atol=1e-6)
    steps = int(np.asarray(ran_a).any(-1).sum())
    assert steps == 3
    assert L >= 2
    for k in range(steps):  # per step: one tap; layer 0 attended (item 1) before observe; items x10 back
        taps, observed, attended, back = (int(x) for x in np.asarray(st[k]))
        assert taps == 1 and observed == 1 + 1 * 100
        assert attended == sum(range(1, L + 1)) and back == 10 * sum(range(1, L + 1))
