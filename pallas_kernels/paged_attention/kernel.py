"""Ragged per-head paged attention, Pallas (Triton lowering on GPU; interpret mode on CPU).

One program = (query block b, KV head h, split k). A query block holds up to `block_q` consecutive
tokens of one sequence; its rows are those tokens x the G query heads of KV head h (padded to a power
of two >= 16 for the MMA). The program walks a *virtual page range* of its (sequence, head) unit:
the sink pages [0, nsc) followed by the window pages [w0, w0 + nv - nsc) (api.py derives both from the
stored first slot position of each page when pages are in position order; otherwise nsc = 0,
w0 = 0 and nv = all pages). Split k takes virtual pages [k*pps, (k+1)*pps), where pps is the unit's own
split size (meta column 7, set by the plan from the unit's page count and the layer's total work, so a head
that holds far less than the page table's capacity, e.g. one compressed by a policy, still spreads over
enough programs).

Keys are gathered slot by slot from the pool viewed flat ([N * P, D], a free reshape outside the kernel):
`k_ref[slot_ids]` is a [block_k, D] tile that feeds the MMA directly, so Triton's pipeliner can turn it
into multi-stage asynchronous copies (the earlier page gather `[ppb, P, D]` + in-register reshape could
not be pipelined).

Split-K: a split with no pages (k > 0 and k * pps >= nv) returns at once and writes nothing; split 0
always writes (0 / -inf for a unit that sees nothing). `merge_splits` then merges, per unit, only its
`max(1, cdiv(nv, pps))` written splits, so local heads (1 split) cost one copy and global heads many.

Compact schedule (`paged_attention_compact`, plan schedule="compact"): instead of the full
(block, head, split) grid, a fixed number of persistent programs walk the plan's list of non-empty
(unit, split) items; single-split units write the final output directly and only multi-split units are
merged (in place). Same `_attend`, same merge arithmetic, so the same bits as the grid schedule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# meta[b, h, :] layout (int32): unit id (s * Hkv + h), length, nsc, w0, nv, sink, window, pps
META_WIDTH = 8
_NEG = -1e30  # finite mask value: keeps m - m_new free of inf - inf when a block is fully masked


def _attend(q, qpos, pt_ref, k_ref, v_ref, pos_ref, *, unit, length, nsc, w0, sink, window, v_lo, v_hi,
            scale: float, page_size: int, ppb: int, max_pages: int, bias_ref=None):
    """Attention of rows q [R, D] (positions qpos [R]) over virtual pages [v_lo, v_hi) of `unit`.
    `bias_ref` (optional, flat [N * P] float32): a logit added to every slot (a merged slot's log mass).

    Returns (out [R, D] float32 normalised, lse [R] float32); rows that see nothing give 0 / -inf."""
    rows, head_dim = q.shape
    bk = ppb * page_size
    tf32 = False if q.dtype == jnp.float32 else None     # fp32 pools (parity runs): exact fp32 products
    kk = lax.broadcasted_iota(jnp.int32, (bk,), 0)
    kk_page = kk // page_size
    kk_off = kk % page_size

    def body(it, carry):
        o, m, lsum = carry
        vk = v_lo + it * ppb + kk_page                                 # virtual page of every key
        jk = jnp.where(vk < nsc, vk, vk - nsc + w0)                    # page index in the unit's list
        okk = (vk < v_hi) & (jk < max_pages)
        page = pt_ref[unit * max_pages + jnp.where(okk, jk, 0)]        # [bk] (same id P times: cached)
        okk = okk & (page >= 0)
        sid = jnp.where(okk, page, 0) * page_size + kk_off             # flat slot id
        k = k_ref[sid]                                                 # [bk, D]
        v = v_ref[sid]
        kpos = pos_ref[sid]                                            # [bk]
        kvalid = okk & (jk * page_size + kk_off < length) & (kpos >= 0)
        v = jnp.where(kvalid[:, None], v, jnp.zeros_like(v))  # stale slots: weight 0 must not meet NaN
        vis = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        local = (kpos[None, :] > qpos[:, None] - window) | (kpos[None, :] < sink)
        vis = vis & ((window == 0) | local)
        s = plt.dot(q, k, trans_b=True, allow_tf32=tf32).astype(jnp.float32) * scale   # [R, bk]
        if bias_ref is not None:
            s = s + bias_ref[sid][None, :]
        s = jnp.where(vis, s, _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = lsum * corr + jnp.sum(p, axis=1)
        o_new = o * corr[:, None] + plt.dot(p.astype(v.dtype), v, allow_tf32=tf32).astype(jnp.float32)
        return o_new, m_new, l_new

    o0 = jnp.zeros((rows, head_dim), jnp.float32)
    m0 = jnp.full((rows,), _NEG, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    n_it = pl.cdiv(jnp.maximum(v_hi - v_lo, 0), ppb)
    o, m, lsum = lax.fori_loop(0, n_it, body, (o0, m0, l0))
    seen = lsum > 0
    denom = jnp.where(seen, lsum, 1.0)
    return jnp.where(seen[:, None], o / denom[:, None], 0.0), jnp.where(seen, m + jnp.log(denom), -jnp.inf)


def _meta_scalars(meta_ref, *idx):
    """unit, length, nsc, w0, nv, sink, window, pps of one (block, head) row of meta (scalar loads)."""
    return [meta_ref[(*idx, i)] for i in range(META_WIDTH)]


def _kernel(meta_ref, qpos_ref, q_ref, pt_ref, k_ref, v_ref, pos_ref, *refs,
            scale: float, page_size: int, ppb: int, max_pages: int, num_splits: int, has_bias: bool):
    bias_ref, (o_ref, lse_ref) = (refs[0], refs[1:]) if has_bias else (None, refs)
    split = pl.program_id(2)
    unit, length, nsc, w0, nv, sink, window, pps = _meta_scalars(meta_ref)
    v_lo = split * pps
    v_hi = jnp.minimum(v_lo + pps, nv)

    def attend():
        o, lse = _attend(q_ref[...], qpos_ref[...], pt_ref, k_ref, v_ref, pos_ref, unit=unit, length=length,
                         nsc=nsc, w0=w0, sink=sink, window=window, v_lo=v_lo, v_hi=v_hi, scale=scale,
                         page_size=page_size, ppb=ppb, max_pages=max_pages, bias_ref=bias_ref)
        o_ref[...] = o.astype(o_ref.dtype)
        lse_ref[...] = lse

    if num_splits == 1:
        attend()
    else:
        pl.when((split == 0) | (v_lo < nv))(attend)   # empty splits exit early and write nothing


def paged_attention_blocks(meta, qpos_rows, q_rows, page_table_flat, k_pages, v_pages, slot_pos, *,
                           scale: float, num_splits: int, pages_per_block: int, max_pages: int,
                           num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                           out_dtype=jnp.float32, block_offset: int = 0, slot_bias=None):
    """Run the kernel over prepared blocks.

    meta [NB, Hkv, 8] int32, qpos_rows [NB, R] int32, q_rows [NB, Hkv, R, D],
    page_table_flat [S * Hkv * max_pages] int32, pools as in the contract (slot_bias [N, P] float32 or None).
    `block_offset` (static): meta and qpos_rows hold several layers' blocks ([L * NB, ...]) and this call
    reads rows block_offset + b; meta's unit column then indexes page_table_flat across layers too, so a
    layer of a multi-layer plan runs without slicing (a sliced custom-call operand is a copy per layer).
    Returns partial out [K, NB, Hkv, R, D] and lse [K, NB, Hkv, R] float32; only the splits
    `k < max(1, cdiv(nv, pps))` of a unit are written (see `merge_splits`); meta's pps column must satisfy
    cdiv(nv, pps) <= num_splits and be a multiple of pages_per_block (`unit_split_pages`).
    """
    nb, hkv, rows, d = q_rows.shape
    n, page_size = slot_pos.shape
    ppb = pages_per_block
    kernel = functools.partial(_kernel, scale=scale, page_size=page_size, ppb=ppb, max_pages=max_pages,
                               num_splits=num_splits, has_bias=slot_bias is not None)
    k_flat = k_pages.reshape(n * page_size, d)
    v_flat = v_pages.reshape(n * page_size, d)
    pos_flat = slot_pos.reshape(n * page_size)
    extra = () if slot_bias is None else (slot_bias.reshape(n * page_size).astype(jnp.float32),)
    full = lambda x: pl.BlockSpec(x.shape, lambda b, h, k: (0,) * x.ndim)
    return pl.pallas_call(
        kernel,
        grid=(nb, hkv, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, META_WIDTH), lambda b, h, k: (b + block_offset, h, 0)),
            pl.BlockSpec((None, rows), lambda b, h, k: (b + block_offset, 0)),
            pl.BlockSpec((None, None, rows, d), lambda b, h, k: (b, h, 0, 0)),
            full(page_table_flat), full(k_flat), full(v_flat), full(pos_flat), *map(full, extra),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda b, h, k: (k, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((num_splits, nb, hkv, rows, d), out_dtype),
                   jax.ShapeDtypeStruct((num_splits, nb, hkv, rows), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxkv_ragged_paged_attention",
    )(meta, qpos_rows, q_rows, page_table_flat, k_flat, v_flat, pos_flat, *extra)


def unit_split_pages(nv, num_splits: int, ppb: int, programs: int):
    """Per-unit split size in pages (a multiple of ppb): the unit's nv pages over at most `num_splits`
    splits, and no smaller than the layer's total pages over `programs`, so short units stay whole and the
    whole layer yields about `programs` items however far below the page table's width the heads are."""
    target = pl.cdiv(jnp.sum(nv), programs)
    pps = jnp.maximum(pl.cdiv(nv, num_splits), target)
    return (jnp.maximum(pl.cdiv(pps, ppb), 1) * ppb).astype(jnp.int32)


def merge_chunk(num_splits: int) -> int:
    """Splits merged per vectorised step: the largest power of two <= MERGE_CHUNK dividing num_splits (the
    chunk loads stay inside the [num_splits, ...] partial buffers)."""
    c = 1
    while c * 2 <= MERGE_CHUNK and num_splits % (c * 2) == 0:
        c *= 2
    return c


MERGE_CHUNK = 8   # a serial loop over 64 splits cost ~15 us per layer for one decode sequence (H200 trace)


def _merge_unit(nsplit, load_l, load_o, rows: int, d: int, chunk: int):
    """Exact LSE merge of splits k < nsplit, `chunk` splits per step: load_l(k0) -> lse [chunk, R],
    load_o(k0) -> out [chunk, R, D]. Unwritten splits (k >= nsplit) hold garbage: selected away, never
    multiplied."""
    kk = lax.broadcasted_iota(jnp.int32, (chunk, rows), 0)

    def body(c, carry):
        m, tot, acc = carry
        k0 = c * chunk
        lk = load_l(k0)                                               # [C, R]
        ok = (k0 + kk < nsplit) & (lk > -jnp.inf)
        lkf = jnp.where(ok, lk, _NEG)
        m_new = jnp.maximum(m, jnp.max(lkf, axis=0))
        a = jnp.exp(m - m_new)
        w = jnp.where(ok, jnp.exp(lkf - m_new[None, :]), 0.0)
        o = load_o(k0).astype(jnp.float32)                            # [C, R, D]
        part = jnp.sum(jnp.where(ok[:, :, None], w[:, :, None] * o, 0.0), axis=0)
        return m_new, tot * a + jnp.sum(w, axis=0), acc * a[:, None] + part

    m0 = jnp.full((rows,), _NEG, jnp.float32)
    m, tot, acc = lax.fori_loop(0, pl.cdiv(nsplit, chunk), body,
                                (m0, jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32)))
    seen = tot > 0
    denom = jnp.where(seen, tot, 1.0)
    return jnp.where(seen[:, None], acc / denom[:, None], 0.0), jnp.where(seen, m + jnp.log(denom), -jnp.inf)


