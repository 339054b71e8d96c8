"""Attention-score kernel, Pallas (Triton lowering; interpret on CPU).

One program = (sequence s, KV head h, block of `ppb` pages). It loads the block's keys once, then walks
the sequence's window queries `block_t` at a time per query head g of the group: p = exp(q.k * scale -
lse) (lse from paged attention, so no second softmax pass and no [T, L] matrix), column sums per g,
then the GQA reduction (max/mean/sum) before one write of the block's scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(meta_ref, q_ref, lse_ref, qpos_ref, pt_ref, len_ref, sw_ref, k_ref, pos_ref, o_ref, *,
            scale: float, page_size: int, ppb: int, max_pages: int, block_t: int, reduce: str):
    kb = pl.program_id(2)
    q_start = meta_ref[0]
    q_len = meta_ref[1]
    length = len_ref[0]
    sink = sw_ref[0]
    window = sw_ref[1]
    num_groups, _, head_dim = q_ref.shape
    bk = ppb * page_size
    kk = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    j = kb * ppb + lax.broadcasted_iota(jnp.int32, (ppb,), 0)
    pages = pt_ref[jnp.minimum(j, max_pages - 1)]
    pages = jnp.maximum(pages, 0)
    k = k_ref[pages].reshape(bk, head_dim)
    kpos = pos_ref[pages].reshape(bk)
    slot = kb * bk + kk
    kvalid = (slot < length) & (kpos >= 0)
    rows = lax.broadcasted_iota(jnp.int32, (block_t,), 0)

    def body(it, accs):
        t0 = q_start + it * block_t
        qpos = qpos_ref[pl.ds(t0, block_t)]
        rok = (t0 + rows) < (q_start + q_len)
        vis = kvalid[None, :] & rok[:, None] & (kpos[None, :] <= qpos[:, None])
        local = (kpos[None, :] > qpos[:, None] - window) | (kpos[None, :] < sink)
        vis = vis & ((window == 0) | local)
        out = []
        for g in range(num_groups):
            qg = q_ref[g, pl.ds(t0, block_t), :]
            lg = lse_ref[g, pl.ds(t0, block_t)]
            sc = plt.dot(qg, k, trans_b=True).astype(jnp.float32) * scale
            p = jnp.where(vis, jnp.exp(sc - lg[:, None]), 0.0)
            out.append(accs[g] + jnp.sum(p, axis=0))
        return tuple(out)

    zero = tuple(jnp.zeros((bk,), jnp.float32) for _ in range(num_groups))
    n_it = jnp.where(kb * bk < length, pl.cdiv(q_len, block_t), 0)
    accs = lax.fori_loop(0, n_it, body, zero)
    res = accs[0]
    for a in accs[1:]:
        res = jnp.maximum(res, a) if reduce == "max" else res + a
    if reduce == "mean":
        res = res / num_groups
    o_ref[...] = res


@functools.partial(jax.jit, static_argnames=("scale", "reduce", "pages_per_block", "block_t", "interpret"))
def attention_scores_pallas(q, k_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, lse, *,
                            scale, reduce: str = "mean", pages_per_block: int = 8, block_t: int = 16,
                            interpret: bool = False):
    """Pallas version of `reference.attention_scores` (same contract)."""
    t, hq, d = q.shape
    s, hkv, mp = page_table.shape
    p = k_pages.shape[1]
    g = hq // hkv
    ppb = min(pages_per_block, mp)
    mpp = pl.cdiv(mp, ppb) * ppb
    pt = jnp.pad(page_table, ((0, 0), (0, 0), (0, mpp - mp)), constant_values=-1).astype(jnp.int32)
    seqs = jnp.arange(s)
    member = q_seq[None, :] == seqs[:, None]
    q_len = jnp.sum(member, axis=1)
    q_start = jnp.min(jnp.where(member, jnp.arange(t)[None, :], 0 * t + t), axis=1)
    q_start = jnp.where(q_len > 0, q_start, 0)
    meta = jnp.stack([q_start, q_len], axis=1).astype(jnp.int32)       # [S, 2]
    tp = t + block_t
    qh = jnp.pad(q.reshape(t, hkv, g, d).transpose(1, 2, 0, 3), ((0, 0), (0, 0), (0, block_t), (0, 0)))
    lh = lse.astype(jnp.float32).reshape(t, hkv, g).transpose(1, 2, 0)
    lh = jnp.pad(lh, ((0, 0), (0, 0), (0, block_t)))
    lh = jnp.where(jnp.isfinite(lh), lh, 0.0)
    qpos = jnp.pad(q_pos.astype(jnp.int32), (0, block_t), constant_values=-1)
    sw = jnp.stack([sink, window], axis=1).astype(jnp.int32)          # [Hkv, 2]
    full = lambda x: pl.BlockSpec(x.shape, lambda a, b, c: (0,) * x.ndim)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), page_size=p, ppb=ppb, max_pages=mpp, block_t=block_t,
                          reduce=reduce),
        grid=(s, hkv, mpp // ppb),
        in_specs=[pl.BlockSpec((None, 2), lambda a, b, c: (a, 0)),
                  pl.BlockSpec((None, g, tp, d), lambda a, b, c: (b, 0, 0, 0)),
                  pl.BlockSpec((None, g, tp), lambda a, b, c: (b, 0, 0)),
                  full(qpos),
                  pl.BlockSpec((None, None, mpp), lambda a, b, c: (a, b, 0)),
                  pl.BlockSpec((None, None, 1), lambda a, b, c: (a, b, 0)),
                  pl.BlockSpec((None, 2), lambda a, b, c: (b, 0)),
                  full(k_pages), full(slot_pos)],
        out_specs=pl.BlockSpec((None, None, ppb * p), lambda a, b, c: (a, b, c)),
        out_shape=jax.ShapeDtypeStruct((s, hkv, mpp * p), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="jaxkv_attention_scores",
    )(meta, qh, lh, qpos, pt, lengths.reshape(s, hkv, 1).astype(jnp.int32), sw, k_pages, slot_pos)
    return out[:, :, : mp * p]
