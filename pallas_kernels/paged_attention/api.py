"""Public ragged per-head paged attention: `paged_attention(..., implementation=None|"pallas"|"reference")`.

Same arguments and semantics as `reference.paged_attention` (docs/architecture.md); api.py turns the
contract's arguments into the kernel's metadata (query blocks, per-(block, head) virtual page ranges).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._dispatch import dispatch, next_pow2, resolve_interpret
from pallas_kernels.lse_merge.api import lse_merge
from pallas_kernels.paged_attention.kernel import META_WIDTH, paged_attention_blocks

_INT_MAX = jnp.iinfo(jnp.int32).max


def _query_blocks(q_seq, q_pos, num_seqs: int, block_q: int):
    """Split each sequence's contiguous query tokens into blocks of <= block_q tokens.

    Returns (NB static) s_b [NB], t0 [NB], n_b [NB] and per-token block index / row offset [T].
    """
    t = q_seq.shape[0]
    nb = min(t, pl.cdiv(t, block_q) + num_seqs)
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    tok = jnp.arange(t, dtype=jnp.int32)
    member = q_seq[None, :] == seqs[:, None]                         # [S, T]
    q_len = jnp.sum(member, axis=1).astype(jnp.int32)
    q_start = jnp.min(jnp.where(member, tok[None, :], t), axis=1).astype(jnp.int32)
    nbs = (q_len + block_q - 1) // block_q
    cum = jnp.cumsum(nbs)
    blk_start = cum - nbs
    b = jnp.arange(nb, dtype=jnp.int32)
    s_b = jnp.minimum(jnp.searchsorted(cum, b, side="right"), num_seqs - 1).astype(jnp.int32)
    local = b - blk_start[s_b]
    t0 = jnp.minimum(q_start[s_b] + local * block_q, t - 1)
    n_b = jnp.where(b < cum[-1], jnp.clip(q_len[s_b] - local * block_q, 0, block_q), 0)
    # inverse map for the output gather
    s_t = jnp.clip(q_seq, 0, num_seqs - 1)
    rel = tok - q_start[s_t]
    tok_block = jnp.clip(blk_start[s_t] + rel // block_q, 0, nb - 1)
    tok_row = rel % block_q
    return s_b, t0, n_b, tok_block, tok_row


def _page_ranges(slot_pos, page_table, lengths, sink, window, s_b, qmin, qmax, n_b, ordered: bool):
    """Per (block, head): (nsc, w0, nv) virtual page range, see kernel.py."""
    s, hkv, mp = page_table.shape
    page_size = slot_pos.shape[1]
    lens = lengths[s_b]                                               # [NB, Hkv]
    npg = (lens + page_size - 1) // page_size
    if not ordered:
        zero = jnp.zeros_like(npg)
        return zero, zero, jnp.where(n_b[:, None] > 0, npg, 0)
    # first stored position of every page, +inf past the head's used pages (sorted when ordered)
    first = slot_pos[jnp.maximum(page_table, 0), 0]                    # [S, Hkv, MP]
    used = jnp.arange(mp)[None, None, :] < ((lengths + page_size - 1) // page_size)[..., None]
    first = jnp.where(used, first, _INT_MAX)
    is_local = window > 0                                             # [Hkv]
    wstart = qmin[:, None] - window[None, :] + 1                      # [NB, Hkv]

    def count(row_fn, values, side):
        # rows of `first` per (s, h) searched with the values of every block, then picked per block
        per_sh = jax.vmap(jax.vmap(lambda r, v: jnp.searchsorted(r, v, side=side), (0, 1)), (0, None))(
            first, values)                                            # [S, Hkv, NB]
        return per_sh[s_b, :, jnp.arange(s_b.shape[0])]              # [NB, Hkv]

    hi = jnp.minimum(count(None, jnp.broadcast_to(qmax[:, None], wstart.shape), "right"), npg)
    ns = count(None, jnp.broadcast_to(sink[None, :], wstart.shape), "left")
    wl = jnp.maximum(count(None, wstart, "left") - 1, 0)
    nsc = jnp.where(is_local, jnp.minimum(ns, hi), 0)
    w0 = jnp.where(is_local, jnp.maximum(wl, nsc), 0)
    nv = nsc + jnp.maximum(hi - w0, 0)
    return nsc, w0, jnp.where(n_b[:, None] > 0, nv, 0)


def default_config(num_tokens: int, num_seqs: int, num_kv_heads: int, max_pages: int, page_size: int):
    """Heuristic block config: (block_q, num_splits, pages_per_block)."""
    decode = num_tokens <= num_seqs
    block_q = 1 if decode else 16
    ppb = max(1, 128 // page_size) if decode else max(1, 64 // page_size)
    nb = min(num_tokens, pl.cdiv(num_tokens, block_q) + num_seqs)
    want = pl.cdiv(4 * 132, max(1, nb * num_kv_heads))              # ~4 programs per H200 SM
    num_splits = int(max(1, min(want, pl.cdiv(max_pages, ppb), 64)))
    return block_q, num_splits, ppb


@functools.partial(jax.jit, static_argnames=("scale", "ordered", "block_q", "num_splits", "pages_per_block",
                                             "interpret", "num_warps", "num_stages"))
def paged_attention_pallas(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                           scale, ordered=False, block_q=None, num_splits=None, pages_per_block=None,
                           interpret=False, num_warps=4, num_stages=2):
    t, hq, d = q.shape
    s, hkv, mp = page_table.shape
    page_size = k_pages.shape[1]
    g = hq // hkv
    cfg = default_config(t, s, hkv, mp, page_size)
    block_q = cfg[0] if block_q is None else block_q
    num_splits = cfg[1] if num_splits is None else num_splits
    ppb = cfg[2] if pages_per_block is None else pages_per_block
    rows = next_pow2(max(16, block_q * g))

    q_seq = jnp.where(q_seq >= 0, q_seq, -1).astype(jnp.int32)
    s_b, t0, n_b, tok_block, tok_row = _query_blocks(q_seq, q_pos, s, block_q)
    r = jnp.arange(rows, dtype=jnp.int32)
    row_tok = r // g
    row_g = r % g
    row_ok = r[None, :] < (n_b * g)[:, None]                          # [NB, R]
    t_idx = jnp.clip(t0[:, None] + row_tok[None, :], 0, t - 1)
    qpos_rows = jnp.where(row_ok, q_pos[t_idx], -1).astype(jnp.int32)
    q4 = q.reshape(t, hkv, g, d)
    q_rows = q4[t_idx, :, jnp.broadcast_to(row_g[None, :], t_idx.shape), :]   # [NB, R, Hkv, D]
    q_rows = jnp.where(row_ok[:, :, None, None], q_rows, 0).transpose(0, 2, 1, 3)

    qmin = q_pos[t0]
    qmax = q_pos[jnp.clip(t0 + n_b - 1, 0, t - 1)]
    nsc, w0, nv = _page_ranges(slot_pos, page_table, lengths, sink, window, s_b, qmin, qmax, n_b, ordered)
    unit = s_b[:, None] * hkv + jnp.arange(hkv, dtype=jnp.int32)[None, :]
    zeros = jnp.zeros_like(unit)
    meta = jnp.stack([unit, lengths[s_b], nsc, w0, nv, jnp.broadcast_to(sink[None], unit.shape),
                      jnp.broadcast_to(window[None], unit.shape), zeros], axis=-1).astype(jnp.int32)
    assert meta.shape[-1] == META_WIDTH

    o_part, l_part = paged_attention_blocks(
        meta, qpos_rows, q_rows, page_table.reshape(-1).astype(jnp.int32), k_pages, v_pages, slot_pos,
        scale=float(scale), num_splits=num_splits, pages_per_block=ppb, max_pages=mp,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    if num_splits > 1:
        o_blk, lse_blk = lse_merge(o_part, l_part, out_dtype=q.dtype,
                                   implementation="pallas", interpret=interpret)
    else:
        o_blk, lse_blk = o_part[0].astype(q.dtype), l_part[0]
    # gather rows back to [T, Hq, D]: row = tok_row * G + g of block tok_block, KV head h
    qh = jnp.arange(hq, dtype=jnp.int32)
    row_idx = tok_row[:, None] * g + (qh % g)[None, :]                 # [T, Hq]
    out = o_blk[tok_block[:, None], (qh // g)[None, :], row_idx]       # [T, Hq, D]
    lse = lse_blk[tok_block[:, None], (qh // g)[None, :], row_idx]
    pad = (q_seq < 0)[:, None]
    return jnp.where(pad[..., None], 0, out).astype(q.dtype), jnp.where(pad, -jnp.inf, lse)


def _reference(*args, **kwargs):
    from pallas_kernels.paged_attention.reference import paged_attention as ref  # the colleague's twin

    return ref(*args, **kwargs)


def paged_attention(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                    scale, implementation: str | None = None, interpret: bool | None = None,
                    ordered: bool = False, block_q: int | None = None, num_splits: int | None = None,
                    pages_per_block: int | None = None):
    """Ragged per-(sequence, KV head) paged attention -> (out [T, Hq, D], lse [T, Hq] float32).

    Arguments as in docs/architecture.md. `ordered=True` promises that each head's slots are stored in
    non-decreasing position order (no ring), letting local heads read only their sink and window pages;
    with `ordered=False` every page up to the head's length is scanned (masking stays exact).
    Fallback order: Pallas on GPU, then the jnp twin.
    """
    args = (q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window)
    impls = {
        "pallas": lambda: paged_attention_pallas(
            *args, scale=scale, ordered=ordered, block_q=block_q, num_splits=num_splits,
            pages_per_block=pages_per_block, interpret=resolve_interpret(interpret)),
        "reference": lambda: _reference(*args, scale=scale),
    }
    return dispatch("paged_attention", implementation, impls)
