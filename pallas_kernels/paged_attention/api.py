"""Public ragged per-head paged attention: `paged_attention(..., implementation=None|"pallas"|"reference")`.

Same arguments and semantics as `reference.paged_attention` (docs/architecture.md); api.py turns the
contract's arguments into the kernel's metadata (query blocks, per-(block, head) virtual page ranges).

The metadata is a `PagedAttentionPlan`: `paged_attention_plan(...)` builds it from everything but q and the
K/V values (for one layer, or for all layers of a step at once with a leading layer axis) and
`paged_attention_with_plan(plan, q, k_pages, v_pages, slot_pos, page_table, scale=...)` runs the kernel on
it, so an engine step pays the metadata once instead of once per layer. `paged_attention` = both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._dispatch import dispatch, next_pow2, resolve_interpret
from pallas_kernels.paged_attention import dense
from pallas_kernels.paged_attention.kernel import (
    MERGE_CHUNK,
    META_WIDTH,
    merge_splits,
    paged_attention_blocks,
    paged_attention_compact,
    unit_split_pages,
    work_list,
)


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


def _search_pages(page_table, slot_pos, s_b, values, npg, side: str):
    """Per (block, head): number of the head's first `npg` pages whose first stored position is < value
    ("left") or <= value ("right"); pages are in position order. An unrolled binary search of gathers
    (one XLA fusion; the earlier vmapped `searchsorted` ran a device while-loop per search)."""
    nb, hkv = values.shape
    mp = page_table.shape[-1]
    hh = jnp.broadcast_to(jnp.arange(hkv, dtype=jnp.int32)[None, :], (nb, hkv))
    ss = jnp.broadcast_to(s_b[:, None], (nb, hkv))
    lo = jnp.zeros((nb, hkv), jnp.int32)
    hi = npg.astype(jnp.int32)
    for _ in range(max(1, int(mp).bit_length())):
        active = lo < hi
        mid = (lo + hi) // 2
        page = page_table[ss, hh, jnp.clip(mid, 0, mp - 1)]
        first = slot_pos[jnp.maximum(page, 0), 0]
        go = (first < values) if side == "left" else (first <= values)
        lo = jnp.where(active & go, mid + 1, lo)
        hi = jnp.where(active & ~go, mid, hi)
    return lo


def _page_ranges(slot_pos, page_table, lengths, sink, window, s_b, qmin, qmax, n_b, ordered: bool):
    """Per (block, head): (nsc, w0, nv) virtual page range, see kernel.py."""
    page_size = slot_pos.shape[1]
    lens = lengths[s_b]                                               # [NB, Hkv]
    npg = (lens + page_size - 1) // page_size
    if not ordered:
        zero = jnp.zeros_like(npg)
        return zero, zero, jnp.where(n_b[:, None] > 0, npg, 0)
    is_local = window > 0                                             # [Hkv]
    wstart = qmin[:, None] - window[None, :] + 1                      # [NB, Hkv]
    count = functools.partial(_search_pages, page_table, slot_pos, s_b, npg=npg)
    hi = count(jnp.broadcast_to(qmax[:, None], wstart.shape), side="right")
    ns = count(jnp.broadcast_to(sink[None, :], wstart.shape), side="left")
    wl = jnp.maximum(count(wstart, side="left") - 1, 0)
    nsc = jnp.where(is_local, jnp.minimum(ns, hi), 0)
    w0 = jnp.where(is_local, jnp.maximum(wl, nsc), 0)
    nv = nsc + jnp.maximum(hi - w0, 0)
    return nsc, w0, jnp.where(n_b[:, None] > 0, nv, 0)


def default_config(num_tokens: int, num_seqs: int, num_kv_heads: int, max_pages: int, page_size: int):
    """Heuristic block config: (block_q, num_splits, pages_per_block).

    Decode: DECODE_KEYS keys per inner step; splits of ~SPLIT_KEYS keys (at least ~4 programs per H200 SM over
    all units). Empty splits exit at once and are never merged, so a generous split count costs local
    heads (whose sink + window range fits one split) almost nothing while global heads spread out.
    Prefill of one sequence (a reuse pass, a fresh prompt viewed as pages): its query blocks already fill
    the GPU, so splits are only added to reach ~4 programs per SM; splitting by keys as well only adds the
    merge's partials (H200, 5K sparse rows over 33K keys: 10.8 -> 9.0 ms at D 128, 7.5 -> 6.7 at D 64,
    measured by a sweep of the launch configurations). Batches of several sequences keep the key splits: a
    decode row inside a prefill-mode call must not walk a long context in one program.
    """
    decode = num_tokens <= num_seqs
    block_q = 1 if decode else 16
    ppb = max(1, (DECODE_KEYS if decode else PREFILL_KEYS) // page_size)
    nb = num_tokens if block_q == 1 else min(num_tokens, pl.cdiv(num_tokens, block_q) + num_seqs)
    by_keys = pl.cdiv(max_pages * page_size, SPLIT_KEYS)
    by_occupancy = pl.cdiv(4 * 132, max(1, nb * num_kv_heads))
    if not decode and num_seqs == 1:
        by_keys = 1
    num_splits = int(max(1, min(max(by_keys, by_occupancy), pl.cdiv(max_pages, ppb), 64)))
    if num_splits > MERGE_CHUNK:   # a multiple of the merge's vectorised chunk (33 splits would merge 1 by 1)
        num_splits = min(64, pl.cdiv(num_splits, MERGE_CHUNK) * MERGE_CHUNK)
    return block_q, num_splits, ppb


DECODE_KEYS = 128    # keys per inner iteration for decode
SPLIT_KEYS = 4096    # keys per split-K program for decode (H200 sweep, docs/kernels.md)
SPLIT_PROGRAMS = 4 * 132   # per layer, split units down to ~this many items (4 per H200 SM; unit_split_pages)
DECODE_LAUNCH = (4, 2)     # (num_warps, num_stages) for block_q == 1
PREFILL_LAUNCH = (4, 3)
PREFILL_KEYS = 32    # keys per inner iteration for prefill (block_q 16 -> 64 rows)
# "compact" (persistent programs over non-empty items) timed within +-3% of it on the H200
DEFAULT_SCHEDULE = "grid"
COMPACT_PROGRAMS = 4 * 132   # persistent attention programs (H200: 132 SMs)
COMPACT_MERGE_PROGRAMS = 132


@dataclasses.dataclass(frozen=True)
class PagedAttentionPlan:
    """Everything a paged-attention call needs that depends on neither q nor the K/V values.

    Built by `paged_attention_plan` once per engine step (for all layers at once when given a leading layer
    axis) and consumed by `paged_attention_with_plan`. A pytree: the arrays are leaves (with a leading layer
    axis when `num_layers` is set; `plan.layer(l)` indexes one layer, `l` may be traced), the launch
    configuration is static aux data.

    meta       [NB, Hkv, META_WIDTH] int32  per (query block, KV head): unit, length, page range, sink, window
    qpos_rows  [NB, R] int32                query position of each kernel row (-1 = padding row)
    row_tok    [NB, R] int32                prefill: token of each row (-1 = none); decode: [T, 0] (unused)
    out_block  [T] int32                    prefill: block of each token; decode: [0] (unused)
    out_row    [T] int32                    prefill: row offset (in tokens) of each token in its block
    pad        [T] bool                     padding tokens (q_seq < 0): out 0, lse -inf
    work, num_work, merge_units, num_merge  compact schedule only (kernel.work_list; [0]-sized for "grid")

    schedule: "grid" launches every (block, head, split) program (empty splits exit at once) and merges
    every unit; "compact" launches `num_programs` persistent programs over the non-empty items only, writes
    single-split units directly and merges only the others (kernel.py).
    """

    meta: jax.Array
    qpos_rows: jax.Array
    row_tok: jax.Array
    out_block: jax.Array
    out_row: jax.Array
    pad: jax.Array
    work: jax.Array
    num_work: jax.Array
    merge_units: jax.Array
    num_merge: jax.Array
    num_q_heads: int
    block_q: int
    rows: int
    num_splits: int
    pages_per_block: int
    max_pages: int
    num_warps: int
    num_stages: int
    schedule: str = "grid"
    num_programs: int = 0
    num_layers: int | None = None
    # Multi-layer plans: units per layer (S * Hkv). Layer l's meta unit column is l * units_per_layer +
    # s * Hkv + h, a row of the layer-major page table [L, S, Hkv, MP] flattened (paged_attention_with_plan
    # with `layer=`); `layer()` maps it back to s * Hkv + h for a one-layer table.
    units_per_layer: int = 0

    def layer(self, index) -> PagedAttentionPlan:
        """The plan of one layer of a multi-layer plan (`index` may be a traced scalar)."""
        if self.num_layers is None:
            raise ValueError("layer() needs a multi-layer plan (planned with a leading layer axis)")
        one = jax.tree.map(lambda x: x[index], self)
        meta = one.meta.at[..., 0].add(-index * self.units_per_layer)
        return dataclasses.replace(one, meta=meta, num_layers=None, units_per_layer=0)


_PLAN_DATA = ("meta", "qpos_rows", "row_tok", "out_block", "out_row", "pad", "work", "num_work",
              "merge_units", "num_merge")
jax.tree_util.register_dataclass(
    PagedAttentionPlan, data_fields=list(_PLAN_DATA),
    meta_fields=[f.name for f in dataclasses.fields(PagedAttentionPlan) if f.name not in _PLAN_DATA])


@functools.partial(jax.jit, static_argnames=("num_q_heads", "ordered", "block_q", "num_splits",
                                             "pages_per_block", "num_warps", "num_stages", "schedule",
                                             "num_programs"))
def paged_attention_plan(slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *, num_q_heads: int,
                         ordered: bool, block_q: int | None = None, num_splits: int | None = None,
                         pages_per_block: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, schedule: str | None = None,
                         num_programs: int | None = None) -> PagedAttentionPlan:
    """Per-step metadata of `paged_attention` (arguments as there; nothing here reads q or K/V values).

    One layer: page_table [S, Hkv, MP], lengths [S, Hkv], sink / window [Hkv]. Several layers at once:
    page_table [L, S, Hkv, MP], lengths [L, S, Hkv], sink / window [L, Hkv] (q_seq, q_pos and the pool's
    slot_pos are shared) -> a plan with a leading layer axis; index it with `plan.layer(l)`. The launch
    configuration (block_q, num_splits, pages_per_block) depends only on shapes, so it is shared by all
    layers. slot_pos must already hold this step's positions (the page search reads each page's first
    stored position). `schedule` ("grid" | "compact", default DEFAULT_SCHEDULE) and `num_programs` (compact
    only, default COMPACT_PROGRAMS) pick the launch, see PagedAttentionPlan.
    """
    multi = page_table.ndim == 4
    s, hkv, mp = page_table.shape[-3:]
    t = q_seq.shape[0]
    if num_q_heads % hkv:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num kv heads {hkv}")
    g = num_q_heads // hkv
    page_size = slot_pos.shape[1]
    cfg = default_config(t, s, hkv, mp, page_size)
    block_q = cfg[0] if block_q is None else block_q
    launch = DECODE_LAUNCH if block_q == 1 else PREFILL_LAUNCH
    schedule = DEFAULT_SCHEDULE if schedule is None else schedule
    if schedule not in ("grid", "compact"):
        raise ValueError(f"schedule must be 'grid' or 'compact', got {schedule!r}")
    static = dict(num_q_heads=num_q_heads, block_q=block_q, rows=next_pow2(max(16, block_q * g)),
                  num_splits=cfg[1] if num_splits is None else num_splits,
                  pages_per_block=cfg[2] if pages_per_block is None else pages_per_block, max_pages=mp,
                  num_warps=launch[0] if num_warps is None else num_warps,
                  num_stages=launch[1] if num_stages is None else num_stages, schedule=schedule,
                  num_programs=(num_programs or COMPACT_PROGRAMS) if schedule == "compact" else 0)
    one = functools.partial(_plan_arrays, slot_pos, q_seq=q_seq, q_pos=q_pos, g=g, block_q=block_q,
                            rows=static["rows"], ordered=ordered, compact=schedule == "compact",
                            num_splits=static["num_splits"], ppb=static["pages_per_block"])
    if multi:
        arrays = jax.vmap(lambda pt, ln, sk, wd: one(pt, ln, sink=sk, window=wd))(
            page_table, lengths, sink, window)
        n_layers = page_table.shape[0]
        offset = (jnp.arange(n_layers, dtype=jnp.int32) * (s * hkv))[:, None, None]
        meta = arrays[0].at[..., 0].add(offset)
        return PagedAttentionPlan(meta, *arrays[1:], **static, num_layers=n_layers, units_per_layer=s * hkv)
    return PagedAttentionPlan(*one(page_table, lengths, sink=sink, window=window), **static)


def _plan_arrays(slot_pos, page_table, lengths, *, q_seq, q_pos, sink, window, g, block_q, rows, ordered,
                 compact, num_splits, ppb):
    """One layer's plan arrays (see PagedAttentionPlan)."""
    t = q_seq.shape[0]
    s, hkv, mp = page_table.shape
    q_seq = jnp.where(q_seq >= 0, q_seq, -1).astype(jnp.int32)
    q_pos = q_pos.astype(jnp.int32)
    sink = sink.astype(jnp.int32)
    window = window.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    pad = q_seq < 0
    r = jnp.arange(rows, dtype=jnp.int32)
    if block_q == 1:
        # decode fast path: one block per token, rows = the G query heads of a KV head (no block search)
        s_b = jnp.clip(q_seq, 0, s - 1)
        n_b = (q_seq >= 0).astype(jnp.int32)
        qpos_rows = jnp.where((r[None, :] < g) & (n_b[:, None] > 0), q_pos[:, None], -1)
        qmin = qmax = q_pos
        row_tok = jnp.zeros((t, 0), jnp.int32)
        out_block = out_row = jnp.zeros((0,), jnp.int32)
    else:
        s_b, t0, n_b, out_block, out_row = _query_blocks(q_seq, q_pos, s, block_q)
        row_ok = r[None, :] < (n_b * g)[:, None]                      # [NB, R]
        t_idx = jnp.clip(t0[:, None] + (r // g)[None, :], 0, t - 1)
        qpos_rows = jnp.where(row_ok, q_pos[t_idx], -1).astype(jnp.int32)
        row_tok = jnp.where(row_ok, t_idx, -1).astype(jnp.int32)
        qmin = q_pos[t0]
        qmax = q_pos[jnp.clip(t0 + n_b - 1, 0, t - 1)]
    nsc, w0, nv = _page_ranges(slot_pos, page_table, lengths, sink, window, s_b, qmin, qmax, n_b, ordered)
    unit = s_b[:, None] * hkv + jnp.arange(hkv, dtype=jnp.int32)[None, :]
    pps = unit_split_pages(nv, num_splits, ppb, SPLIT_PROGRAMS)
    meta = jnp.stack([unit, lengths[s_b], nsc, w0, nv, jnp.broadcast_to(sink[None], unit.shape),
                      jnp.broadcast_to(window[None], unit.shape), pps], axis=-1).astype(jnp.int32)
    assert meta.shape[-1] == META_WIDTH
    if compact:
        active = jnp.broadcast_to((n_b > 0)[:, None], unit.shape).reshape(-1)
        work = work_list(meta.reshape(-1, META_WIDTH), active, num_splits=num_splits)
    else:
        work = tuple(jnp.zeros((0,), jnp.int32) for _ in range(4))
    return (meta, qpos_rows.astype(jnp.int32), row_tok, out_block, out_row, pad, *work)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "layer"))
