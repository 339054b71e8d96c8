"""The device KV page pool: one pytree shared by every (layer, KV head) of the model.

A page holds ``page_size`` consecutive cache slots of exactly one (layer, KV head); which page belongs to
which (sequence, layer, head) is host bookkeeping (``jaxkv.cache.tables``). Slots are addressed by a flat
slot id ``page * page_size + offset``; ``-1`` marks a padding token whose write is skipped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "pos", "bias"],
                   meta_fields=["page_size"])
@dataclasses.dataclass(frozen=True)
class KVPool:
    """Paged K/V storage. Keys are stored after RoPE at their original positions.

    `bias` (optional, engines built with `kv_merge=True`): a logit every attention path adds to the slot, 0
    for a plain token, log(mass) for a slot that a compression policy's merge folded evicted tokens into
    (docs/policies.md, "LSE-preserving merge"). Every K/V write resets its slots' bias to 0, and the rewrite
    moves it with the slot.
    """

    k: jax.Array  # [num_pages, page_size, head_dim]  storage dtype; logical axes (page, slot, head_dim)
    v: jax.Array  # [num_pages, page_size, head_dim]  storage dtype
    pos: jax.Array  # [num_pages, page_size] int32   original token position of each slot, -1 = empty
    page_size: int  # static
    bias: jax.Array | None = None  # [num_pages, page_size] float32 logit bias, or None (no merged slots)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.k.shape[2]


def init_pool(num_pages: int, page_size: int, head_dim: int, dtype=jnp.bfloat16,
              bias: bool = False) -> KVPool:
    """An empty pool: zero K/V and every slot position -1 (and zero logit bias with `bias`)."""
    if num_pages <= 0 or page_size <= 0 or head_dim <= 0:
        raise ValueError(f"init_pool needs positive sizes, got num_pages={num_pages}, "
                         f"page_size={page_size}, head_dim={head_dim}")
    return KVPool(
        k=jnp.zeros((num_pages, page_size, head_dim), dtype),
        v=jnp.zeros((num_pages, page_size, head_dim), dtype),
        pos=jnp.full((num_pages, page_size), -1, jnp.int32),
        page_size=page_size,
        bias=jnp.zeros((num_pages, page_size), jnp.float32) if bias else None,
    )


def write_kv(pool: KVPool, k_new, v_new, positions, slots) -> KVPool:
    """Scatter new tokens' K/V (one layer) into their slots.

    k_new, v_new [T, Hkv, D]; positions [T] int32 original positions; slots [T, Hkv] int32 flat slot ids
    (``page * page_size + offset``), -1 = skip. Pure and jit-able; jit it with ``donate_argnums=0`` (see
    ``write_kv_donated``) so the pool is updated in place.
    """
    T, Hkv, D = k_new.shape
    N, P = pool.pos.shape
    total = N * P
    flat = slots.reshape(T * Hkv).astype(jnp.int32)
    # Skipped writes go out of bounds and are dropped.
    idx = jnp.where(flat >= 0, flat, total)
    k = pool.k.reshape(total, D).at[idx].set(k_new.reshape(T * Hkv, D).astype(pool.k.dtype), mode="drop")
    v = pool.v.reshape(total, D).at[idx].set(v_new.reshape(T * Hkv, D).astype(pool.v.dtype), mode="drop")
    pos_new = jnp.broadcast_to(positions.astype(jnp.int32)[:, None], (T, Hkv)).reshape(T * Hkv)
    pos = pool.pos.reshape(total).at[idx].set(pos_new, mode="drop")
    bias = None if pool.bias is None else pool.bias.reshape(total).at[idx].set(0.0, mode="drop").reshape(N, P)
    return KVPool(k=k.reshape(N, P, D), v=v.reshape(N, P, D), pos=pos.reshape(N, P),
                  page_size=pool.page_size, bias=bias)


write_kv_donated = jax.jit(write_kv, donate_argnums=0)
