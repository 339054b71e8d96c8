"""Sampling parameters (host, validated) and the jitted per-row sampler (device).

Every row carries its own temperature / top-k / top-p and its own PRNG stream: the key for output
token ``i`` of a request is ``fold_in(key(seed), i)``, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import dataclasses
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


def sample(logits, temperature, top_k, top_p, seeds, counters):
    """Pick one token per row.

    logits [S, V] float32; temperature, top_p [S] float32; top_k, counters [S] int32; seeds [S] uint32.
    Returns (tokens [S] int32, logprobs [S] float32 of the chosen token under the unmodified softmax).
    """
    vocab = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    keep = rank < k[:, None]
    # top-p on the top-k-filtered distribution: keep the smallest prefix whose mass reaches top_p.
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (mass_before < top_p[:, None])
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, counter, row):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        return jax.random.categorical(key, row)

    picked = jax.vmap(draw)(seeds, counters, filtered)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(temperature > 0, sampled, greedy)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


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
