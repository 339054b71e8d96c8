"""Dense causal attention with an optional sliding window (the `.logits` path and the test oracle)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_SCORES = 1 << 28  # fp32 score entries (1 GiB) above which `dense_attention` runs query blocks
Q_BLOCK = 1024


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int, sink: int = 0) -> jax.Array:
    """bool[..., Tq, Tk]: key position k is visible to query position p (architecture.md semantics):
    0 <= k <= p and (window == 0 or k > p - window or k < sink). `window` may be traced (a layer's entry of
    an [L] array under the layer scan)."""
    p, k = q_pos[..., :, None], k_pos[..., None, :]
    ok = (k >= 0) & (k <= p)
    if isinstance(window, int):
        if window:
            ok &= (k > p - window) | (k < sink)
        return ok
    return ok & ((window == 0) | (k > p - window) | (k < sink))


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
    q_block: int | None = None,
) -> jax.Array:
    """Causal GQA attention, softmax in fp32.

    q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], q_pos [B, Tq], k_pos [B, Tk] int -> out [B, Tq, Hq, D] (q.dtype).
    Query head qh reads KV head qh // G. A query that sees no key returns zeros.

    ``q_block``: queries per block (rows are independent, so blocks change no result). None = blocks of
    `Q_BLOCK` only when one [Tq, Tk] score matrix of all heads would exceed `MAX_SCORES` entries (an 8K
    prompt over a 16K cache is 4 GiB of fp32 scores, twice over with the probabilities); 0 = never.
    """
    tq, tk = q.shape[1], k.shape[1]
    if q_block is None:
        q_block = Q_BLOCK if q.shape[0] * q.shape[2] * tq * tk > MAX_SCORES and tq % Q_BLOCK == 0 else 0
    if q_block and tq > q_block:
        if tq % q_block:
            raise ValueError(f"dense_attention: q_block {q_block} does not divide {tq} queries")
        n = tq // q_block
        qs = jnp.moveaxis(q.reshape(q.shape[0], n, q_block, *q.shape[2:]), 1, 0)
        ps = jnp.moveaxis(q_pos.reshape(q_pos.shape[0], n, q_block), 1, 0)
        out = jax.lax.map(lambda a: dense_attention(a[0], k, v, a[1], k_pos, window=window, sink=sink,
                                                    scale=scale, q_block=0), (qs, ps))
        return jnp.moveaxis(out, 0, 1).reshape(q.shape)
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
