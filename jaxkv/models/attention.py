"""Dense causal attention with an optional sliding window (the `.logits` path and the test oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int, sink: int = 0) -> jax.Array:
    """bool[..., Tq, Tk]: key position k is visible to query position p (architecture.md semantics):
    0 <= k <= p and (window == 0 or k > p - window or k < sink)."""
    p, k = q_pos[..., :, None], k_pos[..., None, :]
    ok = (k >= 0) & (k <= p)
    if window:
        ok &= (k > p - window) | (k < sink)
    return ok


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int = 0,
    sink: int = 0,
    scale: float | None = None,
) -> jax.Array:
    """Causal GQA attention, softmax in fp32.

    q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], q_pos [B, Tq], k_pos [B, Tk] int -> out [B, Tq, Hq, D] (q.dtype).
    Query head qh reads KV head qh // G. A query that sees no key returns zeros.
    """
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, tq, hkv, g, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    mask = visible(q_pos, k_pos, window, sink)[:, None, None]  # [B, 1, 1, Tq, Tk]
    scores = jnp.where(mask, scores, -jnp.inf)
    smax = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(smax), smax, 0.0))
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, hq, d).astype(q.dtype)
