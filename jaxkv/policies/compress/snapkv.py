"""SnapKV (Li et al. 2024): the observation window votes, votes are pooled, the top tokens per head stay.

Defaults follow kvpress's SnapKVPress (window 64, average pooling of kernel 5, no extra sinks) so the two
can be compared at equal budget; the paper's variant is `kernel=7, pooling="max", window=32`.

The score is kvpress's formula (checked against kvpress by `python -m benchmarks.kvpress`, and against a
transcription of it by `tests/test_kvpress_formula.py`): each window query's softmax over every visible key,
averaged over the window queries, the window's own columns dropped (set to 0) *before* pooling, so the
last pre-window tokens are not lifted by the window's (always large) self-attention mass, zero-padded
pooling, GQA mean (avg pooling is linear, so mean-then-pool equals kvpress's pool-then-mean). The window
itself is kept by the shared `select` rule.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import CompressPolicy, Observation, pool1d, window_vote
from jaxkv.policies.registry import register


@register
@dataclasses.dataclass(frozen=True)
class SnapKV(CompressPolicy):
    name = "snapkv"
    window: int = 64
    sink: int = 0
    kernel: int = 5
    pooling: str = "avg"

    def __post_init__(self):
        super().__post_init__()
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"snapkv: pooling must be 'avg' or 'max' (got {self.pooling!r})")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1:
            raise ValueError(f"snapkv: kernel must be a positive integer (got {self.kernel!r})")

    def score(self, obs: Observation):
        qok = obs.q_pos >= 0  # [S, W]
        first = jnp.min(jnp.where(qok, obs.q_pos, jnp.iinfo(jnp.int32).max), axis=-1)  # first window position
        nq = jnp.maximum(jnp.sum(qok, axis=-1), 1).astype(jnp.float32)
        vote = window_vote(obs, "mean") / nq[:, None, None]  # mean over the window queries
        vote = jnp.where((obs.k_pos >= 0) & (obs.k_pos < first[:, None, None]), vote, 0.0)
        return pool1d(vote, self.kernel, self.pooling)
