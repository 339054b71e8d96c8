"""StreamingLLM (Xiao et al. 2023): attention sinks + the most recent tokens, nothing else."""

from __future__ import annotations

import dataclasses

from jaxkv.policies.base import CompressPolicy, Observation
from jaxkv.policies.registry import register


@register
@dataclasses.dataclass(frozen=True)
class StreamingLLM(CompressPolicy):
    """Keeps `sink` first tokens and the newest ones up to the budget (the score is the position)."""

    name = "streaming_llm"
    sink: int = 4

    def score(self, obs: Observation):
        return obs.k_pos.astype("float32")
