"""Registered segments that survive a restart: the engine's segment entries mirrored to a tensorstore
`jaxkv.cache.segment_store.SegmentStore` and restored into the page pool when an engine starts.

A registration copies the segment's pages from the pool to the store (every (layer, KV head); the store
can hold fewer); an engine opened on the same store (after a restart, or a second server sharing it)
allocates pages for each committed segment and writes its K/V back, with no prefill. The store's identity
is the segment id namespace of this engine (model id, anchor, start) plus the KV layout (dtype, page size,
layers, KV heads, head dim): another model or layout is refused with `StoreMismatchError`.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxkv.cache.pool import write_kv_donated
from jaxkv.cache.segment_store import CorruptSegmentError, SegmentStore, StoredSegment

log = logging.getLogger("jaxkv.engine")


class PersistentSegments:
    def __init__(self, reuser, url: str):
        pool = reuser.engine.runner.pool
        cfg = reuser.cfg
        self.reuser = reuser
        self.identity = {"segment_namespace": reuser.store.model_id, "kv_dtype": str(pool.k.dtype),
                         "page_size": int(pool.page_size), "num_layers": cfg.num_layers,
                         "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
        self.disk = SegmentStore(url, self.identity)
        self.bytes_written = 0
        self.bytes_read = 0

    def save(self, entry) -> None:
        """Copies a registered entry's pages [L, H, n] from the pool to the store."""
        pool = self.reuser.engine.runner.pool
        L, H, n = entry.pages.shape
        ps = pool.page_size
        ids = entry.pages.reshape(-1)
        k = np.asarray(pool.k[ids]).reshape(L, H, n * ps, -1)
        v = np.asarray(pool.v[ids]).reshape(L, H, n * ps, -1)
        pos = np.asarray(pool.pos[ids]).reshape(L, H, n * ps)
        self.bytes_written += self.disk.put(StoredSegment(
            entry.segment_id, entry.tokens, entry.extra_key, k, v, pos, np.ones((L, H), bool),
            context=entry.context, frozen=entry.frozen, start=entry.start))

    def delete(self, segment_id: str) -> None:
        self.disk.delete(segment_id)

    def restore(self) -> int:
        """Loads every committed segment of the store into the pool (no prefill); returns how many. A
        corrupted entry is logged and skipped, never served."""
        store, engine = self.reuser.store, self.reuser.engine
        n = 0
        self.disk.sweep()
        for meta in self.disk.list():
            sid = meta["segment_id"]
            if sid in store:
                continue
            try:
                seg = self.disk.get(sid)
                if store.id_for(seg.tokens, seg.extra_key, seg.context) != sid:
                    raise CorruptSegmentError("its tokens do not hash to its id")
                if not (seg.pos == seg.pos[:, :1]).all():
                    raise CorruptSegmentError("its stored positions differ between KV heads")
            except CorruptSegmentError as e:
                log.error("jaxkv: skipping segment %s: %s", sid, e)
                continue
            L, H, slots, _ = seg.k.shape
            ps = engine.page_size
            pages = self.reuser._allocate(L * H * (slots // ps)).reshape(L, H, slots // ps)
            engine.runner.pool = _write_pages(engine.runner.pool, pages, seg.k, seg.v, seg.pos)
            store.insert(seg.tokens, seg.extra_key, pages, frozen=seg.frozen, start=seg.start,
                         context=seg.context)
            self.bytes_read += sum(a.nbytes for a in (seg.k, seg.v, seg.pos))
            n += 1
        return n


def _write_pages(pool, pages, k, v, pos):
    """Writes K/V [L, H, slots, D] and positions [L, H, slots] into `pages` [L, H, slots / page_size]: rows
    are (layer, slot), columns KV heads, each (layer, head) at its own flat slot ids."""
    L, H, slots, D = k.shape
    ps = pool.page_size
    j = np.arange(slots)
    flat = pages[:, :, j // ps] * ps + j % ps  # [L, H, slots]
    rows = lambda a: np.swapaxes(a, 1, 2).reshape(L * slots, H, *a.shape[3:])
    return write_kv_donated(pool, rows(k), rows(v), pos[:, 0].reshape(L * slots),
                            rows(flat).astype(np.int32))
