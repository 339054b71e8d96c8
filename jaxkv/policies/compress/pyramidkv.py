"""PyramidKV (Cai et al. 2024): SnapKV selection with an arithmetic per-layer budget, widest at the bottom.

Schedule of the reference repo (`pyramidkv_utils.py`): with B the per-head budget and W the window,
min = (B - W) // beta, max = 2 (B - W) - min, layer l keeps max - l * (max - min) // (L - 1) non-window
tokens, so the layers average to SnapKV's budget.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import SelectContext
from jaxkv.policies.compress.snapkv import SnapKV
from jaxkv.policies.registry import register


@register
@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    name = "pyramidkv"
    beta: int = 20

    def max_count(self, target: int, num_kv_heads: int = 1) -> int:
        return 2 * target

    def counts(self, scores, ctx: SelectContext):
        S, L, H = ctx.lengths.shape
        free = jnp.maximum(ctx.target - self.window, 0)  # [S] non-window budget
        lo = free // self.beta
        hi = 2 * free - lo
        steps = (hi - lo) // max(L - 1, 1)
        per_layer = hi[:, None] - jnp.arange(L)[None] * steps[:, None] + self.window  # [S, L]
        return jnp.broadcast_to(per_layer[:, :, None], (S, L, H)).astype(jnp.int32)
