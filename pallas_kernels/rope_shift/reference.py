"""jnp twin of the RoPE shift fused with page copy, and the RoPE frequency tables it takes.

Keys are stored after RoPE at their original positions; moving a page to positions shifted by `delta`
is the delta rotation K(p + delta) = R(delta) K(p), computed in fp32 with unit-magnitude cos/sin
(YaRN's attention factor is already inside the stored K and is not applied again).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] float32 for `rope_type` default, llama3 or yarn (HF semantics)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv.astype(np.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = np.where(wavelen > old / low, inv / factor, np.where(wavelen < old / high, inv, mid))
        return out.astype(np.float32)
    if kind == "yarn":
        factor = scaling["factor"]
        old = scaling.get("original_max_position_embeddings", 4096)
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

        def corr_dim(rot):
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(theta))

        lo = max(math.floor(corr_dim(beta_fast)), 0)
        hi = min(math.ceil(corr_dim(beta_slow)), head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2) - lo) / max(hi - lo, 1e-3), 0, 1)
        extrap = 1 - ramp
        return (inv / factor * (1 - extrap) + inv * extrap).astype(np.float32)
    raise ValueError(f"rope scaling type {kind!r} not supported (default, llama3, yarn)")


def rotate_delta(k, delta, inv_freq, style: str):
    """Rotate k [..., D] by integer positions `delta` [...] (broadcast over the slot axis) in fp32."""
    ang = delta.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)     # [..., D/2]
    c, s = jnp.cos(ang), jnp.sin(ang)
    k = k.astype(jnp.float32)
    if style == "neox":
        half = k.shape[-1] // 2
        x1, x2 = k[..., :half], k[..., half:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    if style == "gptj":
        x1, x2 = k[..., 0::2], k[..., 1::2]
        return jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(k.shape)
    raise ValueError(f"style must be 'neox' or 'gptj', got {style!r}")


def rope_shift(k_pages, v_pages, slot_pos, src_pages, dst_pages, deltas, inv_freq, *, style: str = "neox"):
    """Copy pages src -> dst, rotating K by `delta` and shifting stored positions by it.

    k_pages, v_pages [N, P, D]; slot_pos [N, P] int32 (-1 empty slot stays -1);
    src_pages, dst_pages, deltas [M] int32 (src < 0 = padding entry, skipped); inv_freq [D // 2].
    Destination pages must not also be source pages of the same call. Returns (k_pages, v_pages, slot_pos).
    """
    ok = src_pages >= 0
    src = jnp.where(ok, src_pages, 0)
    n = k_pages.shape[0]
    dst = jnp.where(ok, dst_pages, n)          # out of range -> dropped by the scatter
    pos = slot_pos[src]
    k_new = rotate_delta(k_pages[src], deltas[:, None], inv_freq, style).astype(k_pages.dtype)
    pos_new = jnp.where(pos >= 0, pos + deltas[:, None], -1)
    return (k_pages.at[dst].set(k_new, mode="drop"), v_pages.at[dst].set(v_pages[src], mode="drop"),
            slot_pos.at[dst].set(pos_new, mode="drop"))
