"""jnp twins: the whole contract (`rows_attention`) and the prefix part of the split (`prefix_attention`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _attend(q, k, v, visible, scale):
    """q [..., R, Hq, D], k/v [N, Hkv, D], visible [..., R, N] -> (out [..., R, Hq, D] q.dtype,
    lse [..., R, Hq]). fp32 softmax; rows that see no key get out 0, lse -inf."""
    *lead, r, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(*lead, r, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("...rhgd,nhd->...rhgn", qg, k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    vis = visible[..., :, None, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp(s - m), 0.0)
    tot = jnp.sum(e, axis=-1)
    seen = tot > 0
    out = jnp.einsum("...rhgn,nhd->...rhgd", e, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    out = out / jnp.where(seen, tot, 1.0)[..., None]
    lse = jnp.where(seen, m[..., 0] + jnp.log(jnp.where(seen, tot, 1.0)), -jnp.inf)
    return (jnp.where(seen[..., None], out, 0.0).reshape(*lead, r, hq, d).astype(q.dtype),
            lse.reshape(*lead, r, hq))


def rows_attention(q, k, v, q_pos, *, scale: float):
    """Row i (position q_pos[i], -1 = padding) attends to keys 0..q_pos[i]; key t of k/v [T, Hkv, D] is at
    position t. -> (out [R, Hq, D] in q.dtype, lse [R, Hq] float32 natural log; padding rows 0 / -inf)."""
    kpos = jnp.arange(k.shape[0], dtype=jnp.int32)
    visible = (kpos[None, :] <= q_pos[:, None]) & (q_pos[:, None] >= 0)
    return _attend(q, k, v, visible, scale)


def prefix_attention(qc, k, v, kv_len, *, scale: float):
    """The split's prefix part: every row of chunk j (qc [NC, C, Hq, D]) attends to keys 0..kv_len[j]-1,
    unmasked otherwise. -> (out [NC, C, Hq, D], lse [NC, C, Hq]; chunks with kv_len 0: 0 / -inf)."""
    kpos = jnp.arange(k.shape[0], dtype=jnp.int32)
    visible = jnp.broadcast_to((kpos[None, :] < kv_len[:, None])[:, None, :],
                               (qc.shape[0], qc.shape[1], k.shape[0]))
    return _attend(qc, k, v, visible, scale)
