"""CacheBlend (Yao et al., EuroSys 2025, arXiv:2405.16444): recompute the tokens whose K/V deviate most.

Layers ``0 .. full_layers-1`` are recomputed for every token; at layer ``full_layers`` the fresh K/V of every
reused token is compared with its rotated cached K/V and the `ratio` of reused tokens with the largest
deviation (squared L2 over K and V, summed over KV heads) are recomputed, with the new text, in the
remaining layers. The paper selects at its first checked layer (``check_layers=[1]``) with ~15 %.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jaxkv.policies.reuse.base import LayerView, Layout, ReusePolicy, _check_frac, register_reuse


@register_reuse
@dataclasses.dataclass(frozen=True)
class CacheBlend(ReusePolicy):
    name = "cacheblend"
    selects = True
    full_layers: int = 1
    ratio: float = 0.15  # fraction of the reused tokens recomputed

    def __post_init__(self):
        super().__post_init__()
        _check_frac(self, "ratio")

    def num_selected(self, lay: Layout) -> int:
        return math.ceil(self.ratio * lay.num_reused)

    def score(self, view: LayerView):
        dk = jnp.sum(jnp.square(view.k.astype(jnp.float32) - view.k_cached.astype(jnp.float32)), axis=(1, 2))
        dv = jnp.sum(jnp.square(view.v.astype(jnp.float32) - view.v_cached.astype(jnp.float32)), axis=(1, 2))
        return dk + dv
