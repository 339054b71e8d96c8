"""Continuous batching with chunked prefill (host only, never imports jax).

Each step packs running requests first (decode tokens and unfinished prefill chunks, oldest first),
then admits waiting requests while the token budget, the sequence budget and the per-head page
footprint allow. When pages run out, the prefix cache gives back idle pages first; then the newest
running request is preempted (its pages freed, its tokens recomputed later).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxkv.cache.allocator import OutOfPages
from jaxkv.engine.request import Request, Status


@dataclasses.dataclass
class Chunk:
    request: Request
    start: int  # first token index fed this step (== request.num_computed when scheduled)
    num_tokens: int
    slots: np.ndarray  # [num_tokens, L, Hkv] int32

    @property
    def samples(self) -> bool:
        """A chunk that reaches the last known token produces the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, tables, allocator, prefix_cache, *, max_num_seqs: int, max_step_tokens: int):
        self.tables = tables
        self.allocator = allocator
        self.prefix = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start
        self.segments = None  # a jaxkv.cache.segments.SegmentStore whose idle entries may be evicted

    def add_running(self, request: Request) -> None:
        """Takes a request whose prompt was prefilled outside the step loop (segment reuse) as running."""
        request.status = Status.RUNNING
        self.running.append(request)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drops a request from the queues and frees its pages (abort or finish)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.tables.release(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Chunk]:
        chunks: list[Chunk] = []
        budget = self.max_step_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted while making room for an older request
                continue
            n = min(req.num_pending, budget)
            slots = self._reserve(req, n)
            if slots is None:  # this request itself was preempted
                continue
            chunks.append(Chunk(req, req.num_computed, n, slots))
            budget -= n
        while self.waiting and budget > 0 and len(chunks) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed == 0 and self.prefix is not None and req.kv_policy is None:
                self._adopt_prefix(req)
            n = min(req.num_pending, budget)
            if not self._make_room(self.tables.pages_needed(req.request_id, n), protect=None):
                break  # head-of-line waits until pages free up
            slots = self.tables.append(req.request_id, _positions(req, n))
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(Chunk(req, req.num_computed, n, slots))
            budget -= n
        return chunks

    def _adopt_prefix(self, req: Request) -> None:
        num_cached, blocks = self.prefix.match(req.all_ids, req.extra_key)
        if num_cached:
            self.tables.adopt_prefix(req.request_id, blocks, num_cached)
        req.num_computed = num_cached
        req.num_cached = num_cached

    def _reserve(self, req: Request, n: int) -> np.ndarray | None:
        need = self.tables.pages_needed(req.request_id, n)
        if not self._make_room(need, protect=req):
            self._preempt(req)
            return None
        return self.tables.append(req.request_id, _positions(req, n))

    def _make_room(self, need: int, protect: Request | None) -> bool:
        """Frees pages until `need` fit: idle prefix-cache pages first, then the newest running request."""
        while not self.allocator.can_allocate(need):
            if self.prefix is not None and self.prefix.evict(need - self.allocator.num_free) > 0:
                continue
            if self.segments is not None and self.segments.evict(need - self.allocator.num_free) > 0:
                continue
            # Only requests newer than `protect` may go: older ones already hold this step's slots.
            victims = self.running[self.running.index(protect) + 1:] if protect is not None else []
            if not victims:
                return False
            self._preempt(victims[-1])
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.tables.release(req.request_id)
        req.status = Status.WAITING
        req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)


def _positions(req: Request, n: int) -> np.ndarray:
    return np.arange(req.num_computed, req.num_computed + n, dtype=np.int32)


__all__ = ["Chunk", "Scheduler", "OutOfPages"]
