"""`full`: no reuse. The prompt is prefilled as plain text through the same pass (the oracle in-engine)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.policies.reuse.base import Layout, ReusePolicy, register_reuse


@register_reuse
@dataclasses.dataclass(frozen=True)
class Full(ReusePolicy):
    """Recomputes every token in every layer; segments are never looked up or copied."""

    name = "full"
    reuses = False

    def forced(self, lay: Layout) -> np.ndarray:
        return np.ones(lay.num_tokens, bool)
