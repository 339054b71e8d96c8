"""Per-(sequence, layer, KV head) page lists and the flat slot mapping (host, numpy, never imports jax).

Every (sequence, layer, KV head) owns its own page list. The ``i``-th token a head stores (``i`` counts
from 0 over the sequence) goes to storage index:

* global head (window 0): ``i`` — the list grows page by page with the context;
* local head (window W > 0, sink S): ``i`` if ``i < S`` (sink slots, never overwritten), else
  ``S + (i - S) % (C - S)`` — a ring. The capacity ``C = round_up(S + W - 1 + max_step_tokens, page_size)``
  keeps every slot a query of the current step may see (the window before the step's first query plus
  the step's own tokens), so a local head's footprint is bounded by ``C / page_size`` pages.

Storage index ``j`` of a head lives in page ``pages[j // page_size]`` at offset ``j % page_size``; the flat
slot id handed to ``write_kv`` is ``page * page_size + offset``. The length reported for the kernels is
the number of valid storage slots, ``min(i_total, C)`` for a local head. The attention masks by stored
position, so ring order never matters. Sinks are the first S tokens a head stores; the engine appends
positions 0, 1, 2, ... so these are exactly the positions ``< S`` of the attention rule.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jaxkv.cache.allocator import PageAllocator


class _Seq:
    """Bookkeeping of one sequence."""

    def __init__(self, L: int, H: int, cap_pages: int):
        self.table = np.full((L, H, max(cap_pages, 1)), -1, np.int32)  # [L, H, cap] ids, -1 past npages
        self.npages = np.zeros((L, H), np.int64)  # [L, H] pages held
        self.written = np.zeros((L, H), np.int64)  # [L, H] tokens stored so far (logical index counter)
        self.last_pos = -1  # last appended position


class HeadPageTables:
    def __init__(self, num_layers: int, num_kv_heads: int, page_size: int, allocator: PageAllocator,
                 sink, window, max_step_tokens: int):
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("page_size", page_size),
                        ("max_step_tokens", max_step_tokens)):
            if not isinstance(v, int | np.integer) or v < 1:
                raise ValueError(f"HeadPageTables: {name} must be a positive integer (got {v!r})")
        L, H = num_layers, num_kv_heads
        sink = np.asarray(sink)
        window = np.asarray(window)
        if sink.shape != (L, H) or window.shape != (L, H):
            raise ValueError(f"HeadPageTables: sink and window must be [{L}, {H}] "
                             f"(got {sink.shape}, {window.shape})")
        if (sink < 0).any() or (window < 0).any():
            raise ValueError("HeadPageTables: sink and window must be >= 0")
        self.num_layers, self.num_kv_heads, self.page_size = L, H, int(page_size)
        self.allocator = allocator
        self.max_step_tokens = int(max_step_tokens)
        self.sink = sink.astype(np.int64)
        self.window = window.astype(np.int64)
        self.local = self.window > 0  # [L, H]
        ps = self.page_size
        need = self.sink + self.window - 1 + self.max_step_tokens
        # [L, H] ring-head capacity in slots (0 for global heads = unbounded).
        self.capacity = np.where(self.local, -(-need // ps) * ps, 0)
        self._ring = np.where(self.local, self.capacity - self.sink, 1)  # ring size (1 keeps % safe)
        rule = np.stack([self.local, self.sink, self._ring], axis=-1).reshape(L * H, 3)
        keys, which = np.unique(rule, axis=0, return_inverse=True)
        self._rule_groups = [(bool(k[0]), int(k[1]), int(k[2]), np.flatnonzero(which.reshape(-1) == g))
                             for g, k in enumerate(keys)]  # heads sharing one ring rule (static)
        self._seqs: dict[Hashable, _Seq] = {}
        # Optional listener mirroring every page-table / counter change (the engine's device-resident
        # tables, jaxkv/engine/device_tables.py): new(seq_id), pages(seq_id, lh, j, ids), append(seq_id, n),
        # reset(seq_id) (counters changed otherwise than by an append), release(seq_id, lh, j).
        self.journal = None

    # ---- queries ------------------------------------------------------------------------------
    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def _stored(self, written: np.ndarray) -> np.ndarray:
        return np.where(self.local, np.minimum(written, self.capacity), written)

    def _pages_for(self, written: np.ndarray) -> np.ndarray:
        return -(-self._stored(written) // self.page_size)

    def pages_needed(self, seq_id, num_new_tokens: int) -> int:
        """New pages an append of ``num_new_tokens`` would allocate (summed over heads); unknown or
        ``None`` ``seq_id`` = a fresh sequence."""
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        written = seq.written if seq is not None else np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        held = seq.npages if seq is not None else 0
        return int((self._pages_for(written + num_new_tokens) - held).sum())

    def num_tokens(self, seq_id) -> int:
        return int(self._get(seq_id).last_pos + 1)

    def lengths(self, seq_id) -> np.ndarray:
        """[L, H] int32 valid storage slots per head."""
        return self._stored(self._get(seq_id).written).astype(np.int32)

    def recent_lengths(self, seq_id, n: int) -> np.ndarray:
        """[n, L, H] int32: the lengths right after each of the last ``n`` appended tokens (the per-step
        lengths of a multi-step decode whose ``n`` slots were appended at once)."""
        written = self._get(seq_id).written
        back = np.arange(n - 1, -1, -1)[:, None, None]
        return self._stored(written[None] - back).astype(np.int32)

    def page_lists(self, seq_id) -> list[list[np.ndarray]]:
        """``[layer][kv_head]`` -> np.int32 page ids in storage order."""
        seq = self._get(seq_id)
        return [[seq.table[layer, h, :seq.npages[layer, h]].copy() for h in range(self.num_kv_heads)]
                for layer in range(self.num_layers)]

    def max_pages(self, seq_id) -> int:
        """Largest page-list length over the sequence's heads (0 for an unknown sequence)."""
        seq = self._seqs.get(seq_id)
        return int(seq.npages.max()) if seq is not None else 0

    def pages_per_head(self) -> np.ndarray:
        """[L, H] pages held summed over sequences (a page shared by k sequences counts k times)."""
        total = np.zeros((self.num_layers, self.num_kv_heads), np.int64)
        for seq in self._seqs.values():
            total += seq.npages
        return total

    def pages_in_use_by_kind(self, kinds) -> dict[str, int]:
        """Pages held per head kind; ``kinds`` is an [L, H] array of kind names (HeadClassMap.kinds())."""
        kinds = np.asarray(kinds)
        per_head = self.pages_per_head()
        return {str(k): int(per_head[kinds == k].sum()) for k in np.unique(kinds)}

    # ---- mutation -----------------------------------------------------------------------------
    def append(self, seq_id, positions, through_pool: bool = True,
               return_slots: bool = True, sequential: bool = False) -> np.ndarray | None:
        """Reserves slots for new tokens of ``seq_id`` (created if unknown).

        ``positions`` is np.int32[n], strictly increasing and after the sequence's last position.
        Returns flat slot ids np.int32[n, L, H]. Raises OutOfPages without changing anything.
        ``through_pool=False``: the step attends over its own new K/V rather than the pool (a fresh prompt
        through head_class_prefill), so ``n`` may exceed ``max_step_tokens``; a local head's token whose
        ring slot a later token of the same append takes gets slot -1 (never written).
        ``return_slots=False`` skips the slot array (the engine computes slots on the device) and returns
        None; host work is then O(L x H + new pages).
        ``sequential=True``: the tokens go through the model one forward each (a multi-step decode call
        reserves its K tokens at once but writes and attends them one step at a time), so only one token at
        a time must fit a local head's ring, not all ``n``; later tokens overwrite ring slots in order.
        """
        positions = np.asarray(positions)
        if positions.ndim != 1:
            raise ValueError(f"append: positions must be 1-D (got shape {positions.shape})")
        seq = self._seqs.get(seq_id)
        new = seq is None
        if new:
            seq = _Seq(self.num_layers, self.num_kv_heads, 0)
        n = positions.shape[0]
        if through_pool and not sequential and n > self.max_step_tokens and self.local.any():
            raise ValueError(f"append: {n} tokens in one step exceed max_step_tokens={self.max_step_tokens}, "
                             "which sizes the local heads' rings")
        if n and (positions[0] <= seq.last_pos or (np.diff(positions) <= 0).any()):
            raise ValueError(f"append: positions must increase and follow position {seq.last_pos}")
        target = self._pages_for(seq.written + n)
        add = target - seq.npages
        heads = np.repeat(np.tile(np.arange(self.num_kv_heads), self.num_layers), add.ravel())
        ids = self.allocator.allocate(int(add.sum()), heads=heads)  # OutOfPages leaves everything untouched
        if new:
            self._seqs[seq_id] = seq
            if self.journal is not None:
                self.journal.new(seq_id)
        if target.max() > seq.table.shape[2]:
            cap = max(int(target.max()), 2 * seq.table.shape[2])
            grown = np.full((self.num_layers, self.num_kv_heads, cap), -1, np.int32)
            grown[:, :, :seq.table.shape[2]] = seq.table
            seq.table = grown
        if ids.size:  # (flat head, page index) of each new page, C order over (layer, head, page) = ids order
            lh, j = _ranges(seq.npages.reshape(-1), add.reshape(-1))
            seq.table.reshape(-1, seq.table.shape[2])[lh, j] = ids
            if self.journal is not None:
                self.journal.pages(seq_id, lh, j, ids)
        seq.npages = target

        slots = self._slots(seq, n, through_pool) if return_slots else None
        seq.written = seq.written + n
        if n:
            seq.last_pos = int(positions[-1])
        if self.journal is not None:
            self.journal.append(seq_id, n)
        return slots

    def _slots(self, seq: _Seq, n: int, through_pool: bool) -> np.ndarray:
        """[n, L, H] int32 slots of the next ``n`` tokens. Heads sharing (written, ring rule) share one 1-D
        storage-index row, so the work is one gather per group (usually one or two groups), not
        O(n x L x H) index arithmetic (an 8K-token prompt: ~30 ms -> a few ms)."""
        L, H, ps = self.num_layers, self.num_kv_heads, self.page_size
        out = np.empty((n, L * H), np.int32)
        table = seq.table.reshape(L * H, -1)
        written_all = seq.written.reshape(-1)
        j = np.arange(n, dtype=np.int64)
        for written, local, sink, ring, heads in self._groups(written_all):
            idx = written + j  # logical storage index of each new token
            sidx = np.where(idx >= sink, sink + (idx - sink) % ring, idx) if local else idx
            vals = table[heads][:, sidx // ps] * ps + (sidx % ps).astype(np.int32)  # [heads, n]
            if local and not through_pool:  # the last writer of each ring slot wins; earlier ones skip
                vals[:, (idx >= sink) & (idx + ring < written + n)] = -1
            if heads.size == L * H:
                out[:] = vals.T
            else:
                out[:, heads] = vals.T
        return out.reshape(n, L, H)

    def _groups(self, written: np.ndarray):
        """(written, local, sink, ring, flat head ids) of heads that share one storage-index row."""
        for local, sink, ring, heads in self._rule_groups:
            w = written[heads]
            if (w == w[0]).all():  # the usual case: every head of the rule has stored as many tokens
                yield int(w[0]), local, sink, ring, heads
            else:
                for value in np.unique(w):
                    yield int(value), local, sink, ring, heads[w == value]

    def fill_step(self, seq_ids: Sequence, page_table_out: np.ndarray, lengths_out: np.ndarray) -> None:
        """Writes rows ``0..len(seq_ids)-1`` of ``page_table_out [S, L, H, P]`` and ``lengths_out [S, L, H]``;
        every other entry becomes -1 (page table) / 0 (lengths)."""
        S, L, H, P = page_table_out.shape
        if (len(seq_ids) > S or lengths_out.shape != (S, L, H)
                or (L, H) != (self.num_layers, self.num_kv_heads)):
            raise ValueError(f"fill_step: {len(seq_ids)} sequences do not fit page_table "
                             f"{page_table_out.shape} / lengths {lengths_out.shape}")
        page_table_out.fill(-1)
        lengths_out.fill(0)
        for row, seq_id in enumerate(seq_ids):
            seq = self._get(seq_id)
            mp = int(seq.npages.max())
            if mp > P:
                raise ValueError(f"fill_step: sequence {seq_id!r} holds {mp} pages per head; "
                                 f"the bucket has {P}")
            page_table_out[row, :, :, :mp] = seq.table[:, :, :mp]
            lengths_out[row] = self._stored(seq.written)

    def compact(self, seq_id, counts) -> int:
        """After a policy compacted heads in place: heads whose stored length exceeds ``counts [L, H]`` now
        hold exactly ``counts`` slots (their first ones); the pages past that are released. Local (ring)
        heads are never compacted. Returns the number of pages freed."""
        seq = self._get(seq_id)
        counts = np.asarray(counts, np.int64)
        if counts.shape != (self.num_layers, self.num_kv_heads):
            raise ValueError(f"compact: counts must be [{self.num_layers}, {self.num_kv_heads}] "
                             f"(got {counts.shape})")
        stored = self._stored(seq.written)
        shrink = ~self.local & (counts < stored)
        if (counts < 0).any():
            raise ValueError("compact: counts must be >= 0")
        if not shrink.any():
            return 0
        keep = np.where(shrink, -(-counts // self.page_size), seq.npages)
        lh, j = _ranges(keep.reshape(-1), (seq.npages - keep).reshape(-1))
        flat = seq.table.reshape(-1, seq.table.shape[2])
        freed = flat[lh, j]
        self.allocator.decref(freed)
        flat[lh, j] = -1
        seq.npages = keep
        seq.written = np.where(shrink, counts, seq.written)
        if self.journal is not None:
            self.journal.release_pages(seq_id, lh, j)
            self.journal.reset(seq_id)
        return int(freed.size)

    def replace_pages(self, seq_id, lh: np.ndarray, j: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Points entries (flat layer-head ``lh``, page index ``j``) of a sequence at other page ids (the
        caller moved the data and owns both references); returns the ids they held."""
        seq = self._get(seq_id)
        flat = seq.table.reshape(-1, seq.table.shape[2])
        if ((j < 0) | (j >= seq.npages.reshape(-1)[lh])).any():
            raise ValueError("replace_pages: an entry past the sequence's pages")
        old = flat[lh, j].copy()
        flat[lh, j] = ids
        if self.journal is not None:
            self.journal.pages(seq_id, lh, j, ids)
        return old

    def release(self, seq_id) -> None:
        """Drops the sequence and one reference to each of its pages (no-op for an unknown id)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.allocator.decref(seq.table[seq.table >= 0])
            if self.journal is not None:
                self.journal.release(seq_id)

    def adopt_prefix(self, seq_id, pages_per_block: Sequence[np.ndarray], num_tokens: int) -> None:
        """Starts ``seq_id`` from shared full prefix pages (positions 0..num_tokens-1).

        ``pages_per_block[b]`` is the [L, H] page ids of token block ``b``. Only valid when every head is
        global (a ring's pages are not a pure function of the prefix). Takes one reference per page.
        """
        if seq_id in self._seqs:
            raise ValueError(f"adopt_prefix: sequence {seq_id!r} already exists")
        if self.local.any():
            raise ValueError("adopt_prefix: prefix sharing needs every head to keep full history (window 0)")
        nb = len(pages_per_block)
        if num_tokens != nb * self.page_size:
            raise ValueError(f"adopt_prefix: {nb} blocks hold {nb * self.page_size} tokens, not {num_tokens}")
        if nb == 0:
            return
        blocks = np.stack([np.asarray(b, np.int32) for b in pages_per_block], axis=-1)  # [L, H, nb]
        if blocks.shape != (self.num_layers, self.num_kv_heads, nb):
            raise ValueError(f"adopt_prefix: blocks must be [{self.num_layers}, {self.num_kv_heads}] "
                             "page ids")
        self.allocator.incref(blocks)
        seq = _Seq(self.num_layers, self.num_kv_heads, nb)
        seq.table[:, :, :nb] = blocks
        seq.npages[:] = nb
        seq.written[:] = num_tokens
        seq.last_pos = num_tokens - 1
        self._seqs[seq_id] = seq
        self._journal_adopted(seq_id, seq, nb)

    def adopt_pages(self, seq_id, table, num_slots: int, last_pos: int) -> None:
        """Starts ``seq_id`` from a ready page list (segment reuse, `jaxkv.engine.reuse`).

        ``table [L, H, n]`` page ids, each already holding one reference for this sequence (the tables take
        it over); storage slots ``0..num_slots-1`` are the prompt's, holes included (they carry position
        -1, which every attention path skips); the next append goes to storage index ``num_slots`` at a
        position after ``last_pos``. Global heads only.
        """
        if seq_id in self._seqs:
            raise ValueError(f"adopt_pages: sequence {seq_id!r} already exists")
        if self.local.any():
            raise ValueError("adopt_pages: needs every head to keep full history (window 0)")
        table = np.asarray(table, np.int32)
        n = -(-int(num_slots) // self.page_size)
        if table.shape != (self.num_layers, self.num_kv_heads, n):
            raise ValueError(f"adopt_pages: {num_slots} slots need "
                             f"[{self.num_layers}, {self.num_kv_heads}, {n}] pages (got {table.shape})")
        seq = _Seq(self.num_layers, self.num_kv_heads, n)
        seq.table[:, :, :n] = table
        seq.npages[:] = n
        seq.written[:] = num_slots
        seq.last_pos = int(last_pos)
        self._seqs[seq_id] = seq
        self._journal_adopted(seq_id, seq, n)

    def _journal_adopted(self, seq_id, seq: _Seq, n: int) -> None:
        if self.journal is None:
            return
        self.journal.new(seq_id)
        if n:  # every head holds pages 0..n-1: one block, no per-page (head, index) arrays
            self.journal.pages_block(seq_id, seq.table[:, :, :n])
        self.journal.reset(seq_id)

    def _get(self, seq_id) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return seq


def _ranges(start: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of ``start[r] .. start[r] + count[r] - 1`` for every row r, row-major;
    O(rows + total)."""
    count = np.asarray(count, np.int64)
    rows = np.repeat(np.arange(count.size), count)
    first = np.cumsum(count) - count  # offset of each row's first entry
    cols = np.asarray(start, np.int64)[rows] + np.arange(rows.size) - first[rows]
    return rows, cols
