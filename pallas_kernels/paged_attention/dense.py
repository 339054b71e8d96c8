"""Paged attention as per-sequence matrix products: the XLA path for backends without the Pallas kernel.

Same contract as `reference.paged_attention`. The twin handles queries one at a time (a matrix-vector
product per query over its sequence's gathered pages); here all the step's queries of one sequence attend
its pages in matrix products, tile by tile of `TILE_SLOTS` slots with an online softmax, masked to the
queries of that sequence. Sequences with no query in the step are skipped (`lax.cond`) and a sequence reads
only the tiles its longest head fills (`lengths`), so a prefill chunk costs its [T, filled slots] products
and a decode row one small product per tile it fills; each tile's scores stay small enough for the cache.
Equal to the twin to fp32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import visible_mask

# Upper bound on fp32 score entries [T, Hq, J] of one sequence; larger steps use the twin.
MAX_SCORES = 1 << 26
# Slots of one tile (rounded to whole pages): [T, Hq, TILE_SLOTS] scores per product.
TILE_SLOTS = 128


def fits(num_tokens: int, num_q_heads: int, max_pages: int, page_size: int) -> bool:
    return num_tokens * num_q_heads * max_pages * page_size <= MAX_SCORES


def paged_attention_dense(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                          scale, slot_bias=None):
    """-> (out [T, Hq, D] in q.dtype, lse [T, Hq] float32), as `reference.paged_attention`."""
    T, Hq, D = q.shape
    N, P, _ = k_pages.shape
    S, Hkv, MP = page_table.shape
    G = Hq // Hkv
    tp = max(1, min(MP, TILE_SLOTS // P))  # pages per tile
    n_tiles = -(-MP // tp)
    J = tp * P
    table = jnp.pad(page_table, ((0, 0), (0, 0), (0, n_tiles * tp - MP)), constant_values=-1)
    sink = sink.astype(jnp.int32)
    window = window.astype(jnp.int32)
    q_seq = q_seq.astype(jnp.int32)
    q_pos = q_pos.astype(jnp.int32)
    qg = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    j = jnp.arange(J, dtype=jnp.int32)

    def one_sequence(s, carry):
        out, lse = carry
        mine = q_seq == s  # [T]

        def attend(carry):
            out, lse = carry
            length = lengths[s]  # [Hkv]

            def tile(i, acc):
                m, l, o = acc  # [T, Hkv, G], [T, Hkv, G], [T, Hkv, G, D]
                raw = jax.lax.dynamic_slice_in_dim(table[s], i * tp, tp, axis=1)  # [Hkv, tp]
                pt = jnp.maximum(raw, 0)
                kk = k_pages[pt].reshape(Hkv, J, D).astype(jnp.float32)
                vv = v_pages[pt].reshape(Hkv, J, D).astype(jnp.float32)
                pos = slot_pos[pt].reshape(Hkv, J)
                valid = (i * J + j[None, :] < length[:, None]) & jnp.repeat(raw >= 0, P, axis=-1)
                vis = visible_mask(pos[None], valid[None], q_pos, sink, window) & mine[:, None, None]
                vv = jnp.where(valid[..., None], vv, 0.0)  # masked slots may hold another request's NaN
                logits = jnp.einsum("thgd,hjd->thgj", qg, kk, precision=jax.lax.Precision.HIGHEST) * scale
                if slot_bias is not None:
                    logits = logits + slot_bias[pt].reshape(Hkv, J).astype(jnp.float32)[None, :, None, :]
                logits = jnp.where(vis[:, :, None, :], logits, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                e = jnp.where(vis[:, :, None, :], jnp.exp(logits - m_safe[..., None]), 0.0)
                rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
                o = o * rescale[..., None] + jnp.einsum("thgj,hjd->thgd", e, vv,
                                                        precision=jax.lax.Precision.HIGHEST)
                return m_new, l * rescale + jnp.sum(e, axis=-1), o

            used = -(-jnp.max(length) // J)  # tiles the longest head fills
            init = (jnp.full((T, Hkv, G), -jnp.inf, jnp.float32), jnp.zeros((T, Hkv, G), jnp.float32),
                    jnp.zeros((T, Hkv, G, D), jnp.float32))
            m, l, o = jax.lax.fori_loop(0, jnp.minimum(used, n_tiles), tile, init)
            o = (o / jnp.where(l > 0, l, 1.0)[..., None]).reshape(T, Hq, D)
            l_ = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf).reshape(T, Hq)
            return jnp.where(mine[:, None, None], o, out), jnp.where(mine[:, None], l_, lse)

        return jax.lax.cond(jnp.any(mine), attend, lambda c: c, (out, lse))

    init = (jnp.zeros((T, Hq, D), jnp.float32), jnp.full((T, Hq), -jnp.inf, jnp.float32))
    out, lse = jax.lax.fori_loop(0, S, one_sequence, init)
    return out.astype(q.dtype), lse
