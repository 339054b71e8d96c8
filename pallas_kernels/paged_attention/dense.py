"""Paged attention as per-sequence matrix products: the XLA path for backends without the Pallas kernel.

Same contract as `reference.paged_attention`. The twin handles queries one at a time (a matrix-vector
product per query over its sequence's gathered pages); here each sequence's pages are gathered once and
all the step's queries attend them in one matrix product, masked to the queries of that sequence.
Sequences with no query in the step are skipped (`lax.cond`), so a prefill chunk costs one [T, J] product
and a step of decode rows one small product per row. Exact to fp32 rounding against the twin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import visible_mask

# Upper bound on fp32 score entries [T, Hq, J] of one sequence; larger steps use the twin.
MAX_SCORES = 1 << 26


def fits(num_tokens: int, num_q_heads: int, max_pages: int, page_size: int) -> bool:
    return num_tokens * num_q_heads * max_pages * page_size <= MAX_SCORES


def paged_attention_dense(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                          scale, slot_bias=None):
    """-> (out [T, Hq, D] in q.dtype, lse [T, Hq] float32), as `reference.paged_attention`."""
    T, Hq, D = q.shape
    N, P, _ = k_pages.shape
    S, Hkv, MP = page_table.shape
    G = Hq // Hkv
    J = MP * P
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
            pt = jnp.maximum(page_table[s], 0)  # [Hkv, MP]
            kk = k_pages[pt].reshape(Hkv, J, D).astype(jnp.float32)
            vv = v_pages[pt].reshape(Hkv, J, D).astype(jnp.float32)
            pos = slot_pos[pt].reshape(Hkv, J)
            valid = (j[None, :] < lengths[s][:, None]) & jnp.repeat(page_table[s] >= 0, P, axis=-1)
            vis = visible_mask(pos[None], valid[None], q_pos, sink, window) & mine[:, None, None]  # [T,Hkv,J]
            vv = jnp.where(valid[..., None], vv, 0.0)  # masked slots may hold another request's NaN
            logits = jnp.einsum("thgd,hjd->thgj", qg, kk, precision=jax.lax.Precision.HIGHEST) * scale
            if slot_bias is not None:
                logits = logits + slot_bias[pt].reshape(Hkv, J).astype(jnp.float32)[None, :, None, :]
            logits = jnp.where(vis[:, :, None, :], logits, -jnp.inf)
            m = jnp.max(logits, axis=-1, keepdims=True)
            m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
            e = jnp.where(vis[:, :, None, :], jnp.exp(logits - m_safe), 0.0)
            denom = jnp.sum(e, axis=-1, keepdims=True)  # [T, Hkv, G, 1]
            o = jnp.einsum("thgj,hjd->thgd", e, vv, precision=jax.lax.Precision.HIGHEST)
            o = (o / jnp.where(denom > 0, denom, 1.0)).reshape(T, Hq, D)
            d = denom[..., 0]
            l_ = jnp.where(d > 0, m_safe[..., 0] + jnp.log(jnp.where(d > 0, d, 1.0)), -jnp.inf).reshape(T, Hq)
            return jnp.where(mine[:, None, None], o, out), jnp.where(mine[:, None], l_, lse)

        return jax.lax.cond(jnp.any(mine), attend, lambda c: c, (out, lse))

    init = (jnp.zeros((T, Hq, D), jnp.float32), jnp.full((T, Hq), -jnp.inf, jnp.float32))
    out, lse = jax.lax.fori_loop(0, S, one_sequence, init)
    return out.astype(q.dtype), lse
