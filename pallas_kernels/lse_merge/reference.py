"""jnp twin of the LSE merge: combine K partial attention results over disjoint key sets exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lse_merge(outs: jax.Array, lses: jax.Array, *, out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Merge partial attention results.

    outs [K, ..., D] (each part normalised over its own keys), lses [K, ...] float32 natural-log
    sum-exp of each part (-inf = the part saw no key). Returns out [..., D] (out_dtype, default
    outs.dtype) and lse [...] float32; rows no part saw give out = 0, lse = -inf.
    """
    out_dtype = outs.dtype if out_dtype is None else out_dtype
    lses = lses.astype(jnp.float32)
    m = jnp.max(lses, axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lses), jnp.exp(lses - m_safe), 0.0)  # [K, ...]
    total = jnp.sum(w, axis=0)
    seen = total > 0
    out = jnp.sum(w[..., None] * outs.astype(jnp.float32), axis=0) / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    return jnp.where(seen[..., None], out, 0.0).astype(out_dtype), lse
