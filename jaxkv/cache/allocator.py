"""Host page allocator (numpy, never imports jax): a free stack plus per-page reference counts.

A page is owned by whoever holds a reference: a sequence's page list (``HeadPageTables``) and/or the
prefix cache. A page returns to the free stack when its count drops to zero.

``host_pages`` adds page ids ``[num_pages, num_pages + host_pages)`` that exist only in host memory (the
retrieval host tier's mirror, where offloaded pages live): `allocate` never
hands them out, `allocate_host` does, and a freed one returns to its own stack.
"""

from __future__ import annotations

import numpy as np


class OutOfPages(RuntimeError):
    """Raised when an allocation asks for more pages than are free; nothing was allocated."""


class PageAllocator:
    def __init__(self, num_pages: int, host_pages: int = 0):
        if not isinstance(num_pages, int | np.integer) or num_pages < 1:
            raise ValueError(f"PageAllocator: num_pages must be a positive integer (got {num_pages!r})")
        if not isinstance(host_pages, int | np.integer) or host_pages < 0:
            raise ValueError(f"PageAllocator: host_pages must be an integer >= 0 (got {host_pages!r})")
        self.num_pages = int(num_pages)
        self.host_pages = int(host_pages)
        # Free stack: entries [0, _top) are free page ids; popping from the end hands out low ids first.
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self._top = self.num_pages
        self._host_free = np.arange(self.num_pages + self.host_pages - 1, self.num_pages - 1, -1,
                                    dtype=np.int32)
        self._host_top = self.host_pages
        self._ref = np.zeros(self.num_pages + self.host_pages, np.int32)  # reference count per page

    @property
    def num_free(self) -> int:
        return self._top

    def can_allocate(self, n: int) -> bool:
        return n <= self._top

    @property
    def num_free_host(self) -> int:
        return self._host_top

    def allocate_host(self, n: int) -> np.ndarray:
        """``n`` fresh host-only page ids (reference count 1); raises OutOfPages."""
        if n < 0 or n > self._host_top:
            raise OutOfPages(f"asked for {n} host pages, {self._host_top} of {self.host_pages} are free")
        ids = self._host_free[self._host_top - n:self._host_top][::-1].copy()
        self._host_top -= n
        self._ref[ids] = 1
        return ids

    def allocate(self, n: int, heads=None) -> np.ndarray:
        """Returns ``n`` fresh page ids (np.int32[n]) with reference count 1; raises OutOfPages.
        ``heads`` (the KV head of each page) matters only to jaxkv.parallel's ShardedPageAllocator."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0 (got {n})")
        if n > self._top:
            raise OutOfPages(f"asked for {n} pages, {self._top} of {self.num_pages} are free")
        ids = self._free[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._ref[ids] = 1
        return ids

    def refcount(self, ids) -> np.ndarray:
        """Reference counts of ``ids`` (any int array shape)."""
        return self._ref[self._check(ids)]

    def incref(self, ids) -> None:
        ids = self._check(ids).ravel()
        if (self._ref[ids] <= 0).any():
            raise ValueError("incref of a free page")
        np.add.at(self._ref, ids, 1)

    def decref(self, ids) -> None:
        """Drops one reference per occurrence in ``ids``; pages reaching zero become free."""
        ids = self._check(ids).ravel()
        if ids.size == 0:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        if (self._ref[uniq] < counts).any():
            raise ValueError("decref below zero (page freed twice)")
        self._ref[uniq] -= counts.astype(np.int32)
        freed = uniq[self._ref[uniq] == 0]
        host = freed[freed >= self.num_pages]
        freed = freed[freed < self.num_pages]
        self._free[self._top:self._top + freed.size] = freed
        self._top += freed.size
        self._host_free[self._host_top:self._host_top + host.size] = host
        self._host_top += host.size

    def free(self, ids) -> None:
        """Returns pages that are held exactly once (by the caller) to the free stack."""
        ids = self._check(ids).ravel()
        if ids.size and ((self._ref[ids] != 1).any() or np.unique(ids).size != ids.size):
            raise ValueError("free: pages must be held exactly once; use decref for shared pages")
        self.decref(ids)

    def _check(self, ids) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_pages + self.host_pages):
            raise ValueError(f"page id out of range [0, {self.num_pages + self.host_pages})")
        return ids
