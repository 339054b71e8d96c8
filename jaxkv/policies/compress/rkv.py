"""R-KV (Cai et al. 2025, arXiv 2505.24133): redundancy-aware compression for long generation.

score = lam * importance - (1 - lam) * redundancy, per head:
importance = the window's attention (mean over queries and the GQA group, max-pooled, kernel 7);
redundancy_j = softmax over slots of the mean cosine similarity of key j to the other keys.
The mean similarity is linear in the keys, (sum_i k^_i - k^_j) . k^_j / (N - 1), so it costs O(N D) instead
of the O(N^2) similarity matrix; the reference's extra step that zeroes each row's most recent similar key
(cos > 0.5) needs the matrix and is left out. Compresses every `decode_interval` generated tokens
(R-KV's setting: the reasoning trace is the long part) as well as at the end of prefill.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.policies.base import CompressPolicy, Observation, pool1d, window_vote
from jaxkv.policies.registry import register


@register
@dataclasses.dataclass(frozen=True)
class RKV(CompressPolicy):
    name = "rkv"
    window: int = 8
    sink: int = 0
    decode_interval: int = 128
    lam: float = 0.1
    kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"rkv: lam must lie in [0, 1] (got {self.lam!r})")

    def score(self, obs: Observation):
        valid = obs.valid  # [S, H, N]
        vote = window_vote(obs, "mean")
        importance = pool1d(jnp.where(valid, vote, -jnp.inf), self.kernel, "max")
        importance = jnp.where(valid, importance, 0.0)
        k = obs.k.astype(jnp.float32)
        k = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
        k = jnp.where(valid[..., None], k, 0.0)
        n = jnp.maximum(jnp.sum(valid, axis=-1, keepdims=True), 2)  # [S, H, 1]
        total = jnp.sum(k, axis=2, keepdims=True)  # [S, H, 1, D]
        sim = (jnp.sum((total - k) * k, axis=-1)) / (n - 1)  # mean cosine to the other keys
        redundancy = jax.nn.softmax(jnp.where(valid, sim, -jnp.inf), axis=-1)
        redundancy = jnp.where(valid, redundancy, 0.0)
        return self.lam * importance - (1.0 - self.lam) * redundancy
