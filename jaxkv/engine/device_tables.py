"""Device-resident step metadata: the page tables and per-head counters live on the device.

`HeadPageTables` (host, numpy) stays the source of truth: it allocates, frees, compacts and adopts pages.
Every change it makes goes to this journal (``tables.journal``), and before a dispatch the journal sends the
device only what changed since the last one:

* ``table [R, L, Hkv, Pmax]`` int32 on the device, one row per live sequence (row 0 is the padding row,
  never assigned): page writes are (flat index, page id) pairs — new pages of appends, -1 for pages freed
  by a compaction, the whole list of an adopted prefix — scattered in one jitted call (padded to a few
  fixed sizes, so it compiles once per size). A released sequence's row is cleared whole before the
  flush's writes (its pending writes are dropped), so a finished 8K prompt costs the host O(1), not 65K
  -1 writes that a new sequence on the same row then overwrites (which needed a last-write-wins sort);
* ``written [R, L, Hkv]`` int32, tokens stored per head so far (the ring rule's logical index). A step
  advances it on the device by the tokens it appended; only counters changed otherwise (a new or adopted
  sequence, a compaction) are re-sent, as whole ``[L, Hkv]`` rows.

A step then needs only its rows ``[S]`` and token counts ``[S]`` from the host: the page table ``[S, L,
Hkv, P]`` is gathered on the device, lengths come from the counters (ring heads: ``min(written,
capacity)``), and the slots of every new token from the page table and the ring rule, exactly as
`HeadPageTables.append` computes them on the host. Host work per step is O(sequences + new pages).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Entries per journal flush (larger ones go in several calls); the top size takes a 33K-token reuse layout of
# 256 (layer, KV head) pairs, 529K page ids, in one call, not 9.
UPDATE_BUCKETS = (256, 4096, 65536, 1 << 20)
CLEAR_BUCKETS = (4, 64)  # released rows cleared per call


class DeviceTables:
    def __init__(self, tables, max_pages: int, rows: int):
        self.tables = tables
        tables.journal = self
        self.L, self.H = tables.num_layers, tables.num_kv_heads
        self.page_size = tables.page_size
        self.max_pages = int(max_pages)
        self.heads = {"sink": jnp.asarray(tables.sink, jnp.int32),
                      "ring": jnp.asarray(tables._ring, jnp.int32),
                      "local": jnp.asarray(tables.local), "cap": jnp.asarray(tables.capacity, jnp.int32)}
        self._row: dict = {}  # seq_id -> row
        self._seq: dict[int, object] = {}  # row -> seq_id
        self._alloc_rows(max(int(rows), 1) + 1)
        self._idx: list[np.ndarray] = []  # pending page-table writes, in order (flat index, value)
        self._val: list[np.ndarray] = []
        self._cleared = False  # -1 writes pending: an index may be written twice before the next flush
        self._clear_rows: set[int] = set()  # released rows, set to -1 before the next flush's writes
        self._reset: set[int] = set()  # rows whose counters the device takes from the host at the next flush
        self._pending: dict[int, int] = {}  # row -> tokens appended since its last dispatch

    def _alloc_rows(self, n: int) -> None:
        old = getattr(self, "num_rows", 0)
        table = jnp.full((n, self.L, self.H, self.max_pages), -1, jnp.int32)
        written = jnp.zeros((n, self.L, self.H), jnp.int32)
        if old:  # grown (more live sequences than rows): keep the rows already there
            table = table.at[:old].set(self.table)
            written = written.at[:old].set(self.written)
        self.table, self.written, self.num_rows = table, written, n
        self._free = list(range(n - 1, max(old, 1) - 1, -1))  # pop() hands out the lowest first

    # ---- journal (called by HeadPageTables) -------------------------------------------------------
    def new(self, seq_id) -> None:
        if not self._free:
            self._alloc_rows(2 * self.num_rows - 1)
        row = self._free.pop()
        self._row[seq_id], self._seq[row] = row, seq_id
        self._reset.add(row)

    def pages(self, seq_id, lh: np.ndarray, j: np.ndarray, ids: np.ndarray) -> None:
        if j.size and int(j.max()) >= self.max_pages:
            raise ValueError(f"sequence {seq_id!r} holds more than {self.max_pages} pages per head")
        self._idx.append((self._row[seq_id] * self.L * self.H + lh) * self.max_pages + j)
        self._val.append(np.asarray(ids, np.int32).reshape(-1))

    def pages_block(self, seq_id, table: np.ndarray) -> None:
        """Pages ``0..n-1`` of every (layer, head) at once (an adopted prefix or reuse layout, [L, H, n])."""
        n = table.shape[-1]
        if n > self.max_pages:
            raise ValueError(f"sequence {seq_id!r} holds more than {self.max_pages} pages per head")
        lh = self._row[seq_id] * self.L * self.H + np.arange(self.L * self.H, dtype=np.int64)
        heads = lh * self.max_pages
        self._idx.append((heads[:, None] + np.arange(n, dtype=np.int64)).reshape(-1))
        self._val.append(np.asarray(table, np.int32).reshape(-1))

    def release_pages(self, seq_id, lh: np.ndarray, j: np.ndarray) -> None:
        if lh.size:
            self._idx.append((self._row[seq_id] * self.L * self.H + lh) * self.max_pages + j)
            self._val.append(np.full(lh.size, -1, np.int32))
            self._cleared = True

    def append(self, seq_id, n: int) -> None:
        row = self._row[seq_id]
        self._pending[row] = self._pending.get(row, 0) + int(n)

    def reset(self, seq_id) -> None:
        self._reset.add(self._row[seq_id])

    def release(self, seq_id) -> None:
        row = self._row.pop(seq_id)
        lhp = self.L * self.H * self.max_pages
        for k, idx in enumerate(self._idx):  # this row's pending writes die with it (cleared whole below)
            mine = idx // lhp == row
            if mine.any():
                self._idx[k], self._val[k] = idx[~mine], self._val[k][~mine]
        self._clear_rows.add(row)
        del self._seq[row]
        self._reset.discard(row)
        self._pending.pop(row, None)
        self._free.append(row)

    # ---- device side -------------------------------------------------------------------------------
    def flush(self) -> None:
        """Sends the page writes and counter resets collected since the last flush."""
        if not (self._idx or self._reset or self._clear_rows):
            return
        LH = self.L * self.H
        if self._clear_rows:  # whole released rows first; writes below may give them to new sequences
            rows = np.fromiter(self._clear_rows, np.int32)
            self._clear_rows = set()
            for lo in range(0, rows.size, CLEAR_BUCKETS[-1]):
                part = rows[lo:lo + CLEAR_BUCKETS[-1]]
                u = next(s for s in CLEAR_BUCKETS if s >= part.size)
                pad = np.full(u - part.size, self.num_rows, np.int32)
                self.table = _clear(self.table, np.concatenate([part, pad]))
        if self._idx:
            idx = np.concatenate(self._idx).astype(np.int64)
            val = np.concatenate(self._val)
            if self._cleared:  # the last write of an index wins (a freed page slot taken again)
                _, last = np.unique(idx[::-1], return_index=True)
                keep = np.sort(idx.size - 1 - last)
                idx, val = idx[keep], val[keep]
        else:
            idx, val = np.zeros(0, np.int64), np.zeros(0, np.int32)
        rows = sorted(self._reset)
        if rows:  # counters before this step's appends (the step adds them on the device)
            wrow = np.array(rows, np.int64)
            widx = (wrow[:, None] * LH + np.arange(LH)).reshape(-1)
            wval = np.stack([self.tables._seqs[self._seq[r]].written.reshape(-1) - self._pending.get(r, 0)
                             for r in rows]).reshape(-1).astype(np.int32)
        else:
            widx, wval = np.zeros(0, np.int64), np.zeros(0, np.int32)
        self._idx, self._val, self._reset, self._cleared = [], [], set(), False
        top = UPDATE_BUCKETS[-1]
        for lo in range(0, max(idx.size, widx.size), top):
            a, b = idx[lo:lo + top], widx[lo:lo + top]
            u = next(s for s in UPDATE_BUCKETS if s >= max(a.size, b.size))
            pi = np.full(u, self.table.size, np.int64)  # out of range: dropped
            pv = np.full(u, -1, np.int32)
            pw = np.full(u, self.written.size, np.int64)
            pwv = np.zeros(u, np.int32)
            pi[:a.size], pv[:a.size] = a, val[lo:lo + top]
            pw[:b.size], pwv[:b.size] = b, wval[lo:lo + top]
            self.table, self.written = _apply(self.table, self.written, pi.astype(np.int32), pv,
                                              pw.astype(np.int32), pwv)

    def warm(self) -> None:
        """Compiles the journal's update calls for every flush size (precompile)."""
        for u in CLEAR_BUCKETS:
            self.table = _clear(self.table, np.full(u, self.num_rows, np.int32))
        for u in UPDATE_BUCKETS:
            self.table, self.written = _apply(
                self.table, self.written, np.full(u, self.table.size, np.int32), np.full(u, -1, np.int32),
                np.full(u, self.written.size, np.int32), np.zeros(u, np.int32))

    def _rows(self, seq_ids, counts, S: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows and tokens appended since the last dispatch of ``seq_ids`` (must equal ``counts``), padded
        to ``S``."""
        rows = np.zeros(S, np.int32)
        n = np.zeros(S, np.int32)
        for i, (sid, c) in enumerate(zip(seq_ids, counts, strict=True)):
            rows[i] = r = self._row[sid]
            n[i] = self._pending.pop(r, 0)
            if n[i] != c:
                raise RuntimeError(f"sequence {sid!r} appended {n[i]} tokens since its last step, not {c}")
        return rows, n

    def step_meta(self, seq_ids, counts, S: int, P: int, q_seq: np.ndarray, tok_idx: np.ndarray):
        """(page_table [S, L, H, P], lengths [S, L, H], slots [T, L, H]) of a ragged step whose row i
        appended ``counts[i]`` tokens and whose token t is the ``tok_idx[t]``-th of row ``q_seq[t]`` (-1:
        padding); all on the device."""
        self.flush()
        rows, n = self._rows(seq_ids, counts, S)
        pt, lengths, slots, self.written = _step_meta(self.table, self.written, rows, n, q_seq, tok_idx,
                                                      self.heads, P=P, ps=self.page_size)
        return pt, lengths, slots

    def decode_meta(self, seq_ids, counts, S: int, P: int, K: int):
        """(page_table [S, L, H, P], slots, lengths, prev_lengths [K, S, L, H], active [K, S]) of a multi-step
        decode whose row i reserved ``counts[i] <= K`` tokens since its last dispatch."""
        self.flush()
        rows, n = self._rows(seq_ids, counts, S)
        out = _decode_meta(self.table, self.written, rows, n, self.heads, K=K, P=P, ps=self.page_size)
        self.written = out[-1]
        return out[:-1]

    def check(self) -> None:
        """Debug / tests: the device mirror equals the host tables (after a flush)."""
        self.flush()
        table, written = np.asarray(self.table), np.asarray(self.written)
        for sid, row in self._row.items():
            seq = self.tables._seqs[sid]
            mp = seq.table.shape[2]
            want = np.full((self.L, self.H, self.max_pages), -1, np.int32)
            want[:, :, :min(mp, self.max_pages)] = seq.table[:, :, :self.max_pages]
            np.testing.assert_array_equal(table[row], want, err_msg=f"page table of {sid!r}")
            np.testing.assert_array_equal(written[row] + self._pending.get(row, 0), seq.written,
                                          err_msg=f"counters of {sid!r}")
        free = sorted(self._free)
        assert (table[free] == -1).all() if free else True


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _apply(table, written, idx, val, widx, wval):
    table = table.reshape(-1).at[idx].set(val, mode="drop").reshape(table.shape)
    written = written.reshape(-1).at[widx].set(wval, mode="drop").reshape(written.shape)
    return table, written


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear(table, rows):
    return table.at[rows].set(-1, mode="drop")  # out-of-range rows pad the bucket and are dropped


def _stored(w, heads):
    return jnp.where(heads["local"], jnp.minimum(w, heads["cap"]), w)


def _slot(pt, s, idx, heads, ps: int):
    """Flat slots of logical storage index ``idx [..., L, H]`` of rows ``s [..., 1, 1]`` (ring rule)."""
    sink, ring = heads["sink"], heads["ring"]
    sidx = jnp.where(heads["local"] & (idx >= sink), sink + (idx - sink) % ring, idx)
    L, H, P = pt.shape[1:]
    page = pt[s, jnp.arange(L)[:, None], jnp.arange(H)[None, :], jnp.clip(sidx // ps, 0, P - 1)]
    return jnp.where(page >= 0, page * ps + sidx % ps, -1)


@functools.partial(jax.jit, static_argnames=("P", "ps"), donate_argnums=(1,))
def _step_meta(table, written, rows, n, q_seq, tok_idx, heads, P: int, ps: int):
    wb = written[rows]  # [S, L, H] before this step's appends
    pt = table[rows, :, :, :P]
    lengths = _stored(wb + n[:, None, None], heads)
    s = jnp.maximum(q_seq, 0)
    idx = wb[s] + tok_idx[:, None, None]  # [T, L, H]
    slots = _slot(pt, s[:, None, None], idx, heads, ps)
    # A ring slot that a later token of the same step takes is not written (a fresh prompt longer than
    # the ring; never the case for a step of at most max_step_tokens tokens).
    over = heads["local"] & (idx >= heads["sink"]) & (idx + heads["ring"] < (wb + n[:, None, None])[s])
    slots = jnp.where((q_seq >= 0)[:, None, None] & ~over, slots, -1)
    return pt, lengths, slots, written.at[rows].add(n[:, None, None])


@functools.partial(jax.jit, static_argnames=("K", "P", "ps"), donate_argnums=(1,))
def _decode_meta(table, written, rows, n, heads, K: int, P: int, ps: int):
    wb = written[rows]
    pt = table[rows, :, :, :P]
    S = rows.shape[0]
    idx = wb[None] + jnp.arange(K, dtype=jnp.int32)[:, None, None, None]  # [K, S, L, H]
    active = jnp.arange(K)[:, None] < n[None, :]  # [K, S]
    on = active[:, :, None, None]
    slots = jnp.where(on, _slot(pt, jnp.arange(S)[None, :, None, None], idx, heads, ps), -1)
    lengths = jnp.where(on, _stored(idx + 1, heads), 0)
    prev = jnp.where(on, _stored(idx, heads), 0)
    return pt, slots, lengths, prev, active, written.at[rows].add(n[:, None, None])


def num_compilations() -> int:
    return (_apply._cache_size() + _clear._cache_size() + _step_meta._cache_size()
            + _decode_meta._cache_size())
