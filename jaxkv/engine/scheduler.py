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
    slots: np.ndarray | None  # [num_tokens, L, Hkv] int32 (None: the engine computes slots on the device)
    steps: int = 0  # > 0: a multi-step decode chunk, `num_tokens` decode steps reserved ahead
    fresh: bool = False  # alone in its step, positions 0..n-1: attends over its own K/V (head_class_prefill)

    @property
    def samples(self) -> bool:
        """A chunk that reaches the last known token produces the next one."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, tables, allocator, prefix_cache, *, max_num_seqs: int, max_step_tokens: int,
                 max_fresh_tokens: int = 0, host_slots: bool = True):
        self.tables = tables
        self.allocator = allocator
        self.prefix = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        # > 0: a waiting fresh prompt of at most this many tokens prefills alone in one step (prefill first).
        self.max_fresh_tokens = max_fresh_tokens
        self.host_slots = host_slots  # False: chunks carry no slot arrays (device-resident tables)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # since start
        self.segments = None  # segment tiers (jaxkv/engine/segment_tiers.py): evict(n) moves idle ones off
        # offload(n) -> device pages freed by moving running requests' pages to host memory (the retrieval
        # host tier's progressive offload), tried before preempting; None: no offload.
        self.offload = None
        # Pages an offload pass frees beyond the need: one pass then serves many reservations, instead of
        # one pass per request per step (each pass scans every running request's tables and copies on the
        # host), the low/high watermark of a pager.
        self.offload_headroom = 0
        # admits(req) -> bool: whether a waiting request may start now; a method with a bounded per-request
        # state (retrieval state rows) says no while its rows are taken. A request it refuses stays in
        # line, and later ones are looked at past it (as vLLM skips requests whose LoRA cannot load).
        # None: every request.
        self.admits = None

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

    def schedule(self, decode_steps: int = 1, room=None) -> list[Chunk]:
        """This step's chunks. With ``decode_steps > 1``, nothing waiting that may start and every running
        request decoding, each request reserves up to ``decode_steps`` tokens ahead (``room(req)`` caps it:
        tokens it may still produce) and the chunks are multi-step decode chunks."""
        if decode_steps > 1 and self.running and all(r.num_pending == 1 for r in self.running) and not any(
                self.admits is None or self.admits(r) for r in self.waiting):
            return self._schedule_decode(decode_steps, room)
        fresh, looked_up = self._schedule_fresh()
        if fresh:
            return fresh
        chunks: list[Chunk] = []
        budget = self.max_step_tokens
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted while making room for an older request
                continue
            n = min(req.num_pending, budget)
            slots = self._reserve(req, n)
            if slots is _PREEMPTED:  # this request itself was preempted
                continue
            chunks.append(Chunk(req, req.num_computed, n, slots))
            budget -= n
        held = 0  # waiting requests `admits` refused this step, ahead of the one looked at
        while held < len(self.waiting) and budget > 0 and len(chunks) < self.max_num_seqs:
            req = self.waiting[held]
            if self.admits is not None and not self.admits(req):
                held += 1
                continue
            if (req.num_computed == 0 and self.prefix is not None and req.kv_policy is None
                    and req is not looked_up):
                self._adopt_prefix(req)
            n = min(req.num_pending, budget)
            if not self._make_room(self.tables.pages_needed(req.request_id, n), protect=None):
                break  # head-of-line waits until pages free up
            slots = self.tables.append(req.request_id, _positions(req, n), return_slots=self.host_slots)
            del self.waiting[held]
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(Chunk(req, req.num_computed, n, slots))
            budget -= n
        return chunks

    def _schedule_fresh(self) -> tuple[list[Chunk], Request | None]:
        """The head of the queue alone, whole prompt in one step, when it is fresh and longer than an
        ordinary step (-> chunks, the request whose prefix was looked up here)."""
        if not (self.max_fresh_tokens and self.waiting and len(self.running) < self.max_num_seqs):
            return [], None
        req = self.waiting[0]
        if self.admits is not None and not self.admits(req):
            return [], None
        if req.num_computed == 0 and self.prefix is not None and req.kv_policy is None:
            self._adopt_prefix(req)
        n = req.num_pending
        if req.num_computed or n > self.max_fresh_tokens or n <= self.max_step_tokens:
            return [], req  # cached prefix, too long, or short enough for an ordinary step
        if not self._make_room(self.tables.pages_needed(req.request_id, n), protect=None):
            return [], req
        slots = self.tables.append(req.request_id, _positions(req, n), through_pool=False,
                                   return_slots=self.host_slots)
        self.waiting.popleft()
        req.status = Status.RUNNING
        self.running.append(req)
        return [Chunk(req, 0, n, slots, fresh=True)], req

    def _schedule_decode(self, decode_steps: int, room) -> list[Chunk]:
        chunks = []
        for req in list(self.running):
            if req not in self.running:  # preempted while making room for an older request
                continue
            n = max(1, min(decode_steps, room(req) if room is not None else decode_steps))
            slots = self._reserve(req, n, sequential=True)
            if slots is not _PREEMPTED:
                chunks.append(Chunk(req, req.num_computed, n, slots, steps=n))
        return chunks

    def _adopt_prefix(self, req: Request) -> None:
        if req.wants_prompt_logprobs:  # cached prompt pages have no logits: prefill the whole prompt
            req.num_computed = req.num_cached = 0
            return
        num_cached, blocks = self.prefix.match(req.all_ids, req.extra_key)
        if num_cached:
            self.tables.adopt_prefix(req.request_id, blocks, num_cached)
        req.num_computed = num_cached
        req.num_cached = num_cached

    def _reserve(self, req: Request, n: int, sequential: bool = False):
        """Slots of ``n`` more tokens of ``req`` (None without host slots), or _PREEMPTED. ``sequential``:
        a multi-step decode chunk, one token per forward (HeadPageTables.append)."""
        need = self.tables.pages_needed(req.request_id, n)
        if not self._make_room(need, protect=req):
            self._preempt(req)
            return _PREEMPTED
        return self.tables.append(req.request_id, _positions(req, n), return_slots=self.host_slots,
                                  sequential=sequential)

    def _make_room(self, need: int, protect: Request | None) -> bool:
        """Frees pages until `need` fit: idle prefix-cache pages, idle segments (moved to host memory or the
        store), offload to host memory, then the newest running request."""
        while not self.allocator.can_allocate(need):
            if self.prefix is not None and self.prefix.evict(need - self.allocator.num_free) > 0:
                continue
            if self.segments is not None and self.segments.evict(need - self.allocator.num_free) > 0:
                continue
            if (self.offload is not None
                    and self.offload(need - self.allocator.num_free + self.offload_headroom) > 0):
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


_PREEMPTED = object()  # _reserve's answer when the request itself had to go


def _positions(req: Request, n: int) -> np.ndarray:
    return np.arange(req.num_computed, req.num_computed + n, dtype=np.int32)


__all__ = ["Chunk", "Scheduler", "OutOfPages"]
