"""Runs `Engine.step()` in one background thread and fans outputs out to asyncio queues.

The engine is not thread-safe, so it is touched only by this thread: HTTP handlers send commands
(add, abort) through a queue, the thread applies them between steps, steps while anything is
unfinished, and hands each `RequestOutput` to the event loop of the request that owns it. One HTTP
request may own several engine requests (`n > 1`, batched prompts); they share one queue and are told
apart by their choice index.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass

log = logging.getLogger("jaxkv.serve")


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the request cannot be served."""


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
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._stopping = False
        self.error: str | None = None
        self.last_stats = None  # the latest EngineStats

    # ---------------------------------------------------------------------------- called from asyncio

    def start(self) -> None:
        self._thread.start()
        self._commands.put(self._refresh_stats)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    async def add(self, prompt_ids: list[int], sampling, out: asyncio.Queue, index: int) -> str:
        """Submit one engine request whose outputs go to `out` as `(index, RequestOutput)`.

        Raises what `Engine.add_request` raises (ValueError for a request the engine refuses).
        """
        if not self.alive:
            raise EngineDeadError(self.error or "engine thread is not running")
        request_id = uuid.uuid4().hex
        track = _Track(asyncio.get_running_loop(), out, index, time.perf_counter(), None, len(prompt_ids))
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def cmd():
            try:
                self._tracks[request_id] = track
                self._engine.add_request(list(prompt_ids), sampling, request_id=request_id)
            except BaseException as e:
                self._tracks.pop(request_id, None)
                fut.set_exception(e)
            else:
                fut.set_result(request_id)

        self._commands.put(cmd)
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Stop a request (client went away, stop string matched); frees its pages on the next turn."""

        def cmd():
            track = self._tracks.pop(request_id, None)
            if track is None:
                return  # already finished
            if self._metrics is not None:
                elapsed = time.perf_counter() - track.arrival
                self._metrics.observe_finished("abort", track.prompt_tokens, elapsed)
            try:
                self._engine.abort(request_id)
            except KeyError:
                pass

        self._commands.put(cmd)

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # ---------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = self._engine.has_unfinished()
                self._apply_commands(block=not busy)
                if self._stopping:
                    break
                if self._engine.has_unfinished():
                    outputs = self._engine.step()
                    self._dispatch(outputs)
                    self._refresh_stats()
        except BaseException:
            self.error = traceback.format_exc()
            log.error("engine thread died:\n%s", self.error)
            err = EngineDeadError("the engine failed while serving this request; see the server log")
            for t in self._tracks.values():
                t.loop.call_soon_threadsafe(t.queue.put_nowait, (t.index, err))
            self._tracks.clear()

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
            cmd()
        if cmds:
            self._refresh_stats()

    def _dispatch(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            track = self._tracks.get(out.request_id)
            if track is None:
                continue  # aborted by the server in the meantime
            n_new = len(out.new_token_ids)
            if self._metrics is not None and n_new:
                first = track.last is None
                self._metrics.observe_tokens(first, now - (track.arrival if first else track.last), n_new)
                track.last = now
            if out.finished:
                del self._tracks[out.request_id]
                if self._metrics is not None:
                    elapsed = now - track.arrival
                    self._metrics.observe_finished(out.finish_reason, track.prompt_tokens, elapsed)
            track.loop.call_soon_threadsafe(track.queue.put_nowait, (track.index, out))

    def _refresh_stats(self) -> None:
        self.last_stats = self._engine.stats()
        if self._metrics is not None:
            self._metrics.set_stats(self.last_stats)
