"""The selection buffer of the shared retrieval methods (SpeContext): each state row's selected K/V of the
layers from the tap on, its refresh by the diff of adjacent selections, the host tier's mirror of the pool
and the progressive offload of older pages to host memory.

A shared method (`RetrievalPolicy.layer_wise` False) reads, in every layer from its tap on, one selection
per (sequence, KV head). Its decode (`jaxkv.engine.retrieval`) either reads those slots in the pool in
place (`selected_slots`, the default without a host tier) or keeps them in a `host_tier.SelBuffer` that
`refresh` brings to each step's selection, loading only what the selection gained, from the host mirror
for positions written before the dispatch (`host_for`, kept current by `mirror`) or from the pool.
`buffer_attention` reads a buffered layer as a page pool. `SelectionBuffers` is the host side the engine's
`Retriever` drives: one buffer per policy, which request each row holds, the mirror, the offload (SpeContext
Alg. 1/2, adapted) and the selection and transfer statistics.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.memory_kinds import host_sharding, to_host
from jaxkv.policies.retrieve import host_tier
from jaxkv.policies.retrieve.base import RetrievalPolicy
from jaxkv.policies.retrieve.host_tier import AVAILABLE as HOST_TIER_AVAILABLE
from pallas_kernels.paged_attention.api import (
    paged_attention,
    paged_attention_plan,
    paged_attention_with_plan,
)


def buffer_view(buf, buf_rows, page_size):
    """The selection buffer as a page pool: page (row, KV head, j) holds slots j * page_size.. of that
    head's W slots (unordered; masked by stored position) -> (page_table [S, Hkv, W / page_size], slot
    positions [pages, page_size], lengths [S, Hkv]); the same for every buffered layer."""
    _, r, hkv, w, _ = buf.shape
    npg = w // page_size
    pid = (buf_rows[:, None, None] * hkv + jnp.arange(hkv)[None, :, None]) * npg + jnp.arange(npg)
    pt = jnp.where(buf_rows[:, None, None] >= 0, pid, -1).astype(jnp.int32)
    return pt, buf.pos.reshape(r * hkv * npg, page_size), jnp.full((buf_rows.shape[0], hkv), w, jnp.int32)


def buffer_attention(q, buf, layer, buf_rows, q_seq, positions, *, page_size, window, scale, attn_impl,
                     plan=None):
    """One decode query per row over the selection buffer of buffered layer `layer` -> (out, lse), read in
    place (`buffer_view`; the layer's own arrays, so no slice operand for XLA to copy). The paged kernel
    reads bf16 K/V with fp32 accumulation (the jnp twin elsewhere, fp32). With `plan` (the step's
    `paged_attention_plan` of the buffer, shared by every buffered layer of this window) the kernel runs
    without re-planning per layer."""
    d = buf.shape[-1]
    pt, slot_pos, lengths = buffer_view(buf, buf_rows, page_size)
    k_pages, v_pages = buf.k[layer].reshape(-1, page_size, d), buf.v[layer].reshape(-1, page_size, d)
    if plan is not None:
        return paged_attention_with_plan(plan, q, k_pages, v_pages, slot_pos, pt, scale=scale)
    hkv = pt.shape[1]
    return paged_attention(q, k_pages, v_pages, slot_pos, pt, lengths, q_seq, positions,
                           jnp.zeros((hkv,), jnp.int32), jnp.full((hkv,), window, jnp.int32), scale=scale,
                           implementation=attn_impl)


def buffer_plan(buf, buf_rows, q_seq, positions, *, page_size, window, num_q_heads):
    pt, slot_pos, lengths = buffer_view(buf, buf_rows, page_size)
    hkv = pt.shape[1]
    return paged_attention_plan(slot_pos, pt, lengths, q_seq, positions, jnp.zeros((hkv,), jnp.int32),
                                jnp.full((hkv,), window, jnp.int32), num_q_heads=num_q_heads, ordered=False)


def refresh(buf, pool, host, page_table, buf_rows, now, live, positions, start, *, page_size, chunk,
            load_kv: bool = True, overlap: int = 0):
    """Brings the buffer rows of the step's sequences to the selection `now` less the current token (always
    its last entry; each layer adds it by the log-sum-exp): plans the diff and loads the lacking rows of
    every buffered layer, from the host mirror for positions written before the dispatch when `host` is
    given, else (and for positions written inside the dispatch) from the device pool. Returns (buf, per-row
    stats [S, 3]: slots selected, of them selected the step before, rows the host loads; rows moved [2]:
    host (padded to whole rounds of `chunk`), device (one round of every entry); pending: with `overlap`
    (> 0 rows, a host tier), the host rows of each buffered layer still to be written
    (`host_tier.start_loads`), else ())."""
    r = buf.pos.shape[0]
    br = jnp.maximum(buf_rows, 0)
    if not load_kv:  # in place (never with a host tier: SelectionBuffers refuses the pair)
        return *_track_inplace(buf, br, at=jnp.where(live, buf_rows, r), now=now, live=live,
                              positions=positions), ()
    pos, held, seen, need, dest = host_tier.plan_resident(buf.held[br], buf.seen[br], now.idx, now.count - 1,
                                                          positions)
    load = need & live[:, None, None]
    old = now.idx < start[:, None, None]
    load_rows = functools.partial(host_tier.load_rows, page_table=page_table, buf_rows=buf_rows, idx=now.idx,
                                  dest=dest, page_size=page_size, chunk=chunk)
    moved_host = moved_dev = jnp.int32(0)
    from_host = jnp.zeros_like(live, jnp.int32)
    pending = ()
    if host is not None:
        if overlap:
            buf, moved_host, pending = host_tier.start_loads(
                buf, host, page_table, buf_rows, now.idx, dest, load & old, page_size=page_size, chunk=chunk,
                first=overlap)
        else:
            buf, moved_host = load_rows(buf, host, load=load & old)
        from_host = jnp.sum(load & old, axis=(-2, -1))
        load = load & ~old
    buf, moved_dev = load_rows(buf, pool, load=load, chunk=None)
    at = jnp.where(live, buf_rows, r)
    buf = dataclasses.replace(buf, pos=buf.pos.at[at].set(pos, mode="drop"),
                              held=buf.held.at[at].set(held, mode="drop"),
                              seen=buf.seen.at[at].set(seen, mode="drop"))
    # The previous step's token was in its selection (forced) and is loaded now: held, for the overlap.
    last = jnp.take_along_axis(now.idx, jnp.maximum(now.count - 2, 0)[..., None], axis=-1)[..., 0]
    prev_tok = (now.count >= 2) & (last == positions[:, None] - 1)
    held = now.count - 1 - jnp.sum(need, -1) + prev_tok
    stats = jnp.stack([jnp.sum(now.count, -1), jnp.sum(held, -1), from_host], -1)
    return buf, stats.astype(jnp.int32), jnp.stack([moved_host, moved_dev]), pending


def _track_inplace(buf, br, at, now, live, positions):
    """In-place reads load nothing, so the buffer only remembers the last selection (ascending, -1 past it)
    for the overlap statistic: one binary search of the new selection in the old, no slot planning
    (`plan_resident`'s sorts and scatters cost 0.07-0.09 ms a step at batch 16 on an H200, for numbers
    only)."""
    big = jnp.iinfo(jnp.int32).max
    b = now.idx.shape[-1]
    n = now.count - 1
    sel = jnp.arange(b) < n[..., None]
    prev = buf.pos[br]
    w = prev.shape[-1]  # the buffer's width (>= b: the budget rounded to whole pages)
    prev = jnp.where(prev >= 0, prev, big)
    at_prev = jnp.minimum(host_tier._search(prev, now.idx), w - 1)
    hit = sel & (jnp.take_along_axis(prev, at_prev, -1) == now.idx)
    last = jnp.take_along_axis(now.idx, jnp.maximum(now.count - 2, 0)[..., None], axis=-1)[..., 0]
    prev_tok = (now.count >= 2) & (last == positions[:, None] - 1)
    held = jnp.sum(hit, -1) + prev_tok  # the previous token was the query then, never in the old selection
    cur = jnp.pad(jnp.where(sel, now.idx, -1)[..., :w], ((0, 0), (0, 0), (0, max(w - b, 0))),
                  constant_values=-1)
    buf = dataclasses.replace(buf, pos=buf.pos.at[at].set(cur, mode="drop"))
    zeros = jnp.zeros_like(live, jnp.int32)
    stats = jnp.stack([jnp.sum(now.count, -1), jnp.sum(held, -1), zeros], -1)
    return buf, stats.astype(jnp.int32), jnp.zeros((2,), jnp.int32)


def selected_slots(page_table, idx, count, live, page_size: int):
    """In-place reads: the flat pool slots of the selection (less the current token, its last entry) in
    every layer from the tap on. page_table [S, Lsel, Hkv, P], idx [S, Hkv, B] positions -> (slots
    [Lsel, S, Hkv, B] (0 past the count), lengths [S, Hkv])."""
    n = jnp.where(live[:, None], count - 1, 0)
    ok = jnp.arange(idx.shape[-1]) < n[..., None]
    p = jnp.where(ok, idx, 0)
    s, hkv = idx.shape[:2]
    si = jnp.arange(s)[:, None, None]
    hi = jnp.arange(hkv)[None, :, None]
    pages = page_table[si, :, hi, p // page_size]                        # [S, Hkv, B, Lsel]
    slots = jnp.where(ok[..., None] & (pages >= 0), pages * page_size + (p % page_size)[..., None], 0)
    return jnp.moveaxis(slots, -1, 0).astype(jnp.int32), n.astype(jnp.int32)


# Buffer slots per selected slot with a host tier unless told otherwise: what left the selection stays until
# its slot is needed (H100, embedded model, batch 16: 11.1x fewer host bytes than re-fetching the selection;
# on an H200: 15.1x at 2 against 2.6x at 1, and 1,476 against 816 tok/s).
DEFAULT_HOST_RESIDENT = 2.0


class SelectionBuffers:
    """Host side of the shared methods' selection buffers: one buffer per policy, the row owners, the host
    mirror and offload, the selection and transfer statistics (options: `RetrievalConfig`)."""

    def __init__(self, engine, params_for, host_tier: bool = False, resident: float | None = None,
                 inplace: bool | None = None, overlap: bool = False, eager: bool = False):
        inplace = not host_tier if inplace is None else inplace
        if resident is None:  # the host tier's default: 2 (11-15x fewer host bytes than 1's 2.6x, and faster)
            resident = DEFAULT_HOST_RESIDENT if host_tier and not inplace else 1.0
        if not isinstance(resident, (int, float)) or isinstance(resident, bool) or not resident >= 1.0:
            raise ValueError("retrieval_resident is buffer slots per selected slot, a number >= 1; "
                             f"got {resident!r}")
        if inplace and host_tier:
            raise ValueError("retrieval_inplace reads the selection from the device pool; the host tier "
                             "needs the selection buffer (retrieval_host_tier=True, retrieval_inplace=False)")
        if inplace and resident != 1.0:
            raise ValueError("retrieval_resident sizes the selection buffer's K/V, which in-place reads do "
                             "not keep: use it with retrieval_host_tier=True (or retrieval_inplace=False)")
        if overlap and not host_tier:
            raise ValueError("retrieval_host_overlap overlaps the host tier's loads with the layers: it "
                             "needs retrieval_host_tier=True")
        self.overlap = bool(overlap)
        if eager and not host_tier:
            raise ValueError("retrieval_host_eager loads every step from the host tier: it needs "
                             "retrieval_host_tier=True")
        # The host tier loads from host memory only for dispatches with a request that has pages there
        # (the progressive offload's); until then the selection is read in place, as without a host tier.
        # `eager`: every dispatch loads its rows from the host mirror (to measure the tier's bytes).
        self.eager = bool(eager)
        self._offloaded: set = set()  # request ids with pages moved to host memory (`offload`)
        self.engine = engine
        self.params_for = params_for  # policy -> its parameter pytree (the tap layer reads it)
        self.resident = float(resident)
        self.inplace = bool(inplace)
        self._buf: dict = {}  # shared policy -> host_tier.SelBuffer: each row's selected K/V of layers tap..
        self._owner: dict = {}  # (policy, row) -> request id whose selection the row's buffer holds
        if host_tier and not HOST_TIER_AVAILABLE:
            raise NotImplementedError("retrieval_host_tier needs jax.experimental.compute_on: the "
                                      "context form compute_on('device_host') or the keyword form "
                                      "(compute_type=, out_memory_spaces=); "
                                      f"jax {jax.__version__} has neither")
        if host_tier and engine.runner.mesh is not None:
            raise ValueError("retrieval_host_tier is not supported with tensor parallelism: its host mirror "
                             "of the pool and its loads are single-device")
        self.host_tier = host_tier
        self._host = None  # (k, v) host mirror of the pool's flat slots, made on first use with host_tier
        # Selection statistics of the shared policies since start (every step after a request's first).
        self.steps = 0  # decode steps that read a selection (per request)
        self.slots_selected = 0  # sum over those steps of selected slots, summed over KV heads
        self.slots_new = 0  # of those, slots not selected the step before (what the buffer's diff loads)
        # Host tier transfers over all selected steps (first ones included), in (sequence, KV head) rows
        # of every buffered layer: moved = load rounds x chunk (padding included), needed = rows the buffer
        # lacked, baseline = selected rows (re-fetching the selection every step).
        self.host_steps = 0
        self.pages_offloaded = 0  # device pages moved to host-only pages by `offload` since start
        self.offload_passes = 0  # calls of `offload` that moved something
        self.host_rows_moved = 0
        self.host_rows_needed = 0
        self.host_rows_baseline = 0

    # ---- buffers, mirror, offload -----------------------------------------------------------------
    def buffer_for(self, policy: RetrievalPolicy):
        """The selection buffer of a shared policy (None for layer-wise ones): Lsel x [rows, Hkv, W, D] with
        W = `resident` x the budget rounded up to whole pages (the buffer is read as a page pool)."""
        if policy.layer_wise:
            return None
        if policy not in self._buf:
            eng, cfg = self.engine, self.engine.runner.cfg
            lsel = cfg.num_layers - policy.tap_layer(self.params_for(policy))
            width = -(-int(np.ceil(self.resident * policy.budget)) // eng.page_size) * eng.page_size
            dim = 0 if self.inplace else cfg.head_dim   # in place: the buffer keeps positions only
            self._buf[policy] = host_tier.init_buffer(lsel, eng.retriever.max_rows, cfg.num_kv_heads,
                                                      width, dim, eng.runner.pool.k.dtype)
        return self._buf[policy]

    def host_for(self, policy: RetrievalPolicy):
        """The pool's host mirror (k, v) [(num_pages + host_pages) * page_size, D] when the host tier serves
        `policy` (host-only pages after the device ones: the offload's)."""
        if not self.host_tier or policy.layer_wise:
            return None
        if self._host is None:  # device pages, then the host-only pages (allocator.host_pages) after them
            pool = self.engine.runner.pool
            d = pool.k.shape[-1]
            extra = getattr(self.engine.allocator, "host_pages", 0) * self.engine.page_size
            if extra:  # made in host memory, then the pool's slots copied in (no device-side padding)
                slots = pool.k.size // d
                blank = np.zeros((slots + extra, d), pool.k.dtype)
                host = [jax.device_put(blank, host_sharding()) for _ in range(2)]
                every = jnp.arange(slots, dtype=jnp.int32)
                self._host = host_tier.mirror_slots(*host, pool.k, pool.v, every)
            else:
                self._host = tuple(to_host(x.reshape(-1, d)) for x in (pool.k, pool.v))
        return self._host

    def offload(self, need: int) -> int:
        """Progressive offload (SpeContext Alg. 1/2, adapted): frees up to `need` device pages by moving
        pages of running shared-retrieval requests to host-only pages (allocator.host_pages), the global
        heads of the layers the selection serves, deepest layer first, oldest pages first; only pages of
        positions every dispatched call has long finished writing (the host mirror holds them). Those heads
        are read only through the selection buffer, whose loads of positions before a dispatch come from the
        mirror through the page table; dense layers, ring heads and the page being written stay on the
        device. Nothing moves back. Returns the device pages freed."""
        eng = self.engine
        alloc, tables, ps = eng.allocator, eng.tables, eng.page_size
        if not self.host_tier or need <= 0 or alloc.num_free_host == 0:
            return 0
        # A decoding request's slots not yet dispatched are at most one call's (decode_steps), one more call
        # may be in flight, and the page being written stays: positions before num_computed - margin are
        # written and mirrored by calls dispatched before this one.
        margin = 2 * eng.decode_steps + ps
        per_layer: dict[int, list] = {}  # layer -> [(request id, flat lh [n], j [n])]
        glob = ~tables.local  # [L, H]
        L, H = tables.num_layers, tables.num_kv_heads
        for req in eng.scheduler.running:
            pol = req.kv_policy
            if getattr(pol, "kind", None) != "retrieval" or pol.layer_wise \
                    or req.num_computed <= len(req.prompt_ids):
                continue
            first = pol.tap_layer(self.params_for(pol))
            self.host_for(pol)
            safe = max(0, (req.num_computed - margin) // ps)  # pages [0, safe): positions long dispatched
            if safe == 0:
                continue
            table = tables._get(req.request_id).table  # [L, H, cap]
            for layer in range(L - 1, first - 1, -1):
                h, j = np.nonzero(glob[layer][:, None] & (table[layer, :, :safe] >= 0)
                                  & (table[layer, :, :safe] < alloc.num_pages))
                order = np.lexsort((h, j))  # oldest pages first, over the layer's heads
                h, j = h[order], j[order]
                if h.size:
                    per_layer.setdefault(layer, []).append((req.request_id, layer * H + h, j))
        freed, moves = 0, []
        for layer in sorted(per_layer, reverse=True):
            for rid, lh, j in per_layer[layer]:
                n = min(lh.size, need - freed, alloc.num_free_host)
                if n <= 0:
                    break
                lh, j = lh[:n], j[:n]
                seq = tables._get(rid)
                old = seq.table.reshape(L * H, -1)[lh, j]
                keep = alloc.refcount(old) == 1  # a shared page stays where it is
                lh, j, old = lh[keep], j[keep], old[keep]
                if not old.size:
                    continue
                new = alloc.allocate_host(old.size)
                moves.append((old, new))
                self._offloaded.add(rid)
                tables.replace_pages(rid, lh, j, new)
                alloc.decref(old)   # reused only by later dispatches, which the copy below precedes
                freed += int(old.size)
                self.pages_offloaded += int(old.size)
        if moves:   # one host copy for the whole pass
            self.offload_passes += 1
            rows = np.arange(ps, dtype=np.int32)
            old, new = (np.concatenate(x) for x in zip(*moves))
            src = (old[:, None] * ps + rows).reshape(-1)
            # Power-of-two row counts: a few compiled copies, not one per page count (padding: dropped).
            size = 1 << max(6, int(src.size - 1).bit_length())
            dst = np.full(size, self._host[0].shape[0], np.int32)
            dst[:src.size] = (new[:, None] * ps + rows).reshape(-1)
            src = jnp.asarray(np.pad(src, (0, size - src.size)))
            self._host = host_tier.move_host_rows(*self._host, src, jnp.asarray(dst))
        return freed

    def mirror(self, slots) -> None:
        """Copies the pool slots a retrieval call just wrote into the host mirror (when there is one)."""
        if self._host is not None:
            pool = self.engine.runner.pool
            self._host = host_tier.mirror_slots(*self._host, pool.k, pool.v, jnp.asarray(slots))

    def chunk(self, policy: RetrievalPolicy, num_seqs: int) -> int:
        """Rows per host load round of the buffer's diff (static): a fraction of the batch's selection."""
        return max(1, num_seqs * self.engine.runner.cfg.num_kv_heads * policy.budget // host_tier.HOST_SPLIT)

    def overlap_rows(self, policy: RetrievalPolicy, num_seqs: int) -> int:
        """Host rows per step gathered per layer beside the layers before it (0: no overlap): the first
        `host_tier.OVERLAP_ROUNDS` rounds; a step whose diff is larger loads the rest as before."""
        if not (self.overlap and self.host_tier) or policy.layer_wise:
            return 0
        return host_tier.OVERLAP_ROUNDS * self.chunk(policy, num_seqs)

    def reads_in_place(self, policy: RetrievalPolicy, chunks) -> bool:
        """Whether a shared decode of `chunks` reads the selection in the pool: always with
        `retrieval_inplace`; with a lazy host tier while none of them has pages in host memory. The buffer
        stays valid meanwhile: a slot's K/V never change, and a request's row is emptied when it starts."""
        if policy.layer_wise or not self.host_tier:
            return self.inplace
        return not self.eager and not any(c.request.request_id in self._offloaded for c in chunks)

    def decode_variants(self, policy: RetrievalPolicy) -> list[bool]:
        """The decode variants (in place or not) `policy`'s dispatches can take: a lazy host tier takes the
        host-loading one only after an offload, so only where host pages exist (precompiling it makes the
        mirror, which is then kept up to date on every call)."""
        if policy.layer_wise or not self.host_tier:
            return [self.inplace]
        if self.eager:
            return [False]
        return [True, False] if getattr(self.engine.allocator, "host_pages", 0) else [True]

    def transfer(self) -> dict:
        """Host tier bytes per decode step and sequence: moved by the diff loads (padding included), the
        rows the buffer lacked, and re-fetching the selection every step (the no-diff baseline)."""
        cfg = self.engine.runner.cfg
        policy = next(iter(self._buf), None)
        if policy is None or not self.host_steps:
            return {}
        lsel = cfg.num_layers - policy.tap_layer(self.params_for(policy))
        per_row = host_tier.transfer_bytes(1, lsel, cfg.head_dim, self.engine.runner.pool.k.dtype.itemsize)
        steps = self.host_steps
        return {"host_steps": steps, "h2d_bytes_per_step": self.host_rows_moved * per_row / steps,
                "h2d_bytes_needed_per_step": self.host_rows_needed * per_row / steps,
                "h2d_bytes_refetch_per_step": self.host_rows_baseline * per_row / steps,
                "h2d_ratio": self.host_rows_baseline / max(self.host_rows_moved, 1)}

    def known(self, policy: RetrievalPolicy, rows, chunks) -> np.ndarray:
        """Per decode row: whether its buffer row still holds this request's previous selection."""
        return np.array([row < len(chunks) and rows[row] >= 0 and self._owner.get(
            (policy, int(rows[row]))) == chunks[row].request.request_id for row in range(len(rows))])

    def keep(self, policy: RetrievalPolicy, sbuf, rows=(), chunks=()) -> None:
        """The buffer after a decode call: the rows of `chunks` hold these requests' selections from now
        on."""
        self._buf[policy] = sbuf
        for row, c in enumerate(chunks):
            self._owner[(policy, int(rows[row]))] = c.request.request_id

    def retain(self, running: set) -> None:
        """Forgets the offloads of requests no longer running."""
        self._offloaded &= running

    def count(self, chunks, known, ran, stats, moved, host: bool) -> None:
        """Records the selection / transfer statistics of a shared decode."""
        n = len(chunks)
        later = ran.copy()
        for row in range(n):  # a request's first selected step has no previous selection
            if not known[row]:
                later[np.argmax(ran[:, row]), row] = False
        self.steps += int(later.sum())
        self.slots_selected += int(stats[..., 0][later].sum())
        self.slots_new += int((stats[..., 0] - stats[..., 1])[later].sum())
        if host:
            self.host_steps += int(ran.sum())
            self.host_rows_moved += int(moved[:, 0].sum())
            self.host_rows_needed += int(stats[..., 2].sum())
            self.host_rows_baseline += int(stats[..., 0].sum())
