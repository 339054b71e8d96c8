"""EPIC (Hu et al. 2024, "Efficient Position-Independent Context Caching", arXiv:2410.15332), LegoLink.

Each reused segment was prefilled alone, so its first tokens act as spurious attention sinks. EPIC
recomputes the first `first` tokens of every segment (plus the new text) in every layer and reuses the rest.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.policies.reuse.base import Layout, ReusePolicy, _check_int, register_reuse


@register_reuse
@dataclasses.dataclass(frozen=True)
class Epic(ReusePolicy):
    name = "epic"
    first: int = 16  # tokens recomputed at the start of each segment (the paper's k, tried 2..32)

    def __post_init__(self):
        super().__post_init__()
        _check_int(self, "first")

    def forced(self, lay: Layout) -> np.ndarray:
        return lay.is_new | ((lay.seg_offset >= 0) & (lay.seg_offset < self.first))
