"""Pure-jnp reference twin of the ragged per-(layer, KV head) paged attention kernels.

Every Pallas paged-attention kernel has exactly this signature and is tested against this function. It is
written to be obviously correct, not fast: it gathers each (sequence, KV head)'s page list into a dense
``[S, Hkv, max_pages * page_size, D]`` view, builds the visibility mask from stored slot positions, and
runs a masked fp32 softmax per query token.

Visibility (docs/architecture.md): query ``t`` of sequence ``s = q_seq[t]``, query head ``qh``, KV head
``h = qh // G`` sees slot ``i < lengths[s, h]`` of the concatenated page list ``page_table[s, h]`` iff its
stored position ``k`` satisfies ``0 <= k <= q_pos[t]`` and (``window[h] == 0`` or ``k > q_pos[t] -
window[h]`` or ``k < sink[h]``). Storage order inside the page list does not matter (ring buffers are
fine). A query that sees nothing (padding row, empty head) returns ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Upper bound on the elements of the per-batch gathered K (or V) block; keeps the reference's memory
# bounded for long contexts by mapping over query tokens in batches.
_MAX_GATHER_ELEMS = 1 << 24


def visible_mask(slot_pos_seq, valid, q_pos, sink, window):
    """Visibility of stored slots for query positions.

    slot_pos_seq [..., Hkv, J] int32 stored positions; valid [..., Hkv, J] bool (inside length and page);
    q_pos [...] int32; sink, window [Hkv] int32. Returns bool [..., Hkv, J].
    """
    p = q_pos[..., None, None]
    k = slot_pos_seq
    in_window = (window == 0)[:, None] | (k > p - window[:, None]) | (k < sink[:, None])
    return valid & (k >= 0) & (k <= p) & in_window


def paged_attention(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                    scale, slot_bias=None):
    """Ragged per-head paged attention for one layer.

    Args:
      q:          [T, Hq, D] queries (after RoPE).
      k_pages:    [N, P, D] key pages (after RoPE); v_pages [N, P, D] value pages.
      slot_pos:   [N, P] int32 original token position of every slot (-1 = empty).
      page_table: [S, Hkv, max_pages] int32 page ids of this layer; -1 = padding.
      lengths:    [S, Hkv] int32 valid slots of each concatenated page list.
      q_seq:      [T] int32 sequence slot of each query; -1 = padding query.
      q_pos:      [T] int32 absolute position of each query.
      sink, window: [Hkv] int32 effective per-head sink and window (0 = no window).
      scale:      softmax scale (python float or scalar).
      slot_bias:  [N, P] float32 or None: added to the scaled logit of every slot (a merged slot's log mass).

    Returns:
      out [T, Hq, D] in q.dtype and lse [T, Hq] float32 (natural log); out = 0, lse = -inf where a query
      sees no slot.
    """
    T, Hq, D = q.shape
    N, P, _ = k_pages.shape
    S, Hkv, MP = page_table.shape
    if Hq % Hkv:
        raise ValueError(f"num query heads {Hq} is not a multiple of num kv heads {Hkv}")
    G = Hq // Hkv
    J = MP * P

    # Dense per-(sequence, head) views of the page lists: [S, Hkv, J, D] and [S, Hkv, J].
    pt = jnp.where(page_table >= 0, page_table, 0)
    k_seq = k_pages[pt].reshape(S, Hkv, J, D)
    v_seq = v_pages[pt].reshape(S, Hkv, J, D)
    pos_seq = slot_pos[pt].reshape(S, Hkv, J)
    bias_seq = (jnp.zeros((S, Hkv, J), jnp.float32) if slot_bias is None
                else slot_bias[pt].reshape(S, Hkv, J).astype(jnp.float32))
    j = jnp.arange(J, dtype=jnp.int32)
    valid_seq = (j[None, None, :] < lengths[:, :, None]) & jnp.repeat(page_table >= 0, P, axis=-1)

    sink = sink.astype(jnp.int32)
    window = window.astype(jnp.int32)

    def one_query(args):
        qt, s, p = args  # [Hq, D], scalar, scalar
        s_c = jnp.clip(s, 0, S - 1)
        kk = k_seq[s_c].astype(jnp.float32)  # [Hkv, J, D]
        vv = v_seq[s_c].astype(jnp.float32)
        vis = visible_mask(pos_seq[s_c], valid_seq[s_c], p, sink, window) & (s >= 0)  # [Hkv, J]
        vv = jnp.where(vis[..., None], vv, 0.0)  # masked slots may hold another request's NaN
        qg = qt.astype(jnp.float32).reshape(Hkv, G, D)
        logits = jnp.einsum("hgd,hjd->hgj", qg, kk, precision=jax.lax.Precision.HIGHEST) * scale
        logits = logits + bias_seq[s_c][:, None, :]
        vis = vis[:, None, :]
        logits = jnp.where(vis, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.where(vis, jnp.exp(logits - m_safe), 0.0)
        denom = jnp.sum(e, axis=-1, keepdims=True)  # [Hkv, G, 1]
        o = jnp.einsum("hgj,hjd->hgd", e, vv, precision=jax.lax.Precision.HIGHEST)
        o = o / jnp.where(denom > 0, denom, 1.0)
        lse = jnp.where(denom[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.where(denom[..., 0] > 0,
                                                                             denom[..., 0], 1.0)), -jnp.inf)
        return o.reshape(Hq, D).astype(q.dtype), lse.reshape(Hq)

    batch = max(1, min(T, _MAX_GATHER_ELEMS // max(1, Hkv * J * D)))
    out, lse = jax.lax.map(one_query, (q, q_seq.astype(jnp.int32), q_pos.astype(jnp.int32)),
                           batch_size=batch)
    return out, lse
