"""`naive`: reuse every segment's rotated K/V as is; only the new text (prefix, suffix) is computed."""

from __future__ import annotations

import dataclasses

from jaxkv.policies.reuse.base import ReusePolicy, register_reuse


@register_reuse
@dataclasses.dataclass(frozen=True)
class Naive(ReusePolicy):
    """Position-corrected (delta RoPE) but context-blind reuse: the lower bound every method must beat."""

    name = "naive"
