"""Runs `Engine.step()` in one background thread and fans outputs out to asyncio queues.

The engine is not thread-safe, so it is touched only by this thread: HTTP handlers send commands
(add, abort, and `call` for anything else: segment registration, deletion, listing) through a queue, the
thread applies them between steps, steps while anything is unfinished, and hands each step's
`RequestOutput`s to the event loops of the requests that own them in one batch per loop (at most one
wake-up per step however many streams run: the engine thread never waits on output processing;
detokenization and SSE encoding happen on the event loop). One HTTP request may own several engine
requests (`n > 1`, batched prompts); they share one queue and are told apart by their choice index.

A step that raises fails only the requests it was running (they get an `EngineStepError`, their pages
are freed) and the loop goes on; the thread stops (`alive` False, /health 503) only after
`MAX_CONSECUTIVE_FAILURES` failed steps in a row, i.e. when the engine itself is broken.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

log = logging.getLogger("jaxkv.serve")


MAX_CONSECUTIVE_FAILURES = 8
STATS_INTERVAL_S = 0.05  # while busy, the /metrics gauges are refreshed at most this often (exact when idle)
DEFAULT_POLICY = "default"  # `add(kv_policy=...)` left out: the engine's own policy


class RequestFailed(RuntimeError):
    """The engine dropped this request before it ran (e.g. a segment it names was deleted meanwhile)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the request cannot be served."""


class EngineStepError(RuntimeError):
    """An engine step that ran this request raised; the request is failed, the engine goes on."""


@dataclass
class _Track:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    arrival: float
    last: float | None = None  # time of the last output with tokens
    prompt_tokens: int = 0


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self._engine = engine
        self._metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[str, _Track] = {}  # engine thread only
        self._inboxes: dict[asyncio.AbstractEventLoop, _Inbox] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._stopping = False
        self._lock = threading.Lock()
        self._inflight = 0  # engine requests submitted and not yet finished / aborted / failed
        self.error: str | None = None
        self.last_stats = None  # the latest EngineStats
        self._stats_at = 0.0  # perf_counter of the last refresh
        self.failed_steps = 0  # since start

    # ---------------------------------------------------------------------------- called from asyncio

    def start(self) -> None:
        self._thread.start()
        self._commands.put(self._refresh_stats)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_inflight(self) -> int:
        """Engine requests submitted and not yet finished, aborted or failed (any thread)."""
        return self._inflight

    def _count(self, delta: int) -> None:
        with self._lock:
            self._inflight += delta
        if self._metrics is not None:
            self._metrics.set_inflight(self._inflight)

    def try_reserve(self, n: int, capacity: int | None) -> bool:
        """Count `n` requests in flight if that stays within `capacity` (None: no bound); atomic, so a
        burst cannot overshoot. Each reserved unit is handed to `add(reserved=True)` or `release`d."""
        with self._lock:
            if capacity is not None and self._inflight + n > capacity:
                return False
            self._inflight += n
        if self._metrics is not None:
            self._metrics.set_inflight(self._inflight)
        return True

    def release(self, n: int) -> None:
        if n:
            self._count(-n)

    async def call(self, fn):
        """`fn(engine)` on the engine thread between two steps (never during one); returns its result or
        raises what it raised. For engine calls other than add / abort (segments, introspection)."""
        if not self.alive:
            raise EngineDeadError(self.error or "engine thread is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cmd():
            try:
                result = fn(self._engine)
            except BaseException as e:
                fut.set_exception(e)
            else:
                fut.set_result(result)

        self._commands.put(cmd)
        return await asyncio.wrap_future(fut)

    async def add(self, prompt_ids: list[int], sampling, out: asyncio.Queue, index: int,
                  extra_key: str | None = None, reserved: bool = False, request_id: str | None = None,
                  kv_policy=DEFAULT_POLICY, reuse: tuple | None = None) -> str:
        """Submit one engine request whose outputs go to `out` as `(index, [RequestOutput, ...])` (one
        step's outputs of the request, in order) or `(index, exception)` when it fails.

        `extra_key` namespaces the prefix cache (tenant isolation); `reserved`: its in-flight unit was
        taken by `try_reserve`. A caller that may be cancelled passes its own `request_id` so that it
        can abort the request whatever happens. `kv_policy`: DEFAULT_POLICY (the engine's), None (the
        full cache) or a CompressPolicy. `reuse`: (prefix ids, segment ids, suffix ids, ReusePolicy) for
        `Engine.add_reuse_request` (then `prompt_ids` is the whole prompt, for the metrics). Raises what the
        engine raises (ValueError for a request it refuses).
        """
        if not reserved:
            self._count(+1)
        if not self.alive:
            self._count(-1)
            raise EngineDeadError(self.error or "engine thread is not running")
        request_id = request_id or uuid.uuid4().hex
        track = _Track(asyncio.get_running_loop(), out, index, time.perf_counter(), None, len(prompt_ids))
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cmd():
            try:
                self._tracks[request_id] = track
                eng = self._engine
                if reuse is not None:
                    prefix, segments, suffix, method = reuse
                    eng.add_reuse_request(prefix, segments, suffix, reuse=method, sampling=sampling,
                                          request_id=request_id, extra_key=extra_key)
                elif kv_policy is DEFAULT_POLICY:
                    eng.add_request(list(prompt_ids), sampling, request_id=request_id, extra_key=extra_key)
                else:  # a policy object, or None: the full cache whatever the engine's default
                    eng.add_request(list(prompt_ids), sampling, request_id=request_id, extra_key=extra_key,
                                    kv_policy="full" if kv_policy is None else kv_policy)
            except BaseException as e:
                self._tracks.pop(request_id, None)
                self._count(-1)
                fut.set_exception(e)
            else:
                fut.set_result(request_id)

        self._commands.put(cmd)
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str, reason: str = "client") -> None:
        """Stop a request (client went away, stop string matched, timeout); frees its pages on the next
        turn. `reason` labels `jaxkv_requests_aborted_total`."""

        def cmd():
            track = self._tracks.pop(request_id, None)
            if track is None:
                return  # already finished
            self._count(-1)
            if self._metrics is not None:
                elapsed = time.perf_counter() - track.arrival
                self._metrics.observe_finished("abort", track.prompt_tokens, elapsed)
                self._metrics.observe_aborted(reason)
            self._engine.abort(request_id)

        self._commands.put(cmd)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # ---------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        consecutive = 0
        try:
            while not self._stopping:
                busy = self._engine.has_unfinished()
                self._apply_commands(block=not busy)
                if self._stopping:
                    break
                if not self._engine.has_unfinished():
                    continue
                try:
                    outputs = self._engine.step()
                except Exception as e:
                    consecutive += 1
                    self.failed_steps += 1
                    if consecutive >= MAX_CONSECUTIVE_FAILURES:
                        raise
                    self._fail_step(e)
                else:
                    consecutive = 0
                    self._dispatch(outputs)
                self._maybe_refresh_stats()
        except BaseException:
            self.error = traceback.format_exc()
            log.error("engine thread died:\n%s", self.error)
            err = EngineDeadError("the engine failed while serving this request; see the server log")
            for t in self._tracks.values():
                _post(t, (t.index, err))
            self._count(-len(self._tracks))
            self._tracks.clear()

    def _fail_step(self, e: Exception) -> None:
        """Fail the requests the raising step was running and free their pages.

        Which request caused it is unknown, so every request of the step fails (the scheduler's running
        set); when nothing was running the head of the waiting queue is blamed, so a request that breaks
        admission cannot fail step after step.
        """
        log.error("engine step failed; failing its requests", exc_info=e)
        sched = getattr(self._engine, "scheduler", None)
        if sched is None:
            blamed = list(self._tracks)
        else:
            blamed = [r.request_id for r in sched.running] or [r.request_id for r in list(sched.waiting)[:1]]
            reuser = getattr(self._engine, "reuser", None)
            if reuser is not None and reuser.waiting:  # a reuse prefill runs first in a step: its head too
                blamed.insert(0, reuser.waiting[0].req.request_id)
        err = EngineStepError(f"the engine failed on a step running this request: {type(e).__name__}: {e}")
        for rid in blamed:
            self._engine.abort(rid)
            track = self._tracks.pop(rid, None)
            if track is None:
                continue
            self._count(-1)
            if self._metrics is not None:
                self._metrics.observe_aborted("engine_error")
            _post(track, (track.index, err))

    def _apply_commands(self, block: bool) -> None:
        cmds = []
        if block:
            cmds.append(self._commands.get())
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            try:
                cmd()
            except Exception:  # a failed abort must not stop the loop for everyone
                log.exception("engine command failed")
        if cmds:
            self._maybe_refresh_stats()

    def _dispatch(self, outputs) -> None:
        """Hand a step's outputs over in one batch per event loop (not one callback per output): at most one
        wake-up of each loop per step, whatever the number of streams (`_Inbox`). A multi-step decode call
        gives one output per token; a request's outputs of one step travel as one item (one queue put, one
        metrics update for all its tokens), in order."""
        now = time.perf_counter()
        by_request: dict[str, list] = {}
        for out in outputs:  # step-major (every request's k-th token before any (k+1)-th): regroup
            outs = by_request.get(out.request_id)
            if outs is None:
                by_request[out.request_id] = [out]
            else:
                outs.append(out)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        metrics = self._metrics
        for rid, outs in by_request.items():
            track = self._tracks.get(rid)
            if track is None:
                continue  # aborted by the server in the meantime
            if metrics is not None:
                n_new = sum(len(o.new_token_ids) for o in outs)
                if n_new and track.last is None:  # the first token; any more in this step came with it
                    metrics.observe_tokens(True, now - track.arrival, 1)
                    if n_new > 1:
                        metrics.observe_tokens(False, 0.0, n_new - 1)
                elif n_new:
                    metrics.observe_tokens(False, now - track.last, n_new)
            if any(o.new_token_ids for o in outs):
                track.last = now
            last = outs[-1]
            item = outs
            if last.finished:
                del self._tracks[rid]
                self._count(-1)
                if last.finish_reason == "abort":  # dropped by the engine itself, not by us
                    item = RequestFailed(last.text or "the engine dropped the request")
                    if metrics is not None:
                        metrics.observe_aborted("error")
                if metrics is not None:
                    metrics.observe_finished(last.finish_reason, track.prompt_tokens, now - track.arrival)
            batch = batches.get(track.loop)
            if batch is None:
                batch = batches[track.loop] = []
            batch.append((track.queue, (track.index, item), last))
        for loop, batch in batches.items():
            inbox = self._inboxes.get(loop)
            if inbox is None:
                inbox = self._inboxes[loop] = _Inbox(loop)
            if not inbox.post(batch):  # "Event loop is closed" (its server stopped): stop what runs there
                del self._inboxes[loop]
                for _, _, out in batch:
                    if not out.finished and self._tracks.pop(out.request_id, None) is not None:
                        self._count(-1)
                        self._engine.abort(out.request_id)

    def _maybe_refresh_stats(self) -> None:
        """Refresh when idle (so /metrics is exact once requests end) or when the last is STATS_INTERVAL_S
        old: the gauges walk every page table, too dear for every step of a busy engine."""
        if time.perf_counter() - self._stats_at >= STATS_INTERVAL_S or not self._engine.has_unfinished():
            self._refresh_stats()

    def _refresh_stats(self) -> None:
        self._stats_at = time.perf_counter()
        self.last_stats = self._engine.stats()
        if self._metrics is not None:
            self._metrics.set_stats(self.last_stats)
            self._metrics.set_kv_stats(self._engine)


class _Inbox:
    """Outputs on their way to one event loop.

    The engine thread appends a step's batch and wakes the loop only when no wake-up is pending already:
    a loop that lags behind takes several steps' outputs in one callback, and the engine thread makes no
    system call (the self-pipe write of `call_soon_threadsafe`) that would hand the GIL over mid-step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._batches: collections.deque = collections.deque()  # append / popleft are thread-safe
        self._scheduled = False

    def post(self, batch: list) -> bool:
        """Engine thread. False when the loop is closed."""
        self._batches.append(batch)
        if self._scheduled:
            return not self.loop.is_closed()
        self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            return False
        return True

    def _drain(self) -> None:
        """Event loop: put every waiting item into its request's queue."""
        self._scheduled = False  # first: a batch appended from now on schedules another drain
        batches = self._batches
        while batches:
            for q, item, _ in batches.popleft():
                q.put_nowait(item)


def _post(track: _Track, item) -> bool:
    """Hand `item` to the request's event loop; False when that loop is closed (its server stopped)."""
    try:
        track.loop.call_soon_threadsafe(track.queue.put_nowait, item)
    except RuntimeError:  # "Event loop is closed": nobody is waiting for this request any more
        return False
    return True
