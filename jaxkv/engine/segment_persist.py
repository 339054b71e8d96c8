"""Registered segments that survive a restart: the store tier of jaxkv/engine/segment_tiers.py, the
engine's segment entries mirrored to a tensorstore `jaxkv.cache.segment_store.SegmentStore`.

A registration writes every (layer, KV head) of the segment to the store; an engine opened on the same
store (after a restart, or a second server sharing it) registers each committed segment again with no
prefill: into the pool while it has room, else left in the store until a request promotes it. A segment
another server commits later is found on its first use by id (`find`). The store's identity
is the segment id namespace of this engine (model id, anchor, start) plus the KV layout (dtype, page size,
layers, KV heads, head dim): another model or layout is refused with `StoreMismatchError`.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from jaxkv.cache.allocator import OutOfPages
from jaxkv.cache.segment_store import CorruptSegmentError, SegmentStore, StoredSegment
from jaxkv.cache.segments import SegmentError

log = logging.getLogger("jaxkv.engine")


CONFIRM_EVERY_S = 1.0  # how stale this engine's view of another server's deletes may be


class PersistentSegments:
    def __init__(self, reuser, url: str):
        pool = reuser.engine.runner.pool
        cfg = reuser.cfg
        self.reuser = reuser
        self.identity = {"segment_namespace": reuser.store.model_id, "kv_dtype": str(pool.k.dtype),
                         "page_size": int(pool.page_size), "num_layers": cfg.num_layers,
                         "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
        self.disk = SegmentStore(url, self.identity)
        reuser.store.on_miss = self.find
        reuser.store.on_hit = self.live
        self.ids: set[str] = set()  # segments of this engine committed to the store
        self._confirmed: dict[str, float] = {}  # segment id -> when its commit was last seen
        self.bytes_written = 0
        self.bytes_read = 0

    def save(self, entry) -> None:
        """Writes a registered entry (every (layer, KV head), from the fastest tier holding it) to the
        store. A segment another server already committed with the same flags is not written again: the
        id covers the model, its tokens, namespace and context, so the K/V are the same."""
        tiers = self.reuser.tiers
        pin = tiers.pins.get(entry.segment_id)
        extra = {"tier": pin} if pin == "host" else {}
        m = self.disk.meta(entry.segment_id)
        if m is not None and m["frozen"] == entry.frozen and m.get("extra", {}) == extra:
            self.ids.add(entry.segment_id)
            return
        k, v, pos = tiers.arrays(entry)
        L, H = pos.shape[:2]
        self.bytes_written += self.disk.put(StoredSegment(
            entry.segment_id, entry.tokens, entry.extra_key, k, v, pos, np.ones((L, H), bool),
            context=entry.context, frozen=entry.frozen, start=entry.start, extra=extra))
        self.ids.add(entry.segment_id)

    def delete(self, segment_id: str) -> None:
        self.disk.delete(segment_id)
        self.ids.discard(segment_id)
        self._confirmed.pop(segment_id, None)

    def live(self, entry) -> bool:
        """False when the store no longer commits a segment this engine had from it: another server sharing
        the store deleted it (this engine then forgets it too). Checked on use, at most every
        `CONFIRM_EVERY_S` seconds per segment (a listing of one key)."""
        sid = entry.segment_id
        if sid not in self.ids:
            return True
        now = time.monotonic()
        if now - self._confirmed.get(sid, -CONFIRM_EVERY_S) < CONFIRM_EVERY_S:
            return True
        if not self.disk.committed(sid):
            self.ids.discard(sid)
            self._confirmed.pop(sid, None)
            log.info("jaxkv: segment %s was deleted from the segment store by another server", sid)
            return False
        self._confirmed[sid] = now
        return True

    def restore(self) -> int:
        """Registers every committed segment of the store (no prefill): frozen ones in their pinned tier,
        the others loaded into the pool while it has room beside a request of the full context, the rest
        left in the store until a request uses them. Returns how many. A corrupted entry is logged and
        skipped, never served."""
        store, engine, tiers = self.reuser.store, self.reuser.engine, self.reuser.tiers
        L, H = self.reuser.cfg.num_layers, self.reuser.cfg.num_kv_heads
        n = 0
        self.disk.sweep()
        metas = sorted(self.disk.list(), key=lambda m: not m["frozen"])  # pinned segments place first
        reserve = engine.tables.pages_needed(None, engine.max_model_len)
        for meta in metas:
            sid = meta["segment_id"]
            if sid in store:
                continue
            e = self.adopt(meta)
            if e is None:
                continue
            n += 1
            pin = tiers.pins.get(sid)
            room = engine.allocator.num_free - reserve >= e.pages.size
            try:
                if pin == "device" or (pin is None and room):
                    tiers.promote([e], np.ones((L, H), bool))
                elif pin == "host":
                    tiers.promote([e], np.ones((L, H), bool))
                    tiers.pin(e, "host")
            except (OutOfPages, SegmentError) as err:
                log.error("jaxkv: segment %s stays in the store: %s", sid, err)
        return n

    def adopt(self, meta: dict):
        """A committed segment of the store registered in this engine's segment store with no pages (its
        K/V stay in the store until promoted), or None when its metadata does not check out."""
        store, tiers, ps = self.reuser.store, self.reuser.tiers, self.reuser.page_size
        sid = meta["segment_id"]
        try:
            tokens, context = tuple(meta["tokens"]), tuple(meta["context"])
            if store.id_for(tokens, meta["extra_key"], context) != sid:
                raise CorruptSegmentError("its tokens do not hash to its id")
            L, H, slots, _ = meta["shape"]
            if (L, H) != (self.identity["num_layers"], self.identity["num_kv_heads"]) or slots % ps or (
                    slots // ps != -(-len(tokens) // ps)) or not np.asarray(meta["heads"], bool).all():
                raise CorruptSegmentError(f"its shape {meta['shape']} does not fit its {len(tokens)} tokens")
        except (CorruptSegmentError, KeyError, TypeError, ValueError) as err:
            log.error("jaxkv: skipping segment %s: %s", sid, err)
            return None
        e = store.insert(tokens, meta["extra_key"], np.full((L, H, slots // ps), -1, np.int32),
                         frozen=bool(meta["frozen"]), start=int(meta["start"]), context=context)
        self.ids.add(sid)
        if e.frozen:
            tiers.pins[sid] = meta.get("extra", {}).get("tier", "device")
        return e

    def find(self, segment_id: str):
        """The entry of a segment another server committed after this one started (None if none)."""
        if segment_id in self.ids:
            return None
        meta = self.disk.meta(segment_id)
        return None if meta is None else self.adopt(meta)
