"""Host page allocator for a head-sharded pool (numpy only, never imports jax).

Decision (docs/parallel.md): one global page-id space of `num_pages = tp * pages_per_shard` ids; shard `s`
owns the contiguous range `[s * pages_per_shard, (s + 1) * pages_per_shard)`, which is exactly the block
of the pool array that `NamedSharding(mesh, P("tp"))` puts on device `s`. A page of KV head `h` is always
taken from the range of the shard that owns `h` (`h // (num_kv_heads // tp)`, heads being contiguous per
shard after placement), so host tables, the prefix cache and the scheduler keep handling plain global ids;
inside `shard_map` a shard subtracts its range start (`jaxkv.parallel.shard.localize`).
"""

from __future__ import annotations

import numpy as np

from jaxkv.cache.allocator import OutOfPages, PageAllocator


class ShardedPageAllocator:
    """Same interface as `PageAllocator`; `allocate(n, heads=...)` needs the KV head of every page."""

    def __init__(self, num_pages: int, num_shards: int, num_kv_heads: int):
        if num_shards < 1 or num_pages % num_shards:
            raise ValueError(f"ShardedPageAllocator: num_pages={num_pages} must be a positive multiple of "
                             f"num_shards={num_shards}")
        if num_kv_heads % num_shards:
            raise ValueError(f"ShardedPageAllocator: {num_kv_heads} KV heads do not split over {num_shards} "
                             "shards")
        self.num_pages = int(num_pages)
        self.num_shards = int(num_shards)
        self.pages_per_shard = self.num_pages // self.num_shards
        self.heads_per_shard = num_kv_heads // num_shards
        self.shards = [PageAllocator(self.pages_per_shard) for _ in range(self.num_shards)]
        self._taken = np.ones(self.num_shards, np.float64)  # pages handed out per shard so far (+1 prior)

    @property
    def num_free(self) -> int:
        return sum(a.num_free for a in self.shards)

    def num_free_per_shard(self) -> list[int]:
        return [a.num_free for a in self.shards]

    def can_allocate(self, n: int) -> bool:
        """Admission by a summed footprint (the scheduler's unit): the footprint is assumed to split over
        the shards as all allocations so far did (even before the first; the balanced placement keeps it
        near even). A request whose split differs can still raise OutOfPages in `allocate`."""
        share = self._taken / self._taken.sum()
        return n <= self.num_free and all(int(np.ceil(n * share[s])) <= a.num_free
                                          for s, a in enumerate(self.shards))

    def allocate(self, n: int, heads=None) -> np.ndarray:
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0 (got {n})")
        if heads is None:
            raise ValueError("ShardedPageAllocator.allocate needs the KV head of every page (heads=...)")
        shard = np.asarray(heads, np.int64).reshape(-1) // self.heads_per_shard
        if shard.shape[0] != n:
            raise ValueError(f"allocate: {n} pages but {shard.shape[0]} heads")
        counts = np.bincount(shard, minlength=self.num_shards)
        for s, c in enumerate(counts):
            if c > self.shards[s].num_free:
                raise OutOfPages(f"shard {s}: asked for {c} pages, {self.shards[s].num_free} of "
                                 f"{self.pages_per_shard} are free")
        self._taken += counts
        ids = np.empty(n, np.int32)
        for s, c in enumerate(counts):
            if c:
                ids[shard == s] = self.shards[s].allocate(int(c)) + s * self.pages_per_shard
        return ids

    def _split(self, ids):
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_pages):
            raise ValueError(f"page id out of range [0, {self.num_pages})")
        return ids, ids // self.pages_per_shard, ids % self.pages_per_shard

    def refcount(self, ids) -> np.ndarray:
        ids, shard, local = self._split(ids)
        out = np.zeros(ids.shape, np.int32)
        for s in np.unique(shard):
            out[shard == s] = self.shards[s].refcount(local[shard == s])
        return out

    def _each(self, method: str, ids) -> None:
        _, shard, local = self._split(np.asarray(ids).ravel())
        for s in np.unique(shard):
            getattr(self.shards[s], method)(local[shard == s])

    def incref(self, ids) -> None:
        self._each("incref", ids)

    def decref(self, ids) -> None:
        self._each("decref", ids)

    def free(self, ids) -> None:
        self._each("free", ids)
