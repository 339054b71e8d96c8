"""Sampling parameters (host, validated) and the jitted per-row sampler (device).

Every row carries its own temperature / top-k / top-p and its own PRNG stream: the key for output
token ``i`` of a request is ``fold_in(key(seed), i)``, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Most alternatives per position a request may ask for; steps that return alternatives compute this many
# (one static width: one extra compiled variant per bucket, never one per requested count).
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # Alternatives per generated token: the `logprobs` most likely tokens with their log-probabilities.
    logprobs: int = 0
    # None: no prompt log-probabilities; k >= 0: each prompt token's log-probability (the first has none)
    # and its k most likely alternatives, computed in the prefill before any KV compression.
    prompt_logprobs: int | None = None
    # False: the engine leaves RequestOutput.text empty and spends no time turning ids into text (a caller
    # that detokenizes on its own side, as the server does); stop strings need the text, so they keep it on.
    detokenize: bool = True

    def __post_init__(self):
        # Accept lists / single strings from callers; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def need(cond, field, msg):
            if not cond:
                raise ValueError(f"SamplingParams.{field}: {msg} (got {getattr(self, field)!r})")

        need(_is_real(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        need(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 disables)")
        need(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
             f"must be an integer in [0, {MAX_LOGPROBS}]")
        need(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        need(isinstance(self.detokenize, bool), "detokenize", "must be a bool")
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
             "must be None or a non-negative integer")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# Bits of the kept-set threshold fixed per pass of the radix search: 2**4 - 1 candidate thresholds a pass,
# 32 / 4 = 8 passes a search (`benchmarks.sampler --radix-bits` compares other widths).
RADIX_BITS = 4
# Tokens per chunk: the search sums each chunk's mass before the chunks' (a float32 sum straight along
# 128K tokens strayed by a few tokens at a top-p cut); the draw picks a chunk, then a token in it.
DRAW_CHUNK = 256


# Jitted, so a program that samples holds it as one call: jit traces the search once per row count and
# vocabulary, not once per step, decode and reuse program that embeds it (1B vocabulary, 8 rows, CPU: 0.085
# s of tracing per program -> 0.01 s, lowering 0.083 -> 0.067 s); XLA inlines the call when it compiles.
@functools.partial(jax.jit, static_argnames=("radix_bits",))
def sample(logits, temperature, top_k, top_p, seeds, counters, *, radix_bits: int = RADIX_BITS):
    """Pick one token per row, without sorting the vocabulary and without data-dependent control flow.

    logits [S, V] float32; temperature, top_p [S] float32; top_k, counters [S] int32; seeds [S] uint32.
    Returns (tokens [S] int32, logprobs [S] float32 of the chosen token under the unmodified softmax).
    ``temperature == 0`` rows are argmax; a row's draw depends only on ``fold_in(key(seed), counter)``.

    The kept set is every token whose scaled logit is at least a per-row threshold (`kept_mask`), found in
    a fixed number of passes over the row, so one program serves greedy and sampled rows alike. The token
    is drawn from the softmax restricted to it by inverse CDF in two levels: one uniform picks a chunk of
    `DRAW_CHUNK` tokens by the cumulative chunk masses, a second picks the token inside it (an exact
    two-stage draw; each uniform's 2**-23 resolution applies to a chunk's mass, not the row's). Its stream
    differs from `sample_sorted`'s (Gumbel noise over the sorted row); support and distribution are the
    same, ties aside. -inf logits are never drawn; +inf and nan logits are not supported.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys, e, tau = _threshold(_scaled(logits, temperature), top_k, top_p, radix_bits)
    w = jnp.where(keys >= tau[:, None, None], e, 0.0)                        # [S, n, C] kept mass

    def uniforms(seed, counter):
        return jax.random.uniform(jax.random.fold_in(jax.random.key(seed), counter), (2,))

    u = jax.vmap(uniforms)(seeds, counters)                                   # [S, 2]
    chunk = _inverse_cdf(jnp.sum(w, axis=-1), u[:, 0])                        # [S]
    row = jnp.take_along_axis(w, chunk[:, None, None], axis=1)[:, 0]         # [S, C]
    inner = _inverse_cdf(row, u[:, 1])
    sampled = chunk * DRAW_CHUNK + inner
    # Only a row without mass (every logit -inf) lands on a zero-mass token; its argmax is as good.
    sampled = jnp.where(jnp.take_along_axis(row, inner[:, None], axis=-1)[:, 0] > 0, sampled, greedy)
    tokens = jnp.where(temperature > 0, sampled, greedy)
    return tokens, _logprob(logits, tokens)


def kept_mask(logits, temperature, top_k, top_p, *, radix_bits: int = RADIX_BITS):
    """The tokens `sample` may draw, [S, V] bool: scaled logit >= tau = max(tau_k, tau_p).

    tau_k is the k-th largest scaled logit (k = top_k, all of V when 0); Z_k the softmax numerator mass at
    or above it; tau_p the largest threshold whose mass at or above reaches top_p * Z_k (top-p on the
    top-k-filtered softmax: the smallest prefix whose inclusive mass reaches top_p; top_p == 1 keeps the
    top k). Each is found by a radix search over order-preserving uint32 keys of the floats, `radix_bits`
    a pass: a pass counts (or sums the mass of) the tokens at or above 2**radix_bits - 1 candidates
    in one fused reduction over [S, V], ceil(32 / radix_bits) passes a search whatever the data.
    Ties: every token equal to tau is kept (a sort keeps some of them by index), so top_k = 5 over a row
    whose 5th and 6th values are equal keeps 6 tokens, and a row of equal values keeps every token.
    Masses are float32 sums in another order than a sorted cumsum's: a row whose cumulative mass at the
    cut is within rounding of top_p * Z_k may keep one token more or less than the sort-based filter.
    """
    keys, _, tau = _threshold(_scaled(logits, temperature), top_k, top_p, radix_bits)
    return (keys >= tau[:, None, None]).reshape(len(keys), -1)[:, :logits.shape[-1]]


def _scaled(logits, temperature):
    # Greedy rows skip the sampled result; dividing them by 1 keeps inf and nan out of their searches.
    t = jnp.where(temperature > 0, jnp.maximum(temperature, 1e-6), 1.0)
    return logits.astype(jnp.float32) / t[:, None]


def _threshold(scaled, top_k, top_p, bits):
    """(keys uint32 [S, n, C], softmax numerators e [S, n, C], tau uint32 [S]) of `kept_mask`: the row in
    n chunks of C = `DRAW_CHUNK`, padded with key 0 (below every float's, never counted) and e 0."""
    s, vocab = scaled.shape
    chunks = -(-vocab // DRAW_CHUNK)
    m = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.exp(scaled - jnp.where(jnp.isfinite(m), m, 0.0))
    pad = ((0, 0), (0, chunks * DRAW_CHUNK - vocab))
    keys = jnp.pad(_ordered_keys(scaled), pad).reshape(s, chunks, DRAW_CHUNK)
    e = jnp.pad(e, pad).reshape(s, chunks, DRAW_CHUNK)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    tau_k = _largest_threshold(keys, None, k, bits)
    z_k = jnp.sum(jnp.where(keys >= tau_k[:, None, None], e, 0.0), axis=(1, 2))
    tau_p = _largest_threshold(keys, e, top_p * z_k, bits)
    tau = jnp.maximum(tau_k, jnp.where(top_p < 1, tau_p, 0))
    return keys, e, tau


def _ordered_keys(x):
    """uint32 keys ordered as the float32 values x (no nan): key(a) >= key(b) iff a >= b; -0 is +0."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_threshold(keys, weights, target, bits):
    """Per row of keys [S, n, C], the largest uint32 t >= 1 with (count, or `weights` sum, of keys >= t)
    >= target (t = 0 when none).

    Radix search from the top bit: a pass fixing the bits [shift, shift + width) tries lo + j * 2**shift for
    j = 1 .. 2**width - 1 and keeps the largest that still reaches the target. A pass is one variadic
    reduction over the chunks with an accumulator per candidate, then a sum of the chunks' [S, J, n]: it
    reads the row once and builds no [S, J, V] array (a broadcast compare did on the CPU). A Python loop:
    a fixed number of passes, unrolled (a device loop of the passes was not measured).
    """
    lo = jnp.zeros(keys.shape[:1], jnp.uint32)
    for shift in range(32 - bits, -bits, -bits):
        width = bits + min(shift, 0)                                          # the last pass may be narrower
        shift = max(shift, 0)
        steps = jnp.arange(1, 1 << width, dtype=jnp.uint32)
        zero = jnp.zeros((), jnp.int32 if weights is None else weights.dtype)
        cand = lo[:, None] + (steps << shift)[None, :]                       # [S, J]
        hits = [keys >= cand[:, j, None, None] for j in range(len(steps))]  # J x [S, n, C]
        terms = [h.astype(zero.dtype) if weights is None else jnp.where(h, weights, zero) for h in hits]
        sums = jax.lax.reduce(terms, [zero] * len(terms), _add_each, (2,))
        reach = jnp.sum(jnp.stack(sums, axis=1), axis=-1)                     # [S, J]
        step = jnp.max(jnp.where(reach >= target[:, None], steps, 0), axis=-1)
        lo = lo + (step << shift)
    return lo


def _add_each(a, b):
    return tuple(x + y for x, y in zip(a, b))


def _inverse_cdf(mass, u):
    """Per row of `mass` [S, N] (>= 0), the first index whose inclusive cumulative mass exceeds u * total,
    never past the last index with mass (u * total can round up to the total)."""
    cum = jnp.cumsum(mass, axis=-1)
    idx = jnp.sum(cum <= (u * cum[:, -1])[:, None], axis=-1, dtype=jnp.int32)
    last = jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[-1], dtype=jnp.int32), 0), axis=-1)
    return jnp.minimum(idx, last)


def _logprob(logits, tokens):
    """log_softmax(logits)[tokens] without an [S, V] log-softmax."""
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))
    return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - m - lse


def sample_sorted(logits, temperature, top_k, top_p, seeds, counters):
    """`sample`'s reference twin: sorts each row, filters the sorted prefix, draws by Gumbel-max.

    Same arguments and return contract as `sample`; O(V log V) a row.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    order, sorted_logits, keep = _sorted_filter(logits, temperature, top_k, top_p)
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, counter, row):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        return jax.random.categorical(key, row)

    picked = jax.vmap(draw)(seeds, counters, filtered)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


def kept_mask_sorted(logits, temperature, top_k, top_p):
    """`kept_mask` of `sample_sorted`, [S, V] bool in vocabulary order."""
    order, _, keep = _sorted_filter(logits, temperature, top_k, top_p)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.zeros(logits.shape, bool).at[rows, order].set(keep)


def _sorted_filter(logits, temperature, top_k, top_p):
    """(order [S, V], scaled logits in that order, keep [S, V] over sorted positions)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    keep = rank < k[:, None]
    # top-p on the top-k-filtered distribution: keep the smallest prefix whose mass reaches top_p; top_p == 1
    # keeps the top k whole (a float32 cumsum can reach 1 before the tail).
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1))
    return order, sorted_logits, keep


def top_logprobs(logprobs, width: int):
    """The `width` most likely tokens of log-probability rows [..., V] (device): (ids int32, logprobs
    float32), each [..., width], sorted by descending log-probability."""
    lps, ids = jax.lax.top_k(logprobs, width)
    return ids.astype(jnp.int32), lps


def top_logprobs_host(logits: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`top_logprobs` of one row of logits [V] on the host (a step that returns its logits anyway)."""
    x = np.asarray(logits, np.float64)
    lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    ids = np.argsort(-lp, kind="stable")[:width]
    return ids.astype(np.int32), lp[ids].astype(np.float32)
