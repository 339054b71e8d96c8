"""Prometheus metrics of the server (its own registry, so several apps can live in one process).

Gauges are refreshed from `Engine.stats()` by the engine thread (at most every 50 ms while busy, and
whenever it goes idle); latency histograms are observed when outputs are handed to requests. Names are
listed in docs/serving.md.
"""

from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        lab = ["model_name"]
        self._model = model_name
        g = lambda name, doc, extra=(): Gauge(name, doc, lab + list(extra), registry=r)
        c = lambda name, doc, extra=(): Counter(name, doc, lab + list(extra), registry=r)
        h = lambda name, doc, buckets: Histogram(name, doc, lab, buckets=buckets, registry=r)

        self.running = g("jaxkv_num_requests_running", "Engine requests scheduled (holding KV pages).")
        self.waiting = g("jaxkv_num_requests_waiting", "Engine requests queued or preempted.")
        self.pages_in_use = g("jaxkv_kv_pages_in_use", "KV pages held by running requests, by head class.",
                              ["head_class"])
        self.pages_allocated = g("jaxkv_kv_pages_allocated", "KV pages taken from the pool (running "
                                 "requests plus pages kept by the prefix cache).")
        self.pages_total = g("jaxkv_kv_pages_total", "KV pages in the pool.")
        self.pages_usage = g("jaxkv_kv_cache_usage_ratio", "jaxkv_kv_pages_allocated / jaxkv_kv_pages_total.")
        self.prefix_hit_rate = g("jaxkv_prefix_cache_hit_rate",
                                 "Prefix-cache hits / queries since start (0..1).")
        self.prefix_queries = g("jaxkv_prefix_cache_queries", "Prefix-cache lookups since start.")
        self.prefix_hits = g("jaxkv_prefix_cache_hits", "Prefix-cache lookups that hit, since start.")
        self.preemptions = g("jaxkv_num_preemptions", "Requests preempted since start.")
        self.host_pages_in_use = g("jaxkv_kv_host_pages_in_use", "Host-memory KV pages held by requests "
                                   "(SpeContext offload, --retrieval-host-pages).")
        self.pages_offloaded = g("jaxkv_kv_pages_offloaded", "Device KV pages moved to host memory since "
                                 "start.")
        self.preemptions_total = c("jaxkv_preemptions", "Preemptions (a running request's pages freed to "
                                   "make room; it is recomputed later).")
        self.pages_free = g("jaxkv_kv_pages_free", "KV pages free in the pool.")
        self.retrieval_rows = g("jaxkv_retrieval_state_rows", "Retrieval state rows (SpeContext requests "
                                "that may run at once, --retrieval-max-seqs).")
        self.retrieval_rows_in_use = g("jaxkv_retrieval_state_rows_in_use", "Retrieval state rows held by "
                                       "running requests; later ones wait for a free row.")
        self.inflight = g("jaxkv_num_requests_in_flight", "Engine requests admitted by the server and not "
                          "yet finished (running + waiting); bounded by --max-queued-requests.")
        self.aborted = c("jaxkv_requests_aborted", "Engine requests stopped before they finished, by reason.",
                         ["reason"])
        self.rejected_by_reason = c("jaxkv_requests_rejected", "HTTP requests refused with an error, by "
                                    "reason (the error code, e.g. queue_full, body_too_large).", ["reason"])
        self._last_preemptions = 0
        # KV compression policies and segment reuse (docs/serving.md).
        self.compressions = c("jaxkv_kv_compressions", "Compression passes run by the KV policies (one "
                              "device call compresses every due request of one policy).")
        self.pages_freed = c("jaxkv_kv_pages_freed_by_compression", "KV pages freed by compression.")
        self.segments = g("jaxkv_segments", "Segments in the segment store (all namespaces).")
        self.segment_pages = g("jaxkv_segment_pages", "KV pages referenced by the segment store.")
        self.reuse_requests = c("jaxkv_reuse_requests", "Generations that reused segments, by method.",
                                ["method"])
        # Segment tiers (docs/segments.md).
        self.segment_bytes = g("jaxkv_segment_bytes", "Bytes of segment K/V + positions per tier (device "
                               "pool pages, host memory, persistent store).", ["tier"])
        self.segment_promotions = c("jaxkv_segment_promotions", "Segments (or some of their KV heads) "
                                    "copied to the device for a request, from host memory or the store.")
        self.segment_demotions = c("jaxkv_segment_demotions", "Segments moved off the device to make "
                                   "room in the KV pool.")
        self.segment_bytes_moved = c("jaxkv_segment_bytes_moved", "Segment bytes copied between tiers, by "
                                     "direction (promote: to the device; demote: device to host memory).",
                                     ["direction"])
        self.segment_bytes_skipped = c("jaxkv_segment_bytes_not_promoted", "Bytes of KV heads left off the "
                                       "device because the request's reuse method does not read them.")
        self.segment_drops = c("jaxkv_segment_drops", "Ordinary segments dropped because no tier had room "
                               "(no segment store and host memory full); registered again on next use.")
        self._last_tiers = (0, 0, 0, 0, 0, 0)
        self._last_kv = (0, 0)
        self.step_compilations = c("jaxkv_step_compilations", "Step-program variants compiled (or loaded "
                                   "from the persistent compilation cache) since start: the engine's "
                                   "steps, decodes, compression rewrites, retrieval decodes, reuse passes.")
        self.xla_compilations = c("jaxkv_xla_compilations", "XLA programs of this process since start, by "
                                  "source (compiled by XLA, or loaded from the persistent cache).",
                                  ["source"])
        self._last_compiles = {"step": 0, "compiled": 0, "persistent_cache": 0}

        self.ttft = h("jaxkv_time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS)
        self.itl = h("jaxkv_inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = h("jaxkv_e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.prompt_tokens = c("jaxkv_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = c("jaxkv_generation_tokens", "Generated tokens.")
        self.finished = c("jaxkv_request_finished", "Finished engine requests by reason.", ["finish_reason"])
        self.rejected = c("jaxkv_http_request_errors", "HTTP requests answered with an error.", ["status"])
        self._token_children: tuple | None = None

    def set_stats(self, s) -> None:
        """Refresh the gauges from an `EngineStats`."""
        m = self._model
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        for cls, n in s.pages_in_use_by_class.items():
            self.pages_in_use.labels(m, cls).set(n)
        self.pages_allocated.labels(m).set(s.pages_in_use)
        self.pages_total.labels(m).set(s.pages_total)
        self.pages_usage.labels(m).set(s.pages_in_use / s.pages_total if s.pages_total else 0.0)
        q, hits = s.prefix_cache_queries, s.prefix_cache_hits
        self.prefix_queries.labels(m).set(q)
        self.prefix_hits.labels(m).set(hits)
        self.prefix_hit_rate.labels(m).set(hits / q if q else 0.0)
        self.preemptions.labels(m).set(s.num_preemptions)
        self.host_pages_in_use.labels(m).set(s.host_pages_in_use)
        self.pages_offloaded.labels(m).set(s.pages_offloaded)
        if s.num_preemptions > self._last_preemptions:
            self.preemptions_total.labels(m).inc(s.num_preemptions - self._last_preemptions)
            self._last_preemptions = s.num_preemptions
        self.pages_free.labels(m).set(s.pages_total - s.pages_in_use)
        self.retrieval_rows.labels(m).set(s.retrieval_rows_total)
        self.retrieval_rows_in_use.labels(m).set(s.retrieval_rows_in_use)
        for counter in (self.compressions, self.pages_freed):  # present (at 0) from the start
            counter.labels(m)

    def set_kv_stats(self, engine) -> None:
        """Counters of the engine's compressor and segment store (engine thread)."""
        m = self._model
        comp = getattr(engine, "compressor", None)
        if comp is not None:
            n, freed = comp.num_compressions, comp.pages_freed
            if n > self._last_kv[0]:
                self.compressions.labels(m).inc(n - self._last_kv[0])
            if freed > self._last_kv[1]:
                self.pages_freed.labels(m).inc(freed - self._last_kv[1])
            self._last_kv = (max(n, self._last_kv[0]), max(freed, self._last_kv[1]))
        reuser = getattr(engine, "reuser", None)
        if reuser is not None:
            self.segments.labels(m).set(len(reuser.store))
            self.segment_pages.labels(m).set(reuser.store.num_pages)
        tiers = getattr(reuser, "tiers", None)
        if tiers is not None:
            for tier, n in tiers.totals().items():
                self.segment_bytes.labels(m, tier).set(n)
            now = (tiers.promotions, tiers.demotions, tiers.bytes_promoted, tiers.bytes_demoted,
                   tiers.bytes_promoted_all_heads - tiers.bytes_promoted, tiers.drops)
            moved = self.segment_bytes_moved
            targets = (self.segment_promotions.labels(m), self.segment_demotions.labels(m),
                       moved.labels(m, "promote"), moved.labels(m, "demote"),
                       self.segment_bytes_skipped.labels(m), self.segment_drops.labels(m))
            for counter, new, old in zip(targets, now, self._last_tiers):
                if new > old:
                    counter.inc(new - old)
            self._last_tiers = tuple(max(a, b) for a, b in zip(now, self._last_tiers))

    def set_compilations(self) -> None:
        """Advances the compilation counters to the process's counts (jaxkv.engine.compilations)."""
        from jaxkv.engine import compilations

        m, last = self._model, self._last_compiles
        now = {"step": compilations.step_programs(), **compilations.xla_programs()}
        if now["step"] > last["step"]:
            self.step_compilations.labels(m).inc(now["step"] - last["step"])
        self.step_compilations.labels(m)
        for source in ("compiled", "persistent_cache"):
            if now[source] > last[source]:
                self.xla_compilations.labels(m, source).inc(now[source] - last[source])
            self.xla_compilations.labels(m, source)
        self._last_compiles = {k: max(now[k], last[k]) for k in last}

    def observe_reuse(self, method: str) -> None:
        self.reuse_requests.labels(self._model, method).inc()

    def set_inflight(self, n: int) -> None:
        self.inflight.labels(self._model).set(n)

    def observe_aborted(self, reason: str) -> None:
        self.aborted.labels(self._model, reason).inc()

    def observe_tokens(self, first: bool, seconds: float, tokens: int) -> None:
        """`tokens` new tokens of one request arrived `seconds` after arrival (first) or the last ones.

        Runs on the engine thread for every request of every step: the labelled children are looked up
        once and a burst of `tokens` inter-token gaps is counted in one update, not `tokens` observations."""
        ttft, itl, generated = self._token_children or self._cache_token_children()
        if first:
            ttft.observe(seconds)
        else:
            _observe_times(itl, seconds / max(tokens, 1), tokens)
        generated.inc(tokens)

    def _cache_token_children(self) -> tuple:
        m = self._model
        self._token_children = (self.ttft.labels(m), self.itl.labels(m), self.generation_tokens.labels(m))
        return self._token_children

    def observe_finished(self, reason: str | None, prompt_tokens: int, seconds: float) -> None:
        self.finished.labels(self._model, reason or "unknown").inc()
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.e2e.labels(self._model).observe(seconds)

    def observe_error(self, status: int, reason: str) -> None:
        self.rejected.labels(self._model, str(status)).inc()
        self.rejected_by_reason.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _observe_times(child, amount: float, times: int) -> None:
    """`child.observe(amount)` `times` times in one update of the histogram's sum and bucket (falls back
    to a loop where the client library's histogram keeps other internals)."""
    bounds, buckets, total = (getattr(child, k, None) for k in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for _ in range(times):
            child.observe(amount)
        return
    total.inc(amount * times)
    buckets[bisect.bisect_left(bounds, amount)].inc(times)
