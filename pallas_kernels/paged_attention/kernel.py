"""Ragged per-head paged attention, Pallas (Triton lowering on GPU; interpret mode on CPU).

One program = (query block b, KV head h, split k). A query block holds up to `block_q` consecutive
tokens of one sequence; its rows are those tokens x the G query heads of KV head h (padded to a power
of two >= 16 for the MMA). The program walks a *virtual page range* of its (sequence, head) unit:
the sink pages [0, nsc) followed by the window pages [w0, w0 + nv - nsc) (api.py derives both from the
stored first slot position of each page when pages are in position order; otherwise nsc = 0,
w0 = 0 and nv = all pages). Split k takes virtual pages [k*pps, (k+1)*pps); partial (out, lse) pairs
are merged by the LSE merge kernel, so a 128K-token global head is spread over many programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# meta[b, h, :] layout (int32): unit id (s * Hkv + h), length, nsc, w0, nv, sink, window, 0
META_WIDTH = 8
_NEG = -1e30  # finite mask value: keeps m - m_new free of inf - inf when a block is fully masked


def _kernel(meta_ref, qpos_ref, q_ref, pt_ref, k_ref, v_ref, pos_ref, o_ref, lse_ref, *,
            scale: float, page_size: int, ppb: int, pps: int, max_pages: int):
    split = pl.program_id(2)
    unit = meta_ref[0]
    length = meta_ref[1]
    nsc = meta_ref[2]
    w0 = meta_ref[3]
    nv = meta_ref[4]
    sink = meta_ref[5]
    window = meta_ref[6]
    v_lo = split * pps
    v_hi = jnp.minimum(v_lo + pps, nv)

    q = q_ref[...]                      # [R, D] storage dtype
    qpos = qpos_ref[...]                # [R] int32, -1 = padding row
    rows, head_dim = q.shape
    bk = ppb * page_size
    kk = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    kk_page = kk // page_size
    kk_off = kk % page_size
    pj = lax.broadcasted_iota(jnp.int32, (ppb,), 0)

    def body(it, carry):
        o, m, lsum = carry
        base = v_lo + it * ppb
        # per page of the block
        vp = base + pj
        jp = jnp.where(vp < nsc, vp, vp - nsc + w0)
        okp = (vp < v_hi) & (jp < max_pages)
        pages = pt_ref[unit * max_pages + jnp.where(okp, jp, 0)]
        pages = jnp.where(okp & (pages >= 0), pages, 0)
        # per key of the block (same arithmetic, no gather)
        vk = base + kk_page
        jk = jnp.where(vk < nsc, vk, vk - nsc + w0)
        slot = jk * page_size + kk_off
        k = k_ref[pages].reshape(bk, head_dim)
        v = v_ref[pages].reshape(bk, head_dim)
        kpos = pos_ref[pages].reshape(bk)
        kvalid = (vk < v_hi) & (slot < length) & (kpos >= 0)
        vis = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        local = (kpos[None, :] > qpos[:, None] - window) | (kpos[None, :] < sink)
        vis = vis & ((window == 0) | local)
        s = plt.dot(q, k, trans_b=True).astype(jnp.float32) * scale       # [R, bk]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = lsum * corr + jnp.sum(p, axis=1)
        o_new = o * corr[:, None] + plt.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return o_new, m_new, l_new

    o0 = jnp.zeros((rows, head_dim), jnp.float32)
    m0 = jnp.full((rows,), _NEG, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    n_it = pl.cdiv(jnp.maximum(v_hi - v_lo, 0), ppb)
    o, m, lsum = lax.fori_loop(0, n_it, body, (o0, m0, l0))
    seen = lsum > 0
    denom = jnp.where(seen, lsum, 1.0)
    o_ref[...] = jnp.where(seen[:, None], o / denom[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(denom), -jnp.inf)


def paged_attention_blocks(meta, qpos_rows, q_rows, page_table_flat, k_pages, v_pages, slot_pos, *,
                           scale: float, num_splits: int, pages_per_block: int, max_pages: int,
                           num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """Run the kernel over prepared blocks.

    meta [NB, Hkv, 8] int32, qpos_rows [NB, R] int32, q_rows [NB, Hkv, R, D],
    page_table_flat [S * Hkv * max_pages] int32, pools as in the contract.
    Returns partial out [K, NB, Hkv, R, D] float32 and lse [K, NB, Hkv, R] float32.
    """
    nb, hkv, rows, d = q_rows.shape
    page_size = k_pages.shape[1]
    ppb = pages_per_block
    pps = pl.cdiv(pl.cdiv(max_pages, num_splits), ppb) * ppb
    kernel = functools.partial(_kernel, scale=scale, page_size=page_size, ppb=ppb, pps=pps,
                               max_pages=max_pages)
    full = lambda x: pl.BlockSpec(x.shape, lambda b, h, k: (0,) * x.ndim)
    return pl.pallas_call(
        kernel,
        grid=(nb, hkv, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, META_WIDTH), lambda b, h, k: (b, h, 0)),
            pl.BlockSpec((None, rows), lambda b, h, k: (b, 0)),
            pl.BlockSpec((None, None, rows, d), lambda b, h, k: (b, h, 0, 0)),
            full(page_table_flat), full(k_pages), full(v_pages), full(slot_pos),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda b, h, k: (k, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((num_splits, nb, hkv, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, nb, hkv, rows), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxkv_ragged_paged_attention",
    )(meta, qpos_rows, q_rows, page_table_flat, k_pages, v_pages, slot_pos)
