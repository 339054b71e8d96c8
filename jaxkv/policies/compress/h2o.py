"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention, plus an equal share of recent tokens.

jaxkv scores with the observation window's accumulated attention (the last `window` queries, not every
query of the prompt), so one pass serves prefill and decode-time compression alike.
"""

from __future__ import annotations

import dataclasses

from jaxkv.policies.base import CompressPolicy, Observation, window_vote
from jaxkv.policies.registry import register


@register
@dataclasses.dataclass(frozen=True)
class H2O(CompressPolicy):
    name = "h2o"
    window: int = 64
    sink: int = 0
    recent_fraction: float = 0.5  # share of the budget given to the most recent tokens

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.recent_fraction < 1.0:
            raise ValueError(f"h2o: recent_fraction must lie in [0, 1) (got {self.recent_fraction!r})")

    def recent_tokens(self, target: int) -> int:
        return max(1, int(target * self.recent_fraction))

    def score(self, obs: Observation):
        return window_vote(obs, "sum")
