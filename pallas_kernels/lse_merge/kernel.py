"""Pallas kernel (Triton lowering; interpret mode on CPU) for the LSE merge of K partial results."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _merge_kernel(o_ref, l_ref, out_ref, lse_ref, *, num_parts: int):
    # o_ref [K, BM, D] f32-able, l_ref [K, BM]; the K parts are unrolled (K is small and static).
    m = l_ref[0, :].astype(jnp.float32)
    for k in range(1, num_parts):
        m = jnp.maximum(m, l_ref[k, :].astype(jnp.float32))
    m_safe = jnp.where(m > -jnp.inf, m, 0.0)
    total = jnp.zeros_like(m)
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for k in range(num_parts):
        lk = l_ref[k, :].astype(jnp.float32)
        w = jnp.where(lk > -jnp.inf, jnp.exp(lk - m_safe), 0.0)
        total = total + w
        acc = acc + w[:, None] * o_ref[k, :, :].astype(jnp.float32)
    seen = total > 0
    denom = jnp.where(seen, total, 1.0)
    out_ref[...] = jnp.where(seen[:, None], acc / denom[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m_safe + jnp.log(denom), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_m", "interpret"))
def lse_merge_pallas(outs, lses, *, out_dtype=None, block_m: int = 32, interpret: bool = False):
    """Pallas version of `reference.lse_merge` (same contract); rows are tiled by `block_m`."""
    out_dtype = outs.dtype if out_dtype is None else out_dtype
    k, *lead, d = outs.shape
    m = 1
    for s in lead:
        m *= s
    o2 = outs.reshape(k, m, d)
    l2 = lses.reshape(k, m).astype(jnp.float32)
    mp = pl.cdiv(m, block_m) * block_m
    if mp != m:
        o2 = jnp.pad(o2, ((0, 0), (0, mp - m), (0, 0)))
        l2 = jnp.pad(l2, ((0, 0), (0, mp - m)), constant_values=-jnp.inf)
    out, lse = pl.pallas_call(
        functools.partial(_merge_kernel, num_parts=k),
        grid=(mp // block_m,),
        in_specs=[pl.BlockSpec((k, block_m, d), lambda i: (0, i, 0)),
                  pl.BlockSpec((k, block_m), lambda i: (0, i))],
        out_specs=[pl.BlockSpec((block_m, d), lambda i: (i, 0)),
                   pl.BlockSpec((block_m,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((mp, d), out_dtype), jax.ShapeDtypeStruct((mp,), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxkv_lse_merge",
    )(o2, l2)
    return out[:m].reshape(*lead, d), lse[:m].reshape(lead)
