"""The segment store: reusable KV of token segments, content-addressed and namespaced (host, numpy only).

A segment (a document, a tool output, a chat turn) is prefilled once by the engine at positions
``start..start+n-1`` (``start`` = the length of the anchor it is prefilled after, `jaxkv.engine.reuse`; the
anchor's own K/V are not kept) and its post-RoPE K/V kept in pages of the shared pool:
``pages[layer, kv_head, j]`` holds the segment's tokens ``[j * page_size, (j + 1) * page_size)`` of that
(layer, KV head), in position order; slots past ``n`` in the last page hold position -1. A request that
reuses it copies those pages into its own,
rotating K by the position delta (`pallas_kernels.rope_shift`), or references them in place when nothing
moves and nothing is recomputed (`jaxkv.engine.reuse`).

Identity: ``segment_id(model_id, tokens, extra_key, context)`` (blake2b over all four). ``extra_key`` is a
namespace: the same text under two namespaces gets two ids and two sets of pages, and a lookup with the wrong
namespace fails (it never falls back to another namespace's pages). ``context`` (default none) is text the
segment was prefilled after, as in the prompt it was first seen in (SparseX's protocol: a document cached
together with the ones before it); its K/V carry that context, so it is part of the identity.

Lifetime: the store holds one allocator reference per page. ``acquire`` / ``release`` count the requests
using an entry. Entries nobody uses are evicted least recently used first when the engine needs pages;
ordinary entries go before frozen ones (a frozen entry is a knowledge-base document, registered explicitly,
that survives refcount zero until pressure leaves nothing else). ``delete`` removes a frozen entry; later
lookups of its id say it was deleted; its pages are freed as soon as the last request using it finishes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from jaxkv.cache.allocator import PageAllocator


class SegmentError(ValueError):
    """A request named a segment it may not use (unknown, other namespace, deleted, too long)."""


def segment_id(model_id: str, tokens: Sequence[int], extra_key: str | None = None,
               context: Sequence[int] = ()) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(str(model_id)).encode())
    h.update(b"|")
    h.update(repr(extra_key).encode())
    h.update(b"|")
    h.update(np.asarray(tokens, np.int64).tobytes())
    if len(context):  # ids of segments without a context stay what they were
        h.update(b"|context|")
        h.update(np.asarray(context, np.int64).tobytes())
    return "seg-" + h.hexdigest()


@dataclasses.dataclass
class SegmentEntry:
    segment_id: str
    tokens: tuple[int, ...]
    extra_key: str | None
    pages: np.ndarray  # [L, H, num_pages] int32, position order, one store reference each; -1: that head is
    # not on the device (jaxkv.engine.segment_tiers keeps it in host memory or the persistent store)
    frozen: bool = False
    refcount: int = 0  # requests currently using the entry
    deleted: bool = False  # a frozen entry deleted while in use (pages freed at refcount zero)
    hits: int = 0
    start: int = 0  # original position of the first token (anchor + context length; 0 without either)
    context: tuple[int, ...] = ()  # tokens the segment was prefilled after (its K/V dropped)
    ffn: object = None  # SegmentFFN: each layer's FFN outputs, on the device (RedKnot ffn_reuse; lazy)

    @property
    def length(self) -> int:
        return len(self.tokens)


class SegmentStore:
    def __init__(self, allocator: PageAllocator, page_size: int, model_id: str):
        self.allocator = allocator
        self.page_size = int(page_size)
        self.model_id = str(model_id)
        self._entries: OrderedDict[str, SegmentEntry] = OrderedDict()  # LRU first
        self._deleted: set[str] = set()  # ids of deleted frozen entries (for a clear error)
        self.evictions = 0
        self.on_drop = None  # called with each entry that leaves the store (its other tiers go with it)
        self.on_miss = None  # seg_id -> entry or None: a lower tier (the persistent store) may hold it
        self.on_hit = None  # entry -> False when a lower tier says it was deleted elsewhere (another server)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seg_id: str) -> bool:
        return seg_id in self._entries and not self._entries[seg_id].deleted

    def holds(self, e: SegmentEntry) -> bool:
        """`e` is this store's live entry for its id (not dropped, evicted or deleted)."""
        return self._entries.get(e.segment_id) is e and not e.deleted

    def id_for(self, tokens: Sequence[int], extra_key: str | None = None, context: Sequence[int] = ()) -> str:
        return segment_id(self.model_id, tokens, extra_key, context)

    def entries(self, extra_key: str | None = None, *, all_namespaces: bool = False) -> list[SegmentEntry]:
        return [e for e in self._entries.values()
                if not e.deleted and (all_namespaces or e.extra_key == extra_key)]

    @property
    def num_pages(self) -> int:
        """Pages the store references (shared ones counted once per entry)."""
        return int(sum((e.pages >= 0).sum() for e in self._entries.values()))

    # ---- lookup -----------------------------------------------------------------------------------
    def get(self, seg_id: str, extra_key: str | None = None) -> SegmentEntry:
        """The live entry `seg_id` in namespace `extra_key`; SegmentError naming the problem otherwise."""
        e = self._entries.get(seg_id)
        if e is None and seg_id not in self._deleted and self.on_miss is not None:
            e = self.on_miss(seg_id)
        if e is not None and not e.deleted and self.on_hit is not None and not self.on_hit(e):
            self._deleted.add(seg_id)  # deleted by another server sharing the persistent store
            if e.refcount == 0:
                self._drop(e)
            else:
                e.deleted = True
        if e is None or e.deleted:
            if seg_id in self._deleted:
                raise SegmentError(f"segment {seg_id!r} was deleted")
            raise SegmentError(f"unknown segment {seg_id!r}")
        if e.extra_key != extra_key:
            # Never say which namespace it lives in: namespaces are tenants.
            raise SegmentError(f"segment {seg_id!r} does not exist in namespace {extra_key!r}")
        return e

    def find(self, tokens: Sequence[int], extra_key: str | None = None,
             context: Sequence[int] = ()) -> SegmentEntry | None:
        e = self._entries.get(self.id_for(tokens, extra_key, context))
        if (e is None or e.deleted or e.tokens != tuple(int(t) for t in tokens)
                or e.context != tuple(int(t) for t in context)):
            return None
        return e

    # ---- mutation ---------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], extra_key: str | None, pages: np.ndarray, *,
               frozen: bool = False, start: int = 0, context: Sequence[int] = ()) -> SegmentEntry:
        """Adds an entry that takes over the caller's one reference to each of `pages` [L, H, n]."""
        tokens = tuple(int(t) for t in tokens)
        pages = np.asarray(pages, np.int32)
        need = -(-len(tokens) // self.page_size)
        if pages.ndim != 3 or pages.shape[2] != need:
            raise ValueError(f"insert: {len(tokens)} tokens need [L, H, {need}] pages (got {pages.shape})")
        context = tuple(int(t) for t in context)
        seg_id = self.id_for(tokens, extra_key, context)
        if seg_id in self:
            raise ValueError(f"insert: segment {seg_id!r} already exists")
        self._deleted.discard(seg_id)
        e = SegmentEntry(seg_id, tokens, extra_key, pages, frozen=frozen, start=int(start), context=context)
        self._entries[seg_id] = e
        return e

    def acquire(self, e: SegmentEntry) -> None:
        e.refcount += 1
        e.hits += 1
        self._entries.move_to_end(e.segment_id)

    def release(self, e: SegmentEntry) -> None:
        if e.refcount <= 0:
            raise AssertionError(f"release of unused segment {e.segment_id}")
        e.refcount -= 1
        if e.deleted and e.refcount == 0:
            self._drop(e)

    def freeze(self, e: SegmentEntry) -> None:
        e.frozen = True

    def delete(self, seg_id: str, extra_key: str | None = None) -> None:
        """Deletes an entry (frozen or not). Requests already using it keep its pages until they finish."""
        e = self.get(seg_id, extra_key)
        self._deleted.add(seg_id)
        if e.refcount == 0:
            self._drop(e)
        else:
            e.deleted = True

    def evict(self, num_pages: int) -> int:
        """Frees entries nobody uses, least recently used first, ordinary before frozen, until at least
        `num_pages` pages returned to the pool (or nothing more can go). Returns pages freed."""
        freed = 0
        for frozen in (False, True):
            for e in [e for e in self._entries.values() if e.frozen == frozen and e.refcount == 0]:
                if freed >= num_pages:
                    return freed
                before = self.allocator.num_free
                self._drop(e)
                freed += self.allocator.num_free - before
                self.evictions += 1
        return freed

    def drop(self, e: SegmentEntry) -> None:
        """Drops an idle entry now (no tier had room for it): its id becomes unknown, its tokens register
        again on their next use."""
        if e.refcount:
            raise ValueError(f"drop: segment {e.segment_id} is in use")
        self._drop(e)
        self.evictions += 1

    def clear(self) -> None:
        """Drops every entry nobody uses (all namespaces)."""
        for e in [e for e in self._entries.values() if e.refcount == 0]:
            self._drop(e)

    def _drop(self, e: SegmentEntry) -> None:
        self._entries.pop(e.segment_id, None)
        self.allocator.decref(e.pages[e.pages >= 0])
        if self.on_drop is not None:
            self.on_drop(e)
        e.ffn = None  # its cached FFN outputs (device memory outside the pool) go with it