def _merge_kernel(meta_ref, o_ref, l_ref, out_ref, lse_ref):
    nsplit = jnp.maximum(pl.cdiv(meta_ref[4], meta_ref[7]), 1)
    rows, d = out_ref.shape
    c = merge_chunk(o_ref.shape[0])
    out, lse = _merge_unit(nsplit, lambda k: l_ref[pl.ds(k, c)], lambda k: o_ref[pl.ds(k, c)], rows, d, c)
    out_ref[...] = out.astype(out_ref.dtype)
    lse_ref[...] = lse


def merge_splits(meta, o_part, l_part, *, out_dtype, interpret: bool = False, block_offset: int = 0):
    """Merge each unit's written splits: o_part [K, NB, Hkv, R, D] -> out [NB, Hkv, R, D], lse.
    `block_offset`: as in `paged_attention_blocks`."""
    k, nb, hkv, rows, d = o_part.shape
    return pl.pallas_call(
        _merge_kernel,
        grid=(nb, hkv),
        in_specs=[pl.BlockSpec((None, None, META_WIDTH), lambda b, h: (b + block_offset, h, 0)),
                  pl.BlockSpec((k, None, None, rows, d), lambda b, h: (0, b, h, 0, 0)),
                  pl.BlockSpec((k, None, None, rows), lambda b, h: (0, b, h, 0))],
        out_specs=[pl.BlockSpec((None, None, rows, d), lambda b, h: (b, h, 0, 0)),
                   pl.BlockSpec((None, None, rows), lambda b, h: (b, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((nb, hkv, rows, d), out_dtype),
                   jax.ShapeDtypeStruct((nb, hkv, rows), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxkv_paged_attention_merge",
    )(meta, o_part, l_part)


# ---------------------------------------------------------------- compact (work-list) schedule
# The grid schedule launches every (block, head, split) program, and a head-class step leaves most of them
# empty (local heads need one split, global heads all of them; a layer without global heads needs one split
# per unit). The compact schedule launches a fixed number of persistent programs that walk a work list of
# the non-empty (unit, split) items built by the plan (api.py): program p takes items p, p + P, p + 2P, ...
# (the list puts full splits first, so round robin balances). A unit whose pages fit one split writes its
# final output directly; only units with several splits are merged, by a second persistent call over the
# list of those units that updates the output in place (input_output_aliases).


def work_list(meta, active, *, num_splits: int):
    """Non-empty (unit, split) items of the compact schedule, full splits first.

    meta [U, META_WIDTH] (column 7: the unit's split size pps), active [U] bool (unit has queries).
    Returns work [U * K] int32 (item = u * K + k; the first num_work entries are valid), num_work [1],
    merge_units [U] int32 (units with > 1 split, first num_merge entries valid), num_merge [1]."""
    u_n = meta.shape[0]
    nv, pps = meta[:, 4], meta[:, 7]
    nsplit = jnp.maximum(pl.cdiv(nv, pps), 1)
    c = jnp.arange(u_n * num_splits, dtype=jnp.int32)
    u, k = c // num_splits, c % num_splits
    pages = jnp.clip(nv[u] - k * pps[u], 0, pps[u])
    valid = active[u] & (k < nsplit[u])
    heavy = valid & (pages >= pps[u])
    light = valid & ~heavy
    n_heavy = jnp.sum(heavy, dtype=jnp.int32)
    slot = jnp.where(heavy, jnp.cumsum(heavy, dtype=jnp.int32) - 1,
                     n_heavy + jnp.cumsum(light, dtype=jnp.int32) - 1)
    work = jnp.zeros_like(c).at[jnp.where(valid, slot, u_n * num_splits)].set(c, mode="drop")
    multi = active & (nsplit > 1)
    units = jnp.arange(u_n, dtype=jnp.int32)
    mslot = jnp.where(multi, jnp.cumsum(multi, dtype=jnp.int32) - 1, u_n)
    merge_units = jnp.zeros_like(units).at[mslot].set(units, mode="drop")
    return (work, jnp.sum(valid, dtype=jnp.int32)[None], merge_units,
            jnp.sum(multi, dtype=jnp.int32)[None])


def _compact_kernel(work_ref, nwork_ref, meta_ref, qpos_ref, q_ref, pt_ref, k_ref, v_ref, pos_ref, *out_refs,
                    scale: float, page_size: int, ppb: int, max_pages: int, num_splits: int,
                    num_programs: int, hkv: int, has_bias: bool):
    bias_ref, out_refs = (out_refs[0], out_refs[1:]) if has_bias else (None, out_refs)
    out_ref, lse_ref = out_refs[:2]
    p = pl.program_id(0)
    count = pl.cdiv(jnp.maximum(nwork_ref[0] - p, 0), num_programs)

    def item(j, carry):
        w = work_ref[p + j * num_programs]
        u = w // num_splits
        k = w % num_splits
        unit, length, nsc, w0, nv, sink, window, pps = _meta_scalars(meta_ref, u)
        v_lo = k * pps
        o, lse = _attend(q_ref[u], qpos_ref[u // hkv], pt_ref, k_ref, v_ref, pos_ref, unit=unit,
                         length=length, nsc=nsc, w0=w0, sink=sink, window=window, v_lo=v_lo,
                         v_hi=jnp.minimum(v_lo + pps, nv), scale=scale, page_size=page_size, ppb=ppb,
                         max_pages=max_pages, bias_ref=bias_ref)

        def final():
            out_ref[u] = o.astype(out_ref.dtype)
            lse_ref[u] = lse

        if num_splits == 1:
            final()
        else:
            op_ref, lp_ref = out_refs[2:]

            def partial_():
                op_ref[k, u] = o
                lp_ref[k, u] = lse

            single = nv <= pps
            pl.when(single)(final)
            pl.when(jnp.logical_not(single))(partial_)
        return carry

    lax.fori_loop(0, count, item, 0)


def _compact_merge_kernel(mu_ref, nm_ref, meta_ref, o_ref, l_ref, out_in_ref, lse_in_ref, out_ref, lse_ref, *,
                          num_programs: int):
    del out_in_ref, lse_in_ref                          # aliased to out_ref / lse_ref: updated in place
    p = pl.program_id(0)
    count = pl.cdiv(jnp.maximum(nm_ref[0] - p, 0), num_programs)
    _, rows, d = out_ref.shape
    c = merge_chunk(o_ref.shape[0])

    def item(j, carry):
        u = mu_ref[p + j * num_programs]
        nsplit = jnp.maximum(pl.cdiv(meta_ref[u, 4], meta_ref[u, 7]), 1)
        out, lse = _merge_unit(nsplit, lambda k: l_ref[pl.ds(k, c), u], lambda k: o_ref[pl.ds(k, c), u], rows,
                               d, c)
        out_ref[u] = out.astype(out_ref.dtype)
        lse_ref[u] = lse
        return carry

    lax.fori_loop(0, count, item, 0)


def paged_attention_compact(work, num_work, merge_units, num_merge, meta, qpos_rows, q_rows, page_table_flat,
                            k_pages, v_pages, slot_pos, *, scale: float, num_splits: int,
                            pages_per_block: int, max_pages: int, num_programs: int, merge_programs: int,
                            num_warps: int = 4, num_stages: int = 2, interpret: bool = False,
                            out_dtype=jnp.float32, slot_bias=None):
    """Compact schedule: meta [U, 8], qpos_rows [NB, R], q_rows [U, R, D] (U = NB * Hkv, unit-major) and the
    work list of `work_list` -> (out [U, R, D] out_dtype, lse [U, R] float32). Inactive units (no queries)
    are not computed (their rows are left as they are: the caller masks padding tokens)."""
    u_n, rows, d = q_rows.shape
    nb = qpos_rows.shape[0]
    hkv = u_n // nb
    n, page_size = slot_pos.shape
    ppb = pages_per_block
    num_programs = max(1, min(num_programs, u_n * num_splits))
    k_flat = k_pages.reshape(n * page_size, d)
    v_flat = v_pages.reshape(n * page_size, d)
    pos_flat = slot_pos.reshape(n * page_size)
    full = lambda shape: pl.BlockSpec(shape, lambda p: (0,) * len(shape))
    ins = (work, num_work, meta, qpos_rows, q_rows, page_table_flat, k_flat, v_flat, pos_flat)
    if slot_bias is not None:
        ins += (slot_bias.reshape(n * page_size).astype(jnp.float32),)
    out_shape = [jax.ShapeDtypeStruct((u_n, rows, d), out_dtype),
                 jax.ShapeDtypeStruct((u_n, rows), jnp.float32)]
    if num_splits > 1:
        out_shape += [jax.ShapeDtypeStruct((num_splits, u_n, rows, d), jnp.float32),
                      jax.ShapeDtypeStruct((num_splits, u_n, rows), jnp.float32)]
    kernel = functools.partial(_compact_kernel, scale=scale, page_size=page_size, ppb=ppb,
                               max_pages=max_pages, num_splits=num_splits, num_programs=num_programs, hkv=hkv,
                               has_bias=slot_bias is not None)
    res = pl.pallas_call(
        kernel,
        grid=(num_programs,),
        in_specs=[full(x.shape) for x in ins],
        out_specs=[full(o.shape) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxkv_ragged_paged_attention_compact",
    )(*ins)
    if num_splits == 1:
        return res[0], res[1]
    out, lse, o_part, l_part = res
    merge_programs = max(1, min(merge_programs, u_n))
    mins = (merge_units, num_merge, meta, o_part, l_part, out, lse)
    return pl.pallas_call(
        functools.partial(_compact_merge_kernel, num_programs=merge_programs),
        grid=(merge_programs,),
        in_specs=[full(x.shape) for x in mins],
        out_specs=[full(out.shape), full(lse.shape)],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, lse.dtype)],
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxkv_paged_attention_compact_merge",
    )(*mins)
