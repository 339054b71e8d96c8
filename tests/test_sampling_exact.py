"""The sort-free sampler against its sorted twin: the same kept set, the filtered softmax's frequencies,
greedy rows exact, streams fixed by (seed, counter) alone, ties kept whole."""

import functools
import itertools

import jax
import numpy as np
import pytest

from jaxkv.sampling import DRAW_CHUNK, kept_mask, kept_mask_sorted, sample

sample_jit = jax.jit(sample)
kept_jit = jax.jit(kept_mask)
kept_sorted_jit = jax.jit(kept_mask_sorted)


def rows(logits, temperature, top_k, top_p, seeds=None, counters=None):
    """Per-row argument arrays for `sample` (scalars broadcast over the rows of `logits`)."""
    s = len(logits)
    seeds = np.arange(s) if seeds is None else seeds
    counters = np.zeros(s) if counters is None else counters
    return (np.asarray(logits, np.float32), np.broadcast_to(np.float32(temperature), (s,)).astype(np.float32),
            np.broadcast_to(np.int32(top_k), (s,)).astype(np.int32),
            np.broadcast_to(np.float32(top_p), (s,)).astype(np.float32),
            np.broadcast_to(seeds, (s,)).astype(np.uint32), np.broadcast_to(counters, (s,)).astype(np.int32))


def filtered_softmax(logits, temperature, top_k, top_p):
    """float64 softmax of one row restricted to the sorted twin's kept set."""
    keep = np.asarray(kept_sorted_jit(*rows(logits[None], temperature, top_k, top_p)[:4]))[0]
    x = np.where(keep, np.asarray(logits, np.float64) / temperature, -np.inf)
    p = np.exp(x - x.max())
    return p / p.sum()


@pytest.mark.parametrize("vocab", [37, 1000, 2 * DRAW_CHUNK + 77])
def test_kept_set_matches_sorted_filter(vocab):
    rng = np.random.default_rng(vocab)
    s = 32
    # Distinct values (no ties), spreads from flat to peaked, temperatures around 1.
    spread = rng.uniform(0.3, 6, (s, 1))
    logits = (rng.standard_normal((s, vocab)) * spread).astype(np.float32)
    assert all(len(np.unique(r)) == vocab for r in logits)
    temperature = rng.uniform(0.3, 2.0, s).astype(np.float32)
    sizes = set()
    for k, p in itertools.product([0, 1, 5, vocab - 1, vocab], [1.0, 0.9, 0.5, 1e-3]):
        args = rows(logits, temperature, k, p)[:4]
        got, want = np.asarray(kept_jit(*args)), np.asarray(kept_sorted_jit(*args))
        np.testing.assert_array_equal(got, want, err_msg=f"top_k={k} top_p={p}")
        sizes |= set(got.sum(-1).tolist())
    # Per-row settings in one batch: each row's kept set follows its own k and p.
    k = rng.choice([0, 1, 5, vocab - 1, vocab], s).astype(np.int32)
    p = rng.choice([1.0, 0.9, 0.5, 1e-3], s).astype(np.float32)
    args = rows(logits, temperature, k, p)[:4]
    np.testing.assert_array_equal(np.asarray(kept_jit(*args)), np.asarray(kept_sorted_jit(*args)))
    assert len(sizes) > 8 and 1 in sizes and vocab in sizes  # the filters really cut at many places


