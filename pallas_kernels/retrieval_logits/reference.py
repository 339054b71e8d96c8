"""jnp twin of the retrieval-logits kernel: the decode query of each row against its key-cache row.

Contract: q [S, Hkv, G, D] float32 (already scaled), state [R, N, Hkv, D] float32 or bfloat16 (a retrieval
head's key cache, slot = position), rows [S] int32 (the state row of each query row, in [0, R)),
q_pos [S] int32, num_slots (static, <= N). Returns logits [S, Hkv, G, num_slots] float32: q . key for
slots <= q_pos, -inf past it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def retrieval_logits(q, state, rows, q_pos, *, num_slots: int):
    keys = state[rows, :num_slots].astype(jnp.float32)  # [S, N, Hkv, D]
    logits = jnp.einsum("shgd,snhd->shgn", q, keys, precision=jax.lax.Precision.HIGHEST)
    visible = jnp.arange(num_slots)[None, None, None, :] <= q_pos[:, None, None, None]
    return jnp.where(visible, logits, -jnp.inf)
