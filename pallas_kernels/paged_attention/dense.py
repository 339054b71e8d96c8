"""Paged attention as per-sequence matrix products: the XLA path for backends without the Pallas kernel.

Same contract as `reference.paged_attention`. The twin handles queries one at a time (a matrix-vector
product per query over its sequence's gathered pages); here a sequence's queries attend its pages in
matrix products, a block of `Q_BLOCK` queries against a tile of `TILE_SLOTS` slots (`DECODE_TILE_SLOTS` in
a decode step) at a time, with an online softmax over the tiles. Work is skipped where it would be masked
out: sequences with no query in the step, query blocks with none of the sequence's queries, tiles past the
sequence's longest head (`lengths`) and tiles no query of the block sees (the future half of a prefill
chunk's own slots, slots outside a local head's window), each by a branch; a tile every query of the block
sees whole (most tiles of a long prefill) skips the mask as well. The products run head-major
([Hkv, G * rows, D] against [Hkv, J, D]): XLA:CPU runs them as batched GEMMs without transposing a tile
(2x faster than token-major operands on the CPU). Equal to the twin to fp32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Queries of one block (rows of a product are G * Q_BLOCK per KV head).
Q_BLOCK = 256
# Slots of one tile (rounded to whole pages): [Hkv, G, Q_BLOCK, TILE_SLOTS] scores per product.
TILE_SLOTS = 128
# Steps of at most DECODE_ROWS query rows (decode) take tiles of DECODE_TILE_SLOTS: their scores stay small,
# and a tile's fixed cost (gathers, branch, fusions) dominates a few rows' products (SmolLM2, one decode
# row over 1.5K slots, one thread: 0.47 to 0.67 ms a layer with 512-slot tiles against 0.76 to 0.94 ms
# with 128; 2048 no better).
DECODE_ROWS = 64
DECODE_TILE_SLOTS = 512
# Queries of one block in such a step. A sequence runs only the blocks that hold its rows, so a decode row
# (one per sequence) computes a block of this many rows, not the step's whole batch; a small chunk of many
# rows takes several blocks, each gathering its tiles again.
DECODE_Q_BLOCK = 8
# Upper bound on T * Hq * TILE_SLOTS, the fp32 scores of one tile against every query row of a step (the
# query blocks of a long step each hold a part); larger steps use the twin.
MAX_SCORES = 1 << 28


def fits(num_tokens: int, num_q_heads: int, max_pages: int, page_size: int) -> bool:
    """Whether a step takes this path. Its memory follows the step's query rows (the [T, Hq, D] output and
    one block's tile of scores), not the page-table width: `max_pages` only sets how many tiles run."""
    return num_tokens * num_q_heads * min(max_pages * page_size, _tile_slots(num_tokens)) <= MAX_SCORES


def _tile_slots(num_tokens: int) -> int:
    return DECODE_TILE_SLOTS if num_tokens <= DECODE_ROWS else TILE_SLOTS