def paged_attention_with_plan(plan: PagedAttentionPlan, q, k_pages, v_pages, slot_pos, page_table, *, scale,
                              interpret: bool | None = None, layer: int | None = None, slot_bias=None):
    """Run the kernel on a one-layer plan: q [T, Hq, D], this layer's page_table [S, Hkv, MP] and the pool.
    Or on layer `layer` (a static int) of a multi-layer plan with the whole layer-major page_table
    [L, S, Hkv, MP]: the grid schedule then reads that layer's metadata and page-table rows in place (no
    per-layer slice copies: ~1.6 us each, two or three per layer, on an H200 decode step).
    `slot_bias` [N, P] float32 (optional): a logit added to each slot (`KVPool.bias`, merged tokens).

    -> (out [T, Hq, D] in q.dtype, lse [T, Hq] float32), the same as `paged_attention` with the plan's
    arguments.
    """
    block_offset = 0
    if plan.num_layers is not None:
        if layer is None:
            raise ValueError("multi-layer plan: pass plan.layer(l), or layer=l with the whole page table")
        if page_table.ndim != 4 or page_table.shape[0] != plan.num_layers:
            raise ValueError(f"layer=: page_table must be layer-major [L={plan.num_layers}, S, Hkv, MP], "
                             f"got {page_table.shape}")
        if plan.schedule != "grid":
            return paged_attention_with_plan(plan.layer(layer), q, k_pages, v_pages, slot_pos,
                                             page_table[layer], scale=scale, interpret=interpret,
                                             slot_bias=slot_bias)
        nb = plan.meta.shape[1]
        block_offset = layer * nb
        sliced = jax.tree.map(lambda x: x[layer], plan)   # what XLA ops read (fused), not kernel operands
        plan = dataclasses.replace(sliced, meta=plan.meta.reshape(-1, *plan.meta.shape[2:]),
                                   qpos_rows=plan.qpos_rows.reshape(-1, plan.qpos_rows.shape[-1]),
                                   num_layers=None)
        page_table = page_table.reshape(-1, *page_table.shape[2:])   # [L * S, Hkv, MP]: flat rows = units
    elif layer is not None:
        raise ValueError("layer= needs a multi-layer plan")
    t, hq, d = q.shape
    s, hkv, mp = page_table.shape
    if hq != plan.num_q_heads or mp != plan.max_pages:
        raise ValueError(f"plan was built for {plan.num_q_heads} query heads / {plan.max_pages} pages, "
                         f"got q {q.shape} and page_table {page_table.shape}")
    g = hq // hkv
    rows = plan.rows
    if plan.block_q == 1:
        q_rows = jnp.pad(q.reshape(t, hkv, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    else:
        row_g = jnp.arange(rows, dtype=jnp.int32) % g
        t_idx = jnp.maximum(plan.row_tok, 0)
        q4 = q.reshape(t, hkv, g, d)
        q_rows = q4[t_idx, :, jnp.broadcast_to(row_g[None, :], t_idx.shape), :]   # [NB, R, Hkv, D]
        q_rows = jnp.where((plan.row_tok >= 0)[:, :, None, None], q_rows, 0).transpose(0, 2, 1, 3)
    if plan.schedule == "compact":
        nb = plan.meta.shape[0]
        out, lse = paged_attention_compact(
            plan.work, plan.num_work, plan.merge_units, plan.num_merge, plan.meta.reshape(nb * hkv, -1),
            plan.qpos_rows, q_rows.reshape(nb * hkv, rows, d), page_table.reshape(-1).astype(jnp.int32),
            k_pages, v_pages, slot_pos, scale=float(scale), num_splits=plan.num_splits,
            pages_per_block=plan.pages_per_block, max_pages=mp, num_programs=plan.num_programs,
            merge_programs=COMPACT_MERGE_PROGRAMS, num_warps=plan.num_warps, num_stages=plan.num_stages,
            interpret=resolve_interpret(interpret), out_dtype=q.dtype, slot_bias=slot_bias)
        o_blk, lse_blk = out.reshape(nb, hkv, rows, d), lse.reshape(nb, hkv, rows)
    else:
        o_blk, lse_blk = _run(plan.meta, plan.qpos_rows, q_rows, page_table, k_pages, v_pages, slot_pos,
                              scale=scale, num_splits=plan.num_splits, ppb=plan.pages_per_block,
                              num_warps=plan.num_warps, num_stages=plan.num_stages,
                              interpret=resolve_interpret(interpret), out_dtype=q.dtype,
                              block_offset=block_offset, slot_bias=slot_bias)
    pad = plan.pad
    if plan.block_q == 1:
        out = o_blk[:, :, :g].reshape(t, hq, d)
        lse = lse_blk[:, :, :g].reshape(t, hq)
    else:
        # rows back to [T, Hq, D]: row = out_row * G + g of block out_block, KV head h
        qh = jnp.arange(hq, dtype=jnp.int32)
        row_idx = plan.out_row[:, None] * g + (qh % g)[None, :]      # [T, Hq]
        out = o_blk[plan.out_block[:, None], (qh // g)[None, :], row_idx]
        lse = lse_blk[plan.out_block[:, None], (qh // g)[None, :], row_idx]
    return jnp.where(pad[:, None, None], 0, out).astype(q.dtype), jnp.where(pad[:, None], -jnp.inf, lse)


@functools.partial(jax.jit, static_argnames=("scale", "ordered", "block_q", "num_splits", "pages_per_block",
                                             "interpret", "num_warps", "num_stages", "schedule"))
def paged_attention_pallas(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                           scale, ordered=False, block_q=None, num_splits=None, pages_per_block=None,
                           interpret=False, num_warps=None, num_stages=None, schedule=None, slot_bias=None):
    plan = paged_attention_plan(slot_pos, page_table, lengths, q_seq, q_pos, sink, window,
                                num_q_heads=q.shape[1], ordered=ordered, block_q=block_q,
                                num_splits=num_splits, pages_per_block=pages_per_block, num_warps=num_warps,
                                num_stages=num_stages, schedule=schedule)
    return paged_attention_with_plan(plan, q, k_pages, v_pages, slot_pos, page_table, scale=scale,
                                     interpret=interpret, slot_bias=slot_bias)


def _run(meta, qpos_rows, q_rows, page_table, k_pages, v_pages, slot_pos, *, scale, num_splits, ppb,
         num_warps, num_stages, interpret, out_dtype, block_offset: int = 0, slot_bias=None):
    """Attention kernel + per-unit merge of the written splits -> (out [NB, Hkv, R, D], lse [NB, Hkv, R])."""
    mp = page_table.shape[-1]
    kw = dict(scale=float(scale), num_splits=num_splits, pages_per_block=ppb, max_pages=mp,
              num_warps=num_warps, num_stages=num_stages, interpret=interpret, block_offset=block_offset,
              slot_bias=slot_bias)
    pt_flat = page_table.reshape(-1).astype(jnp.int32)
    if num_splits == 1:
        o, l_ = paged_attention_blocks(meta, qpos_rows, q_rows, pt_flat, k_pages, v_pages, slot_pos,
                                       out_dtype=out_dtype, **kw)
        return o[0], l_[0]
    o_part, l_part = paged_attention_blocks(meta, qpos_rows, q_rows, pt_flat, k_pages, v_pages, slot_pos,
                                            **kw)
    return merge_splits(meta, o_part, l_part, out_dtype=out_dtype, interpret=interpret,
                        block_offset=block_offset)


def _reference(*args, **kwargs):
    from pallas_kernels.paged_attention.reference import paged_attention as ref  # the colleague's twin

    return ref(*args, **kwargs)


def paged_attention(q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, *,
                    scale, implementation: str | None = None, interpret: bool | None = None,
                    ordered: bool = False, block_q: int | None = None, num_splits: int | None = None,
                    pages_per_block: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, slot_bias=None):
    """Ragged per-(sequence, KV head) paged attention -> (out [T, Hq, D], lse [T, Hq] float32).

    Arguments as in docs/architecture.md; `slot_bias` [N, P] float32 (optional) is added to every slot's
    logit (`KVPool.bias`: a merged slot stands for several tokens). `ordered=True` promises that each
    head's slots are stored in non-decreasing position order (no ring), letting local heads read only their
    sink and window pages;
    with `ordered=False` every page up to the head's length is scanned (masking stays exact).
    `implementation=None`: the Pallas kernel on a GPU; elsewhere "dense" (dense.py: matrix products per
    sequence, query block and tile) when the step's query rows times one tile fit `dense.MAX_SCORES`, else
    the jnp twin ("reference").
    """
    args = (q, k_pages, v_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window)
    if implementation is None and jax.default_backend() != "gpu":
        fits = dense.fits(q.shape[0], q.shape[1], page_table.shape[-1], k_pages.shape[1])
        implementation = "dense" if fits else "reference"
    impls = {
        "pallas": lambda: paged_attention_pallas(
            *args, scale=scale, ordered=ordered, block_q=block_q, num_splits=num_splits,
            pages_per_block=pages_per_block, interpret=resolve_interpret(interpret), num_warps=num_warps,
            num_stages=num_stages, slot_bias=slot_bias),
        "reference": lambda: _reference(*args, scale=scale, slot_bias=slot_bias),
        "dense": lambda: dense.paged_attention_dense(*args, scale=scale, slot_bias=slot_bias),
    }
    return dispatch("paged_attention", implementation, impls)
