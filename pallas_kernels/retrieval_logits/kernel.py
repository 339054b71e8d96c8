"""Retrieval logits, Pallas (Triton lowering on GPU; interpret mode on CPU).

One program = (query row s, KV head h, key block j): it gathers `block_n` keys of head h from the state
row `rows[s]` (the cache viewed flat, [R * N * Hkv, D], a free reshape outside the kernel; slot n of
head h of row r is entry (r * N + n) * Hkv + h) and takes the dot product with each of the row's G query
heads as a multiply + reduce over D (G is 1-4: an MMA would pad the query rows to 16 and write 16 rows of
logits, which made the first version 8x heavier on output bytes than the keys it read). The key cache is
read once per step, which is the whole cost.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(rows_ref, qpos_ref, q_ref, state_ref, o_ref, *, block_n: int, slots: int, num_slots: int,
            num_kv_heads: int, groups: int):
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = rows_ref[s]
    n = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    ok = n < num_slots
    ids = (row * slots + jnp.where(ok, n, 0)) * num_kv_heads + h
    k = state_ref[ids].astype(jnp.float32)  # [block_n, D]
    visible = ok & (n <= qpos_ref[s])
    for g in range(groups):  # exact fp32 multiply + reduce: G is tiny
        logits = jnp.sum(k * q_ref[g][None, :], axis=1)
        o_ref[g] = jnp.where(visible, logits, -jnp.inf)


def retrieval_logits_pallas(q, state, rows, q_pos, *, num_slots: int, block_n: int = 256, num_warps: int = 4,
                            num_stages: int = 2, interpret: bool = False):
    s, hkv, g, d = q.shape
    r, n = state.shape[:2]
    if num_slots > n:
        raise ValueError(f"num_slots {num_slots} exceeds the state's {n} slots")
    gp = 1 << (g - 1).bit_length()  # Triton blocks are powers of two
    qp = jnp.pad(q.astype(jnp.float32), [(0, 0), (0, 0), (0, gp - g), (0, 0)])
    flat = state.reshape(r * n * hkv, d)
    nb = pl.cdiv(num_slots, block_n)
    kernel = functools.partial(_kernel, block_n=block_n, slots=n, num_slots=num_slots, num_kv_heads=hkv,
                               groups=g)
    full = lambda x: pl.BlockSpec(x.shape, lambda i, h, j: (0,) * x.ndim)  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(s, hkv, nb),
        in_specs=[full(rows), full(q_pos), pl.BlockSpec((None, None, gp, d), lambda i, h, j: (i, h, 0, 0)),
                  full(flat)],
        out_specs=pl.BlockSpec((None, None, gp, block_n), lambda i, h, j: (i, h, 0, j)),
        out_shape=jax.ShapeDtypeStruct((s, hkv, gp, nb * block_n), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxkv_retrieval_logits",
    )(rows.astype(jnp.int32), q_pos.astype(jnp.int32), qp, flat)
    return out[:, :, :g, :num_slots]