@pytest.mark.parametrize("bits", [1, 3, 5])
def test_kept_set_is_the_same_for_every_search_width(bits):
    # 3 and 5 leave a narrower last pass (32 = 10 * 3 + 2 = 6 * 5 + 2).
    rng = np.random.default_rng(bits)
    s, vocab = 24, 700
    logits = (rng.standard_normal((s, vocab)) * rng.uniform(0.3, 6, (s, 1))).astype(np.float32)
    args = rows(logits, rng.uniform(0.3, 2.0, s), rng.choice([0, 1, 5, vocab - 1], s),
                rng.choice([1.0, 0.9, 0.5, 1e-3], s))[:4]
    got = np.asarray(jax.jit(functools.partial(kept_mask, radix_bits=bits))(*args))
    np.testing.assert_array_equal(got, np.asarray(kept_sorted_jit(*args)))


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    rng = np.random.default_rng(1)
    s, vocab = 64, 1000
    logits = rng.standard_normal((s, vocab)).astype(np.float32) * 4
    logits[::7] *= 300  # large logits: a greedy row must not overflow into a wrong pick
    temperature = np.where(np.arange(s) % 2 == 0, 0.0, 1.5).astype(np.float32)
    k = rng.choice([0, 3, 50], s)
    tokens, logprobs = sample_jit(*rows(logits, temperature, k, rng.choice([1.0, 0.5], s)))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    greedy = temperature == 0
    np.testing.assert_array_equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert (tokens[~greedy] != logits.argmax(-1)[~greedy]).any()  # the hot rows do sample
    x = logits.astype(np.float64)
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(logprobs, x[np.arange(s), tokens] - lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.8), (12, 1.0), (12, 0.6)])
def test_frequencies_match_filtered_softmax(top_k, top_p):
    # Mass spread over three draw chunks and the ragged last one; a thin tail of distinct values elsewhere.
    vocab, n = 3 * DRAW_CHUNK + 40, 20_000
    logits = np.random.default_rng(4).permutation(np.linspace(-6.0, -3.0, vocab)).astype(np.float32)
    hot = [0, 5, DRAW_CHUNK - 1, DRAW_CHUNK, DRAW_CHUNK + 1, 2 * DRAW_CHUNK + 3, 3 * DRAW_CHUNK, vocab - 1]
    logits[hot] = np.log([0.04, 0.2, 0.1, 0.15, 0.05, 0.25, 0.08, 0.13]) + 2.0
    logits[100:110] = np.linspace(-1.0, 0.0, 10)
    want = filtered_softmax(logits, 1.0, top_k, top_p)
    tokens, _ = sample_jit(*rows(np.broadcast_to(logits, (n, vocab)), 1.0, top_k, top_p,
                                 seeds=np.full(n, 11), counters=np.arange(n)))
    freq = np.bincount(np.asarray(tokens), minlength=vocab) / n
    assert len(np.unique(logits)) == vocab
    assert (freq[want == 0] == 0).all()  # nothing outside the kept set
    assert np.abs(freq - want).max() < 0.012  # ~4 sigma at p = 0.25
    seen = want > 0
    chi2 = n * ((freq[seen] - want[seen]) ** 2 / want[seen]).sum()
    dof = seen.sum() - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_stream_fixed_by_seed_and_counter_whatever_the_batch():
    rng = np.random.default_rng(2)
    vocab, n = 500, 24
    logits = rng.standard_normal((n, vocab)).astype(np.float32)
    seeds, counters = rng.integers(0, 2**32, n), rng.integers(0, 1000, n)
    alone, _ = sample_jit(*rows(logits, 1.0, 0, 0.95, seeds, counters))
    # The same rows shuffled among 17 others with other settings, in a batch of another size.
    others = rng.standard_normal((17, vocab)).astype(np.float32) * 3
    perm = rng.permutation(n + 17)
    mixed = np.concatenate([logits, others])[perm]
    t = np.concatenate([np.ones(n), rng.uniform(0, 2, 17)])[perm]
    k = np.concatenate([np.zeros(n), rng.integers(0, 9, 17)])[perm]
    p = np.concatenate([np.full(n, 0.95), rng.uniform(0.1, 1, 17)])[perm]
    sd = np.concatenate([seeds, rng.integers(0, 2**32, 17)])[perm]
    ct = np.concatenate([counters, rng.integers(0, 1000, 17)])[perm]
    together, _ = sample_jit(*rows(mixed, t, k, p, sd, ct))
    where = np.argsort(perm)[:n]
    np.testing.assert_array_equal(np.asarray(together)[where], np.asarray(alone))
    assert len(set(np.asarray(alone).tolist())) > n // 2  # rows really draw from a wide support


def test_top_k_one_is_argmax():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((256, 300)).astype(np.float32)
    tokens, _ = sample_jit(*rows(logits, 50.0, 1, 1.0))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))


def test_ties_are_kept_whole_and_only_kept_tokens_drawn():
    vocab, n = 2 * DRAW_CHUNK + 9, 4096
    row = np.linspace(-3.0, 1.0, vocab).astype(np.float32)
    tied = [7, DRAW_CHUNK + 1, vocab - 1]  # three equal maxima, in three chunks
    row[tied] = 2.0
    logits = np.broadcast_to(row, (n, vocab))
    # top_k = 2 cuts inside the tie: all three are kept (a sort keeps two, by index).
    keep = np.asarray(kept_jit(*rows(logits[:1], 1.0, 2, 1.0)[:4]))[0]
    assert set(np.flatnonzero(keep)) == set(tied)
    tokens, _ = sample_jit(*rows(logits, 1.0, 2, 1.0, seeds=np.full(n, 5), counters=np.arange(n)))
    counts = np.bincount(np.asarray(tokens), minlength=vocab)
    assert set(np.flatnonzero(counts)) == set(tied)
    assert counts[tied].min() > n / 3 - 150  # the tie is drawn uniformly
    # A row of equal values keeps every token, whatever top_p asks.
    flat = np.zeros((1, vocab), np.float32)
    assert np.asarray(kept_jit(*rows(flat, 1.0, 0, 0.01)[:4])).all()


def test_masked_and_underflowing_logits():
    vocab, n = 300, 2048
    row = np.full(vocab, -np.inf, np.float32)
    row[[3, 200]] = [0.0, -0.5]
    row[[10, 20]] = -200.0  # exp underflows to 0 relative to the max: kept with top_p = 1, never drawn
    logits = np.broadcast_to(row, (n, vocab))
    args = rows(logits, 1.0, 0, 1.0, seeds=np.full(n, 3), counters=np.arange(n))
    keep = np.asarray(kept_jit(*args[:4]))[0]
    assert keep[[3, 200, 10, 20]].all()
    tokens = np.asarray(sample_jit(*args)[0])
    assert set(tokens.tolist()) == {3, 200}
    # Every logit -inf: no mass anywhere; the row still returns a token in range.
    dead = np.full((2, vocab), -np.inf, np.float32)
    tokens = np.asarray(sample_jit(*rows(dead, 1.0, 0, 0.9))[0])
    assert ((tokens >= 0) & (tokens < vocab)).all()


def test_keys_order_as_the_floats():
    from jaxkv.sampling import _ordered_keys

    rng = np.random.default_rng(6)
    # No subnormals: XLA may flush them to zero before the keys are taken.
    special = [-np.inf, -3e38, -1.0, -2e-38, -0.0, 0.0, 2e-38, 1.0, 3e38, np.inf]
    normal = rng.standard_normal(500) * 10.0 ** rng.integers(-30, 30, 500)
    x = np.concatenate([special, normal, -normal[:50], normal[:50]]).astype(np.float32)
    k = np.asarray(jax.jit(_ordered_keys)(x)).astype(np.int64)
    order = lambda a: (a[:, None] > a[None, :]).astype(int) - (a[:, None] < a[None, :])
    np.testing.assert_array_equal(order(k), order(x))