def paged_attention_dense(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                          scale, slot_bias=None):
    """-> (out [T, Hq, D] in q.dtype, lse [T, Hq] float32), as `reference.paged_attention`."""
    T, Hq, D = q.shape
    N, P, _ = k_pages.shape
    S, Hkv, MP = page_table.shape
    G = Hq // Hkv
    tp = max(1, min(MP, _tile_slots(T) // P))  # pages per tile
    n_tiles = -(-MP // tp)
    J = tp * P
    bq = max(1, min(T, DECODE_Q_BLOCK if T <= DECODE_ROWS else Q_BLOCK))
    n_blocks = -(-T // bq)
    pad = n_blocks * bq - T
    table = jnp.pad(page_table, ((0, 0), (0, 0), (0, n_tiles * tp - MP)), constant_values=-1)
    sink = sink.astype(jnp.int32)
    window = window.astype(jnp.int32)
    q_seq = jnp.pad(q_seq.astype(jnp.int32), (0, pad), constant_values=-1)
    q_pos = jnp.pad(q_pos.astype(jnp.int32), (0, pad))
    # head-major queries [Hkv, G, T, D]: each KV head's G * T query rows are one operand
    qh = jnp.pad(q.astype(jnp.float32), ((0, pad), (0, 0), (0, 0)))
    qh = qh.reshape(-1, Hkv, G, D).transpose(1, 2, 0, 3)
    j = jnp.arange(J, dtype=jnp.int32)

    def one_block(s, length, used, start, carry):
        """Queries [start, start + bq) of sequence s over its tiles -> carry with their rows set."""
        out, lse = carry  # [Hkv, G, T, D], [Hkv, G, T]
        qb = jax.lax.dynamic_slice_in_dim(qh, start, bq, axis=2)  # [Hkv, G, bq, D]
        pos_b = jax.lax.dynamic_slice_in_dim(q_pos, start, bq)
        mine = jax.lax.dynamic_slice_in_dim(q_seq, start, bq) == s  # [bq]

        lo = jnp.min(jnp.where(mine, pos_b, jnp.iinfo(jnp.int32).max))  # the block's query positions
        hi = jnp.max(jnp.where(mine, pos_b, -1))

        def tile(i, acc):
            raw = jax.lax.dynamic_slice_in_dim(table[s], i * tp, tp, axis=1)  # [Hkv, tp]
            pt = jnp.maximum(raw, 0)
            pos = slot_pos[pt].reshape(Hkv, J)
            valid = (i * J + j[None, :] < length[:, None]) & jnp.repeat(raw >= 0, P, axis=-1)

            def masked(acc):
                vis = _visible(pos, valid, pos_b, sink, window) & mine[None, :, None]  # [Hkv, bq, J]
                kk, vv, bias = _gather_tile(k_pages, v_pages, slot_bias, pt, valid)
                return _online_product(acc, qb, kk, vv, vis[:, None], bias, scale)

            def unmasked(acc):  # rows of other sequences get values too: the block drops them at the end
                kk, vv, bias = _gather_tile(k_pages, v_pages, slot_bias, pt, valid)
                return _online_product(acc, qb, kk, vv, None, bias, scale)

            kind = _tile_kind(pos, valid, lo, hi, sink, window)
            return jax.lax.switch(kind, [lambda acc: acc, masked, unmasked], acc)

        init = (jnp.full((Hkv, G, bq), -jnp.inf, jnp.float32), jnp.zeros((Hkv, G, bq), jnp.float32),
                jnp.zeros((Hkv, G, bq, D), jnp.float32))
        m, den, o = jax.lax.fori_loop(0, used, tile, init)
        o, l_ = _finish(m, den, o)
        keep_o = jax.lax.dynamic_slice_in_dim(out, start, bq, axis=2)
        keep_l = jax.lax.dynamic_slice_in_dim(lse, start, bq, axis=2)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], o, keep_o), start, axis=2)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, jnp.where(mine, l_, keep_l), start, axis=2)
        return out, lse

    def one_sequence(s, carry):
        length = lengths[s]  # [Hkv]
        used = jnp.minimum(-(-jnp.max(length) // J), n_tiles)  # tiles the longest head fills

        # The blocks from the sequence's first row to its last (rows of other sequences between them are
        # masked), the last one moved back to end within the padded rows.
        mine = q_seq == s
        first = jnp.argmax(mine)
        last = n_blocks * bq - 1 - jnp.argmax(mine[::-1])

        def block(b, carry):
            start = jnp.minimum(first + b * bq, n_blocks * bq - bq)
            return one_block(s, length, used, start, carry)

        return jax.lax.cond(jnp.any(mine), lambda c: jax.lax.fori_loop(0, (last - first) // bq + 1, block, c),
                            lambda c: c, carry)

    init = (jnp.zeros((Hkv, G, n_blocks * bq, D), jnp.float32),
            jnp.full((Hkv, G, n_blocks * bq), -jnp.inf, jnp.float32))
    out, lse = jax.lax.fori_loop(0, S, one_sequence, init)
    out = out.transpose(2, 0, 1, 3).reshape(-1, Hq, D)[:T]
    lse = lse.transpose(2, 0, 1).reshape(-1, Hq)[:T]
    return out.astype(q.dtype), lse



def _tile_kind(pos, valid, lo, hi, sink, window):
    """0: no query of the block (positions lo..hi) sees a slot of the tile (pos, valid [Hkv, J]); 2: every
    query sees every slot (no mask to apply: most tiles of a long prefill); 1: the rest, masked."""
    w = window[:, None]
    local = w > 0
    none = ~valid | (pos < 0) | (pos > hi) | (local & (pos <= lo - w) & (pos >= sink[:, None]))
    every = valid & (pos >= 0) & (pos <= lo) & (~local | (pos > hi - w) | (pos < sink[:, None]))
    return jnp.where(jnp.all(none), 0, jnp.where(jnp.all(every), 2, 1))


def _visible(pos, valid, q_pos, sink, window):
    """`visible_mask` in the products' [Hkv, rows, J] layout (no transposed copy): pos, valid [Hkv, J];
    q_pos [rows]."""
    p = q_pos[None, :, None]
    k = pos[:, None, :]
    w = window[:, None, None]
    in_window = (w == 0) | (k > p - w) | (k < sink[:, None, None])
    return valid[:, None, :] & (k >= 0) & (k <= p) & in_window


def _gather_tile(k_pages, v_pages, slot_bias, pt, valid):
    """K, V [Hkv, J, D] float32 of a tile's pages `pt` [Hkv, tp] and its slot bias [Hkv, J] (or None)."""
    hkv = pt.shape[0]
    d = k_pages.shape[-1]
    kk = k_pages[pt].reshape(hkv, -1, d).astype(jnp.float32)
    vv = v_pages[pt].reshape(hkv, -1, d).astype(jnp.float32)
    vv = jnp.where(valid[..., None], vv, 0.0)  # masked slots may hold another request's NaN
    bias = None if slot_bias is None else slot_bias[pt].reshape(hkv, -1).astype(jnp.float32)
    return kk, vv, bias


def _online_product(acc, qb, kk, vv, vis, bias, scale):
    """One tile of the online softmax: acc = (max, denominator [Hkv, G, rows], output [Hkv, G, rows, D])
    updated with queries qb [Hkv, G, rows, D] against keys kk / values vv [Hkv, J, D] where vis
    [Hkv, 1, rows, J] (None: every slot seen; bias [Hkv, J] or None: added to the scaled logits)."""
    m, den, o = acc
    logits = jnp.einsum("hgtd,hjd->hgtj", qb, kk, precision=jax.lax.Precision.HIGHEST) * scale
    if bias is not None:
        logits = logits + bias[:, None, None, :]
    if vis is not None:
        logits = jnp.where(vis, logits, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    e = jnp.exp(logits - m_safe[..., None])  # exp(-inf) = 0 where masked: m_safe is finite
    rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    o = o * rescale[..., None] + jnp.einsum("hgtj,hjd->hgtd", e, vv, precision=jax.lax.Precision.HIGHEST)
    return m_new, den * rescale + jnp.sum(e, axis=-1), o


def _finish(m, den, o):
    """(output [Hkv, G, rows, D], lse [Hkv, G, rows]) of an online softmax's accumulators; a row that saw
    nothing gives 0 and -inf."""
    ok = den > 0
    safe = jnp.where(ok, den, 1.0)
    return o / safe[..., None], jnp.where(ok, m + jnp.log(safe), -jnp.inf)

