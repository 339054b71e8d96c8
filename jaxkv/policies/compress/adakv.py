"""AdaKV (Feng et al. 2024): one layer budget shared by its heads through a flattened top-k over SnapKV
scores, with a per-head floor (kvpress's `alpha_safeguard`) so no head is starved."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.policies.base import NEG, SelectContext, forced_mask
from jaxkv.policies.compress.snapkv import SnapKV
from jaxkv.policies.registry import register


@register
@dataclasses.dataclass(frozen=True)
class AdaKV(SnapKV):
    name = "adakv"
    alpha: float = 0.2  # each head keeps at least alpha * its uniform share

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"adakv: alpha must lie in [0, 1] (got {self.alpha!r})")

    def max_count(self, target: int, num_kv_heads: int = 1) -> int:
        return max(target - self.window, 0) * num_kv_heads + self.window + self.sink

    def counts(self, scores, ctx: SelectContext):
        S, L, H, N = scores.shape
        forced = forced_mask(ctx.positions, self.sink, ctx.recent_from)
        free = jnp.where(forced | (ctx.positions < 0), NEG, scores.astype(jnp.float32))
        share = jnp.maximum(ctx.target - self.window - self.sink, 0)  # [S] uniform non-forced share per head
        floor = (self.alpha * share).astype(jnp.int32)
        # A head's `floor` best slots are taken first: lift them above every other score.
        ranks = jnp.argsort(jnp.argsort(-free, axis=-1), axis=-1)
        lifted = jnp.where((ranks < floor[:, None, None, None]) & (free > NEG / 2), 2e29, free)
        flat = jnp.sort(lifted.reshape(S, L, H * N), axis=-1)[..., ::-1]  # descending
        k = jnp.clip(H * share, 1, H * N)  # [S] slots the layer keeps beyond the forced ones
        thr = jnp.take_along_axis(flat, (k - 1)[:, None, None], axis=-1)  # [S, L, 1]
        taken = jnp.sum((lifted >= thr[..., None]) & (lifted > NEG / 2), axis=-1)
        total = taken + jnp.sum(forced, axis=-1)
        return jnp.where(share[:, None, None] > 0, total, jnp.sum(forced, axis=-1)).astype(jnp.int32)

