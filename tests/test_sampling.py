"""The device sampler: filters restrict the support exactly, seeds fix the stream, greedy is argmax."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.sampling import sample

sample_jit = jax.jit(sample)


def run(logits, temperature, top_k, top_p, n=256):
    S = n
    logits = np.broadcast_to(np.asarray(logits, np.float32), (S, len(logits)))
    tokens, logprobs = sample_jit(logits, np.full(S, temperature, np.float32), np.full(S, top_k, np.int32),
                                  np.full(S, top_p, np.float32), np.arange(S, dtype=np.uint32),
                                  np.zeros(S, np.int32))
    return np.asarray(tokens), np.asarray(logprobs)


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    logits = np.array([0.1, 2.0, -1.0, 1.9], np.float32)
    tokens, logprobs = run(logits, 0.0, 0, 1.0, n=4)
    assert (tokens == 1).all()
    expected = logits[1] - np.log(np.exp(logits).sum())
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5)


def test_top_k_restricts_support():
    tokens, _ = run([3.0, 0.0, 2.9, 2.8, 0.1], 5.0, 2, 1.0)
    assert set(tokens.tolist()) == {0, 2}  # hot temperature: both survivors appear, nothing else


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    tokens, _ = run(np.log(probs), 1.0, 0, 0.75)
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = run(np.log(probs), 1.0, 0, 0.4)
    assert set(tokens.tolist()) == {0}


def test_unfiltered_sampling_matches_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    tokens, _ = run(np.log(probs), 1.0, 0, 1.0, n=4000)
    freq = np.bincount(tokens, minlength=3) / len(tokens)
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_stream_is_fixed_by_seed_and_counter():
    logits = np.zeros((20, 50), np.float32)
    args = (np.ones(20, np.float32), np.zeros(20, np.int32), np.ones(20, np.float32))
    same, _ = sample_jit(logits, *args, np.full(20, 7, np.uint32), np.full(20, 3, np.int32))
    assert len(set(np.asarray(same).tolist())) == 1  # same (seed, counter) -> same token
    walk, _ = sample_jit(logits, *args, np.full(20, 7, np.uint32), np.arange(20, dtype=np.int32))
    assert len(set(np.asarray(walk).tolist())) > 5  # the counter advances the stream


def test_programs_that_sample_trace_the_search_once_per_shape(monkeypatch):
    """`sample` is one jitted call inside the programs that embed it: two programs over logits of one shape
    trace its threshold search once, a third shape once more."""
    import jaxkv.sampling as sampling

    traced = []
    real = sampling._threshold

    def counting(*args):
        traced.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(sampling, "_threshold", counting)

    def program(shift):
        return jax.jit(lambda x, t, k, p, s, c: sampling.sample(x + shift, t, k, p, s, c))

    def args(rows, vocab):
        return (jnp.zeros((rows, vocab)), jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.ones(rows),
                jnp.zeros(rows, jnp.uint32), jnp.zeros(rows, jnp.int32))

    program(1.0).trace(*args(3, 41))
    program(2.0).trace(*args(3, 41))
    assert traced == [(3, 41)]
    program(3.0).trace(*args(5, 41))
    assert traced == [(3, 41), (5, 41)]
