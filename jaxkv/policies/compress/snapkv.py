"""SnapKV (Li et al. 2024): the observation window votes, votes are pooled, the top tokens per head stay.

Defaults follow kvpress's SnapKVPress (window 64, average pooling of kernel 5, no extra sinks) so the two
can be compared at equal budget; the paper's variant is `kernel=7, pooling="max", window=32`.
"""

from __future__ import annotations

import dataclasses

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
        return pool1d(window_vote(obs, "mean"), self.kernel, self.pooling)
