"""The engine: request intake, one scheduled device step at a time, stop logic, statistics.

A few lines of glue between the host scheduler / page tables and the device runner; everything
that decides lives in `scheduler.py` and `jaxkv.cache`, everything that computes in `runner.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random

import jax
import numpy as np

from jaxkv.cache.allocator import PageAllocator
from jaxkv.cache.head_classes import HeadClassMap, all_global, load_or_default
from jaxkv.cache.prefix import PrefixCache
from jaxkv.cache.tables import HeadPageTables
from jaxkv.engine import compilations
from jaxkv.engine.buckets import bucket_for, powers_of_two
from jaxkv.engine.code_maps import MapGuard
from jaxkv.engine.compression import Compressor
from jaxkv.engine.config import (  # noqa: F401  (DEFAULT_*: re-exported)
    DEFAULT_DECODE_STEPS,
    DEFAULT_KV_CACHE_BYTES,
    LAYER_LOOPS,
    EngineConfig,
)
from jaxkv.engine.detok import TextStream
from jaxkv.engine.device_tables import DeviceTables
from jaxkv.engine.request import Request, RequestOutput, Status
from jaxkv.engine.retrieval import Retriever, is_retrieval
from jaxkv.engine.reuse import Reuser
from jaxkv.engine.runner import DecodeBatch, ModelRunner, PendingDecode, StepBatch
from jaxkv.engine.scheduler import Chunk, Scheduler
from jaxkv.policies import CompressPolicy, get_policy
from jaxkv.policies.retrieve import RetrievalPolicy
from jaxkv.sampling import MAX_LOGPROBS, SamplingParams

# An offload pass frees this fraction of the pool beyond its need (Scheduler.offload_headroom).
OFFLOAD_HEADROOM_DIV = 64
FRESH_MIN_TOKENS = 256  # fresh prompts at least this long prefill through head_class_prefill
# Page-table widths come in a few classes: the narrowest holds PAGE_CLASS_MIN pages, each next one
# PAGE_CLASS_FACTOR times more, the widest every page of max_model_len and the reuse slack (32K tokens at
# page 16: 32, 256 and 2048 pages). A wider table costs the kernels only empty split programs (each unit's
# split size follows its own length); each class is a set of step variants. Accelerators take the widest
# class alone by default (`EngineConfig.page_classes`): on an H100 the 1B decode steps of 32 x 1K and
# SpeContext's 16 x 1K-4K took the same time over a 2,049-page table as over their own class.
PAGE_CLASS_MIN = 32
PAGE_CLASS_FACTOR = 8
# The smallest bucket of a decode's sequences and of a ragged step's tokens on an accelerator. A step of
# that few rows reads the weights once whatever its rows (a 1B step is bound by weight bytes far past 64
# rows), so smaller buckets buy no speed there and each costs a set of programs at a cold start. On the
# CPU, where a row costs its compute, the buckets start at 2 sequences and 8 tokens.
ACCEL_MIN_DECODE_SEQS = 8
ACCEL_MIN_STEP_TOKENS = 64


def page_classes(context_pages: int, max_pages: int, count: int | None = None) -> tuple[int, ...]:
    """Page-table widths a step compiles for: PAGE_CLASS_MIN, each next PAGE_CLASS_FACTOR times wider, the
    widest `max_pages` (the context's pages and the reuse slack); the widest `count` of them (None: all)."""
    widths = powers_of_two(context_pages, start=min(PAGE_CLASS_MIN, context_pages),
                           factor=PAGE_CLASS_FACTOR)[:-1] + (max_pages,)
    return widths[-count:] if count else widths


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    pages_total: int
    pages_in_use: int
    pages_in_use_by_class: dict[str, int]
    prefix_cache_queries: int  # lookups since start
    prefix_cache_hits: int  # lookups that reused at least one block
    prefix_cache_query_tokens: int  # prompt tokens looked up
    prefix_cache_hit_tokens: int  # of those, tokens served from cached pages
    num_preemptions: int  # since start
    host_pages_total: int = 0  # host-only pages of the retrieval offload (retrieval_host_pages)
    host_pages_in_use: int = 0  # of those, held by requests (pages_in_use_by_class counts them too)
    pages_offloaded: int = 0  # device pages moved to host pages since start
    retrieval_rows_total: int = 0  # retrieval state rows (retrieval_max_seqs)
    retrieval_rows_in_use: int = 0  # of those, held by running requests (later ones wait for a free row)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache (unless the process already set a directory), so a
    restarted engine loads its compiled steps from disk. Directory: ``path``, else
    ``$JAXKV_COMPILATION_CACHE``, else ``~/.cache/jaxkv/xla``; an empty ``$JAXKV_COMPILATION_CACHE``
    turns it off. Returns the directory."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = path if path is not None else os.environ.get(
        "JAXKV_COMPILATION_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jaxkv", "xla"))
    if not path:
        return None
    jax.config.update("jax_compilation_cache_dir", os.fspath(path))
    return os.fspath(path)


def _with_layer_loop(model, option: str | None):
    """`model` with its layers in the form the layer loop wants (jaxkv/models/llama.py): a list (unrolled),
    `SharedLayers` (one traced layer body) or stacked leaves (scan). The loop: `option`, else
    $JAXKV_LAYER_LOOP, else "shared" for a layer list (what jaxkv.load returns), else the model's own form."""
    from jaxkv.models import llama

    loop = option or os.environ.get("JAXKV_LAYER_LOOP") or None
    if loop is not None and loop not in LAYER_LOOPS:
        raise ValueError(f"layer loop must be one of {list(LAYER_LOOPS)} (got {loop!r}; JAXKV_LAYER_LOOP)")
    layers = model.params["layers"]
    form = ("shared" if isinstance(layers, llama.SharedLayers) else "unrolled"
            if isinstance(layers, list | tuple) else "scan")
    if loop is None:
        loop = "shared" if form == "unrolled" else form
    if loop == form:
        return model
    if getattr(model, "mesh", None) is not None:
        if option or os.environ.get("JAXKV_LAYER_LOOP"):
            raise ValueError("layer_loop: a tensor-parallel model keeps the layer form it was placed with")
        return model
    convert = {"unrolled": llama.unshare_layers, "shared": llama.share_layers, "scan": llama.stack_layers}
    params = model.params if form != "scan" else llama.unshare_layers(model.params)
    return dataclasses.replace(model, params=convert[loop](params))


class Engine:
    def __init__(self, model, config: EngineConfig | None = None, **options):
        """`config` (jaxkv.engine.config.EngineConfig), or its fields as keywords, section fields by their
        flat names (`retrieval_host_tier=True`, `segment_anchor="none"`; `EngineConfig.from_kwargs`)."""
        c = self.config = EngineConfig.from_kwargs(config, **options)
        num_pages, page_size, max_num_seqs = c.num_pages, c.page_size, c.max_num_seqs
        max_model_len, max_step_tokens, head_classes = c.max_model_len, c.max_step_tokens, c.head_classes
        enable_prefix_caching, kv_dtype = c.enable_prefix_caching, c.kv_dtype
        kv_cache_bytes = c.kv_cache_bytes
        attn_impl, decode_steps, max_prefill_tokens = c.attn_impl, c.decode_steps, c.max_prefill_tokens
        kv_policy, kv_budget, kv_merge = c.kv_policy, c.kv_budget, c.kv_merge
        cfg = model.config
        enable_compilation_cache()
        compilations.install()
        model = _with_layer_loop(model, c.layer_loop)
        self.model = model
        self.tokenizer = model.tokenizer
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.head_classes = _resolve_head_classes(head_classes, model)
        mesh, tp = getattr(model, "mesh", None), 1  # tensor parallel over KV heads (docs/parallel.md)
        host_pages = _host_pages(c.retrieval.host_pages, c.retrieval.host_tier)
        if host_pages and mesh is not None:
            raise ValueError("retrieval_host_pages is not supported with tensor parallelism: the retrieval "
                             "host tier keeps a single-device host mirror of the pool")
        if mesh is not None:
            from jaxkv.parallel import setup_engine
            self.head_classes, tp = setup_engine(model, self.head_classes)
        sink, window = self.head_classes.sink_window_arrays(cfg.layer_windows)
        self._kinds = self.head_classes.kinds()
        # Pages per head: the token context's, plus slack for the page-alignment holes of reuse layouts
        # (SegmentConfig.max_segments); positions stay within max_model_len.
        self.context_pages = math.ceil(self.max_model_len / page_size)
        self.slack_pages = c.segments.max_segments + 1 if c.segments.max_segments else 0
        self.max_pages_per_head = self.context_pages + self.slack_pages
        self.kv_policy = _resolve_policy(kv_policy, kv_budget, model)
        # `kv_merge`: the pool holds a logit bias per slot, which compression policies with merge=True need
        # (docs/policies.md, "LSE-preserving merge"); default: on iff the engine-wide policy merges.
        self.kv_merge = bool(getattr(self.kv_policy, "merge", False)) if kv_merge is None else bool(kv_merge)
        if getattr(self.kv_policy, "merge", False) and not self.kv_merge:
            raise ValueError(f"kv_policy {self.kv_policy.name!r} merges evicted tokens; it needs "
                             "kv_merge=True")
        if num_pages is None:
            itemsize = np.dtype(kv_dtype or jax.tree_util.tree_leaves(model.params)[0].dtype).itemsize
            # K + V + int32 slot position (+ float32 logit bias with kv_merge)
            per_page = page_size * (2 * cfg.head_dim * itemsize + 4 + 4 * self.kv_merge)
            want = max_num_seqs * cfg.num_layers * cfg.num_kv_heads * self.max_pages_per_head
            num_pages = max(cfg.num_layers * cfg.num_kv_heads * 2, min(want, tp * kv_cache_bytes // per_page))
        if mesh is not None:
            from jaxkv.parallel.allocator import ShardedPageAllocator
            num_pages = -(-num_pages // tp) * tp
            self.allocator = ShardedPageAllocator(num_pages, tp, cfg.num_kv_heads)
        else:
            self.allocator = PageAllocator(num_pages, host_pages=host_pages)
        self.tables = HeadPageTables(cfg.num_layers, cfg.num_kv_heads, page_size, self.allocator, sink,
                                     window, max_step_tokens)
        # Page tables and per-head counters live on the device, updated from the host tables' journal;
        # steps compute their slots and lengths there (jaxkv/engine/device_tables.py).
        self.device_tables = DeviceTables(self.tables, self.max_pages_per_head, max_num_seqs)
        # Sharing a prefix's pages is exact only when every head keeps its full history (docs/cache.md), and
        # a compression policy rewrites pages in place, so it turns sharing off too.
        sharable = enable_prefix_caching and bool((window == 0).all()) and self.kv_policy is None
        self.prefix = PrefixCache(self.allocator, page_size) if sharable else None
        self.runner = ModelRunner(model, num_pages=num_pages, page_size=page_size, sink=sink, window=window,
                                  kv_dtype=kv_dtype, attn_impl=attn_impl, mesh=mesh, kv_merge=self.kv_merge,
                                  greedy_programs=(jax.default_backend() == "cpu" if c.greedy_programs is None
                                                   else c.greedy_programs),
                                  rolled_from_tokens=c.rolled_from_tokens)
        # A fresh prompt longer than a step prefills alone through head_class_prefill (with the Pallas
        # kernels); its local heads keep only what their ring holds, so rings stay sized by max_step_tokens.
        fresh = (max_prefill_tokens or self.max_model_len) if self.runner.use_plan else 0
        self.scheduler = Scheduler(self.tables, self.allocator, self.prefix, max_num_seqs=max_num_seqs,
                                   max_step_tokens=max_step_tokens, max_fresh_tokens=fresh,
                                   host_slots=False)
        self.page_size = page_size
        self.decode_steps = decode_steps
        self.pipeline_decode = c.pipeline_decode  # dispatch decode call t+1 before reading call t (step())
        self.code_maps = MapGuard()  # XLA:CPU: drops compiled variants near the host's mapping cap
        self.compressor = Compressor(self)
        # Segment store + reuse prefill (jaxkv/engine/reuse.py; options: config.SegmentConfig).
        reuse_hc = c.segments.head_classes
        if reuse_hc is not None and not isinstance(reuse_hc, HeadClassMap):
            reuse_hc = HeadClassMap.load(reuse_hc)
        self.reuser = Reuser(self, reuse_head_classes=reuse_hc, anchor=c.segments.anchor,
                             start=c.segments.start, ffn_cache_bytes=c.segments.ffn_cache_bytes)
        # Retrieval policies' decode (jaxkv/engine/retrieval.py; options: config.RetrievalConfig). Measured:
        # in-place reads 4.64 -> 3.04 ms a step (H200, 1B, batch 64, 8K); overlapped host loads 1.09x on the
        # 1B shape's large diffs, 0.89x on the embedded model's (docs/specontext.md).
        r = c.retrieval
        self.retriever = Retriever(self, host_tier=r.host_tier, resident=r.resident, inplace=r.inplace,
                                   overlap=r.host_overlap, eager=r.host_eager, max_rows=r.max_seqs)
        if mesh is not None and _retrieves(self.kv_policy):
            self.retriever.params_for(self.kv_policy)  # its head in placed order, or a clear error now
        # `retrieval_host_pages` (host tier only): pages of host memory that retrieval requests' older K/V
        # move to when the device pool runs short (progressive offload), before anything is preempted.
        if host_pages:
            self.scheduler.offload = self.retriever.buffers.offload
            self.scheduler.offload_headroom = self.allocator.num_pages // OFFLOAD_HEADROOM_DIV
        # At least 2 sequence rows: with one, every projection is a vector-matrix product that XLA GPU lowers
        # to a multiply fusion writing W-sized temporaries + a reduce (3x the weight bytes; H200 trace,
        # docs/benchmarks.md); a padding row keeps them GEMMs at no extra weight traffic.
        accel = jax.default_backend() != "cpu"
        rows = max(max_num_seqs, 2)
        self._seq_buckets = powers_of_two(rows, start=min(ACCEL_MIN_DECODE_SEQS if accel else 2, rows))
        # Few buckets: small steps and short page lists pad up rather than compile their own variant. A
        # ragged step's row count follows its token bucket (a step of T tokens has at most T rows), so its
        # shapes depend on tokens and page-table width only (a few width classes, PAGE_CLASS_MIN).
        self._token_buckets = powers_of_two(
            max_step_tokens, start=min(ACCEL_MIN_STEP_TOKENS if accel else 8, max_step_tokens))
        # The slack widens the widest class instead of adding one: no step variants for it.
        self._page_buckets = page_classes(self.context_pages, self.max_pages_per_head, c.page_classes if
                                          c.page_classes is not None or jax.default_backend() == "cpu" else 1)
        top = self._token_buckets[-1]  # fresh prompts longer than a step: powers of two above it
        self._fresh_buckets = tuple(b for b in powers_of_two(self.scheduler.max_fresh_tokens, start=top)
                                    if b > top) if self.scheduler.max_fresh_tokens > top else ()
        self.segments_restored = 0
        self.largest_step_scratch: tuple[int, tuple | None] = (0, None)  # bytes, variant (after precompile)
        self.step_cache_hits = 0  # programs precompile took from the step cache (jaxkv/engine/step_cache.py)
        self.program_loader = None  # the thread loading kept programs after `precompile(background=True)`
        self.program_writer = None  # the thread keeping compiled programs after `precompile(background=True)`
        self.precompiled_by_kind: dict[str, int] = {}  # distinct programs of the last precompile, per owner
        self.precompiled_by_variant: dict[str, int] = {}  # distinct programs precompiled, per variant kind
        if c.segments.store:  # registered segments persist there; the committed ones load now, no prefill
            from jaxkv.engine.segment_persist import PersistentSegments

            self.reuser.persist = PersistentSegments(self.reuser, c.segments.store)
            self.segments_restored = self.reuser.persist.restore()
        self._requests: dict[str, Request] = {}
        # The decode call on the device whose results are not read yet: (chunks, PendingDecode) or None.
        self._inflight: tuple[list[Chunk], PendingDecode] | None = None
        self._ids = itertools.count()
        self._rng = random.Random(0)
        self._eos = set(self.tokenizer.eos_token_ids) if self.tokenizer is not None else set()

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, prompt_ids, sampling: SamplingParams | None = None, request_id: str | None = None,
                    extra_key: str | None = None, kv_policy: CompressPolicy | str | None = None,
                    kv_budget: float | None = None, *, _queue: bool = True) -> str:
        """Queues a request. `kv_policy` / `kv_budget` override the engine's KV policy for it (a policy
        object, a name from jaxkv.policies.POLICIES with an optional budget, or "full" for the full cache)."""
        sampling = sampling or SamplingParams()
        ids = _id_array(prompt_ids)
        if not ids.size:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        prompt_ids = ids.tolist()
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the maximum model length is "
                             f"{self.max_model_len} (prompt + at least one generated token)")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        total = min(len(prompt_ids) + sampling.max_tokens, self.max_model_len)
        if self.tables.pages_needed(None, total) > self.allocator.num_pages:
            raise ValueError(f"a request of {total} tokens needs more KV pages than the pool holds "
                             f"({self.allocator.num_pages}); raise num_pages or lower max_tokens")
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(32)
        detokenize = self.tokenizer is not None and (sampling.detokenize or bool(sampling.stop))
        stream = TextStream(self.tokenizer.decode, prompt_ids, sampling.stop) if detokenize else None
        policy = self.kv_policy if kv_policy is None and kv_budget is None else _resolve_policy(
            kv_policy if kv_policy is not None else self.kv_policy, kv_budget, self.model)
        if getattr(policy, "merge", False) and not self.kv_merge:
            raise ValueError(f"KV policy {policy.name!r} merges evicted tokens; this engine was built "
                             "without a per-slot logit bias (Engine(kv_merge=True))")
        wants_extras = sampling.logprobs or sampling.prompt_logprobs is not None
        if _retrieves(policy) and getattr(self.model, "mesh", None) is not None:
            self.retriever.params_for(policy)  # a placement its selection cannot serve is refused here
        if _retrieves(policy) and wants_extras and _queue:  # (reuse: full-cache decode)
            raise ValueError(f"top logprobs and prompt logprobs are not available with the retrieval policy "
                             f"{policy.name!r}; only the sampled token's logprob is")
        req = Request(request_id, prompt_ids, sampling, seed=seed & 0xFFFFFFFF, extra_key=extra_key,
                      stream=stream, kv_policy=policy)
        self._requests[request_id] = req
        if _queue:
            self.scheduler.add(req)
        return request_id

    def add_reuse_request(self, prefix_ids, segments, suffix_ids, reuse="naive",
                          sampling: SamplingParams | None = None, request_id: str | None = None,
                          extra_key: str | None = None) -> str:
        """Queues a prompt ``prefix | segments | suffix`` whose segments reuse cached K/V
        (jaxkv/engine/reuse.py).

        `segments`: segment ids (`register_segment`) or token lists (registered on first sight) in namespace
        `extra_key`; `reuse`: a method name from jaxkv.policies.reuse.REUSE_POLICIES or a ReusePolicy.
        Raises jaxkv.cache.segments.SegmentError (a ValueError) for a segment the request may not use.
        """
        if sampling is not None and sampling.prompt_logprobs is not None:
            raise ValueError("prompt logprobs are not available with segment reuse: the reused segments' "
                             "tokens are not recomputed, so they have no logits")
        policy = self.reuser.check(segments, extra_key, reuse)
        seg_ids = [self.reuser.store.get(s, extra_key).tokens if isinstance(s, str) else s for s in segments]
        prompt = np.concatenate([_id_array(part) for part in (prefix_ids, *seg_ids, suffix_ids)])
        request_id = self.add_request(prompt, sampling, request_id, extra_key, _queue=False)
        if _retrieves(self._requests[request_id].kv_policy):
            self._requests[request_id].kv_policy = None  # reuse prefill fills no retrieval state: full decode
        self.reuser.add(self._requests[request_id], prefix_ids, segments, suffix_ids, policy)
        return request_id

    def register_segment(self, token_ids, extra_key: str | None = None, frozen: bool = False,
                         context=None, tier: str | None = None) -> str:
        """Prefills `token_ids` once into the segment store (after the anchor, and after `context` tokens
        when given, whose K/V are dropped: the segment as it was in an earlier prompt); returns its id.
        `tier` ("device" or "host"): where a frozen segment stays (jaxkv/engine/segment_tiers.py)."""
        return self.reuser.register(token_ids, extra_key, frozen, context=context, tier=tier).segment_id

    def delete_segment(self, segment_id: str, extra_key: str | None = None) -> None:
        self.reuser.store.delete(segment_id, extra_key)
        if self.reuser.persist is not None:
            self.reuser.persist.delete(segment_id)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and self.reuser.remove(req):
            req.status, req.finish_reason = Status.FINISHED, "abort"
            return
        if req is not None and not req.finished:
            self.scheduler.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"

    def precompile(self, progress: bool = True, workers: int | None = None, logprobs: bool = False,
                   presses=None, step_cache=None, background: bool = False, retrieval=(), reuse=()) -> int:
        """Compiles every step variant this engine can hit (progress bar + one log line); returns how many.
        Call before serving so no request waits on a compile (docs/engine.md). `workers`: compile threads.
        `logprobs`: also the variants of requests that ask for logprobs (about twice as many). `presses`:
        compression policies whose programs compile too (default: every press on an accelerator, the
        engine-wide one on the CPU; `warmup.press_programs`). `step_cache`: where compiled programs are kept
        for the next start (jaxkv/engine/step_cache.py; None: the default, on accelerators; False: off).
        `background`: programs found there load on a background thread after this returns (`program_loader`);
        a step that needs one before loads it itself (a load, never a compile); and the programs it compiled
        are written there by another (`program_writer`). `retrieval`: retrieval
        policies (or names) that requests may ask for, whose variants compile too (the engine-wide one does
        anyway). `reuse`: segment-reuse methods (or names) whose passes compile in the same pool run
        (`precompile_reuse`), so the pool never drains between the steps and the passes."""
        from jaxkv.engine.warmup import precompile
        from jaxkv.policies.reuse import resolve_reuse

        reuse = list(dict.fromkeys(resolve_reuse(m) for m in reuse))  # every name checked first
        if reuse and self.tables.local.any():
            raise ValueError("segment reuse needs an engine whose heads all keep full history "
                             "(head_classes='all_global', server: --head-classes global)")

        wanted = [self.kv_policy] if _retrieves(self.kv_policy) else []
        wanted += [_resolve_policy(p, None, self.model) for p in retrieval]
        wanted = list(dict.fromkeys(wanted))  # each retrieval policy's own variants, once
        # Under tensor parallelism the retrieval programs compile serially, each run once on its padding
        # inputs (the sharded programs are not lowered ahead of time); elsewhere on the warm-up pool.
        serial = wanted if self.runner.mesh is not None else []
        tp = self.runner.mesh is not None
        n = precompile(self, progress, workers, logprobs, presses, step_cache, background,
                       retrieval=[] if serial else wanted, reuse=[] if tp else reuse)
        for policy in serial:
            n += self.retriever.precompile(policy, progress)
        if tp and reuse:
            n += self.reuser.precompile(reuse, progress)
        return n

    def precompile_reuse(self, reuse="redknot", progress: bool = True) -> int:
        """Compiles the pass of a segment-reuse method (or of each of a list) for every token and row bucket
        a request can hit; returns how many. Call before serving, with no segments registered yet or not: the
        passes write nothing (docs/policies.md, "Buckets")."""
        return self.reuser.precompile(reuse, progress)

    @property
    def page_widths(self) -> tuple[int, ...]:
        """Page-table widths (pages per head) the step programs compile for (`EngineConfig.page_classes`)."""
        return self._page_buckets

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.reuser.waiting)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled device call (after any reuse prefills waiting). A multi-step decode call returns one
        output per generated token (in order), so streaming stays token by token.

        Decode calls are pipelined: while one is on the device, the next one for the same requests is
        scheduled and dispatched (fed from the first call's last tokens on the device) before the first
        call's results are read, so the host's per-call work overlaps the device (docs/engine.md)."""
        if self._inflight is None:
            self.code_maps.check()
        outputs = self.reuser.step() if self.reuser.waiting else []
        if outputs:  # reuse prefills' first tokens go out now, not after the decode call that would follow
            return outputs
        if self._inflight is None:
            chunks = self.scheduler.schedule(self.decode_steps, room=self._room)
            if not chunks:
                return outputs
            if not chunks[0].steps:
                return outputs + self._step_ragged(chunks)
            self._inflight = (chunks, self._dispatch_decode(chunks))
        chunks, pending = self._inflight
        following = self._continue(chunks, pending)
        outputs += self._collect(chunks, pending)
        if following is not None and all(c.request.finished for c in following[0]):
            following = None  # every request stopped in the call just read: nothing to keep
        self._inflight = following
        return outputs

    def _step_ragged(self, chunks: list[Chunk]) -> list[RequestOutput]:
        outputs = []
        tokens, logprobs, extras = self._run_ragged(chunks)
        for row, chunk in enumerate(chunks):
            req = chunk.request
            sampled = chunk.samples
            if extras[row] is not None and "prompt" in extras[row]:
                _store_prompt_logprobs(chunk, extras[row])
            req.num_computed += chunk.num_tokens
            if (self.prefix is not None and req.kv_policy is None
                    and chunk.start < len(req.prompt_ids) <= req.num_computed):
                self._cache_prefix(req)  # the prompt just finished prefilling
            if not sampled:
                continue
            req.output_ids.append(int(tokens[row]))
            req.output_logprobs.append(float(logprobs[row]))
            self._check_stop(req)
            top = extras[row].get("top") if extras[row] is not None and req.sampling.logprobs else None
            outputs.append(self._output(req, [int(tokens[row])], [float(logprobs[row])],
                                        None if top is None else [_pairs(*top, req.sampling.logprobs)]))
            if req.finished:
                self.scheduler.remove(req)
                self._requests.pop(req.request_id, None)
        self.compressor.after_step([c.request for c in chunks])
        return outputs

    def _run_ragged(self, chunks: list[Chunk]):
        """The step's device call(s): tokens, logprobs [>= len(chunks)] and per chunk the logprob extras it
        asked for (`_chunk_extras`), or None. Chunks asking extras never go through the retrieval step (a
        retrieval request may not ask them; others sharing its step run in a call of their own)."""
        if not self.retriever.active(chunks):
            return self._run_plain(chunks)
        plain = [i for i, c in enumerate(chunks) if not is_retrieval(c.request)]
        if not any(_wants_extras(chunks[i]) for i in plain):
            tokens, logprobs = self.retriever.run(chunks)
            return tokens, logprobs, [None] * len(chunks)
        ret = [i for i in range(len(chunks)) if i not in plain]
        tokens, logprobs = np.zeros(len(chunks), np.int32), np.zeros(len(chunks), np.float32)
        t, lp = self.retriever.run([chunks[i] for i in ret])
        tokens[ret], logprobs[ret] = t[:len(ret)], lp[:len(ret)]
        t, lp, ex = self._run_plain([chunks[i] for i in plain])
        tokens[plain], logprobs[plain] = t[:len(plain)], lp[:len(plain)]
        extras = [None] * len(chunks)
        for j, i in enumerate(plain):
            extras[i] = ex[j]
        return tokens, logprobs, extras

    def _run_plain(self, chunks: list[Chunk]):
        b = self._build_batch(chunks)
        tokens, logprobs, ex = self.runner.run_extras(b)
        return tokens, logprobs, _chunk_extras(chunks, ex)

    # ---- pipelined multi-step decode ----------------------------------------------------------
    def _dispatch_decode(self, chunks: list[Chunk], prev=None) -> PendingDecode:
        """Dispatches a multi-step decode call without waiting. Each request's reserved tokens count as
        computed from now on (a request that stops early finishes, so the count never overshoots)."""
        for c in chunks:
            c.request.num_computed = c.start + c.num_tokens
        if self.retriever.active(chunks):
            return self.retriever.decode(chunks, prev=prev)
        return self.runner.decode(self._build_decode(chunks, prev))

    def _continue(self, chunks: list[Chunk], pending: PendingDecode):
        """The next decode call for the same requests, dispatched before `pending` is read, or None when
        the host must look at the results first: something waits to be admitted, a request may finish on
        length or is due for compression after `pending`, pages would have to be freed, or the call cannot
        chain (several policies in one step)."""
        reqs = [c.request for c in chunks]
        if (not self.pipeline_decode or pending.last is None or self.scheduler.waiting or self.reuser.waiting
                or len(self.scheduler.running) != len(reqs)
                or any(r.finished or r not in self.scheduler.running for r in reqs)):
            return None
        sizes = []
        for c in chunks:
            req = c.request
            if isinstance(req.kv_policy, CompressPolicy) and (
                    req.kv_compressed_at is None or req.kv_compressed_epoch != req.num_preemptions):
                return None  # its prefill-end compression runs between two calls
            room = self._room(req, ahead=c.num_tokens)
            if room <= 0:
                return None  # it finishes on length in `pending`, or compresses after it
            sizes.append(min(self.decode_steps, room))
        need = sum(self.tables.pages_needed(c.request.request_id, n) for c, n in zip(chunks, sizes))
        if not self.allocator.can_allocate(need):
            return None
        following = []
        for c, n in zip(chunks, sizes):
            start = c.start + c.num_tokens
            slots = self.tables.append(c.request.request_id, np.arange(start, start + n, dtype=np.int32),
                                       return_slots=False, sequential=True)
            following.append(Chunk(c.request, start, n, slots, steps=n))
        prev = (pending.last, [c.num_tokens for c in chunks])
        return following, self._dispatch_decode(following, prev)

    def _collect(self, chunks: list[Chunk], pending: PendingDecode) -> list[RequestOutput]:
        """Waits for a decode call and turns its tokens into outputs; rows of requests that finished (or
        were aborted) before this call's tokens are read are dropped."""
        tokens, logprobs, ran = pending.result()
        top = pending.top_result()  # None unless a request asked for alternatives
        outputs = []
        for k in range(tokens.shape[0]):  # step-major: every request's k-th token before any (k+1)-th
            for row, chunk in enumerate(chunks):
                req = chunk.request
                if req.finished or k >= chunk.num_tokens or not ran[k, row]:
                    continue
                tok, lp = int(tokens[k, row]), float(logprobs[k, row])
                req.output_ids.append(tok)
                req.output_logprobs.append(lp)
                self._check_stop(req)
                alts = None
                if top is not None and req.sampling.logprobs:
                    alts = [_pairs(top[0][k, row], top[1][k, row], req.sampling.logprobs)]
                outputs.append(self._output(req, [tok], [lp], alts))
                if req.finished:  # its pages reserved past this token go back with the rest
                    self.scheduler.remove(req)
                    self._requests.pop(req.request_id, None)
        self.compressor.after_step([c.request for c in chunks])
        return outputs

    def _room(self, req: Request, ahead: int = 0) -> int:
        """Tokens a running request may decode in one call once `ahead` more tokens are out (a call still
        on the device): what it may still produce (max_tokens, max_model_len), and no further than its
        policy's next compression. <= 0: none before the host looks (it finishes, or compresses, first);
        the scheduler decodes at least one token."""
        out, total = len(req.output_ids) + ahead, req.num_tokens + ahead
        room = min(req.sampling.max_tokens - out, self.max_model_len - total)
        pol = req.kv_policy
        if pol is not None and getattr(pol, "decode_interval", 0) and req.kv_compressed_at is not None:
            room = min(room, pol.decode_interval - (out - req.kv_compressed_at))
        return room

    def _stop_ids(self, req: Request) -> set[int]:
        """Every token that ends `req` by `_stops` (for the decode loop, which stops a row on the device)."""
        return {t for t in (*req.sampling.stop_token_ids, *self._eos) if self._stops(req, t)}

    def _build_decode(self, chunks: list[Chunk], prev=None) -> DecodeBatch:
        """`prev` = (last tokens [S] on the device, tokens each row produced in that call): the batch of a
        call dispatched before the previous one's results reached the host."""
        K = self.decode_steps
        S = bucket_for(len(chunks), self._seq_buckets)
        seq_ids = [c.request.request_id for c in chunks]
        P = bucket_for(max(self.tables.max_pages(s) for s in seq_ids), self._page_buckets)
        stops = [sorted(self._stop_ids(c.request)) for c in chunks]
        M = max(4, 1 << (max(len(x) for x in stops) - 1).bit_length())  # few buckets: 4, 8, 16, ...
        page_table, slots, lengths, prev_lengths, active = self.device_tables.decode_meta(
            seq_ids, [c.num_tokens for c in chunks], S, P, K)
        b = DecodeBatch(
            tokens=np.zeros(S, np.int32), positions=np.zeros(S, np.int32), slots=slots, lengths=lengths,
            prev_lengths=prev_lengths, active=active, page_table=page_table,
            stop_ids=np.full((S, M), -1, np.int32), temperature=np.zeros(S, np.float32),
            top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32), seeds=np.zeros(S, np.uint32),
            counters=np.zeros(S, np.int32))
        for row, c in enumerate(chunks):
            req = c.request
            b.tokens[row] = req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]
            b.positions[row] = c.start
            b.stop_ids[row, :len(stops[row])] = stops[row]
            sp = req.sampling
            b.temperature[row], b.top_k[row], b.top_p[row] = sp.temperature, sp.top_k, sp.top_p
            b.seeds[row], b.counters[row] = req.seed, len(req.output_ids)
        if prev is not None:
            b.tokens = prev[0]
            b.counters[:len(chunks)] += np.asarray(prev[1], np.int32)
        if any(c.request.sampling.logprobs for c in chunks):
            b.top_width = MAX_LOGPROBS
        return b

    def step_rows(self, T: int) -> int:
        """Rows of a ragged step of T tokens: a function of T alone, so (T, P) names its variant."""
        return bucket_for(min(T, self._seq_buckets[-1]), self._seq_buckets)

    def fresh_pages(self, T: int) -> int:
        """Page-table width of a fresh prompt's step of T tokens (the pages its T positions need)."""
        return bucket_for(min(-(-T // self.page_size), self.max_pages_per_head), self._page_buckets)

    def _build_batch(self, chunks: list[Chunk]) -> StepBatch:
        T = bucket_for(sum(c.num_tokens for c in chunks), self._token_buckets + self._fresh_buckets)
        S = self.step_rows(T)
        seq_ids = [c.request.request_id for c in chunks]
        fresh = chunks[0].fresh or (self.runner.use_plan and len(chunks) == 1 and chunks[0].start == 0
                                    and chunks[0].num_tokens >= FRESH_MIN_TOKENS)
        P = bucket_for(max(self.tables.max_pages(s) for s in seq_ids), self._page_buckets)
        if fresh:
            P = max(P, self.fresh_pages(T))
        b = StepBatch(
            tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32), q_seq=np.full(T, -1, np.int32),
            slots=None, page_table=None, lengths=None, logits_index=np.zeros(S, np.int32),
            temperature=np.zeros(S, np.float32), top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
            seeds=np.zeros(S, np.uint32), counters=np.zeros(S, np.int32))
        tok_idx = np.zeros(T, np.int32)  # index of each token among its row's new tokens
        off = 0
        for row, c in enumerate(chunks):
            req, n = c.request, c.num_tokens
            b.tokens[off:off + n] = _ids(req, c.start, n)
            b.positions[off:off + n] = np.arange(c.start, c.start + n)
            tok_idx[off:off + n] = np.arange(n)
            b.q_seq[off:off + n] = row
            b.logits_index[row] = off + n - 1
            sp = req.sampling
            b.temperature[row], b.top_k[row], b.top_p[row] = sp.temperature, sp.top_k, sp.top_p
            b.seeds[row], b.counters[row] = req.seed, len(req.output_ids)
            off += n
        b.page_table, b.lengths, b.slots = self.device_tables.step_meta(
            seq_ids, [c.num_tokens for c in chunks], S, P, b.q_seq, tok_idx)
        b.fresh = fresh
        _logprob_fields(b, chunks)
        return b

    # ---- stop logic ---------------------------------------------------------------------------
    def _stops(self, req: Request, token: int) -> bool:
        """The stop rule: the request's `stop_token_ids`, and EOS unless it ignores EOS (no set built per
        token)."""
        sp = req.sampling
        return token in sp.stop_token_ids or (not sp.ignore_eos and token in self._eos)

    def _check_stop(self, req: Request) -> None:
        sp, last = req.sampling, req.output_ids[-1]
        out_of_room = len(req.output_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len
        stream = req.stream
        if self._stops(req, last):
            req.finish_reason = "stop"  # counted as an output token, never shown as text
        elif stream is not None:
            stream.add([last], final=out_of_room)
            if stream.stopped:
                req.finish_reason = "stop"
        if req.finish_reason is None and out_of_room:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            req.status = Status.FINISHED
        if stream is not None:
            req.text = stream.visible(final=req.finished)

    def _output(self, req: Request, new_ids, new_logprobs, new_top=None) -> RequestOutput:
        """`new_top`: per new token its alternatives (SamplingParams.logprobs). The first output with a token
        carries the prompt's logprobs when they were asked for."""
        out = RequestOutput(req.request_id, new_ids, req.text, req.finished, req.finish_reason,
                            len(req.prompt_ids), len(req.output_ids), new_logprobs, req.num_cached,
                            new_top_logprobs=new_top)
        if new_ids and req.wants_prompt_logprobs:
            out.prompt_logprobs, out.prompt_top_logprobs = _prompt_output(req)
            req.prompt_lp_sent, req.prompt_lp, req.prompt_top = True, None, None
        return out

    def _cache_prefix(self, req: Request) -> None:
        lists = self.tables.page_lists(req.request_id)  # [layer][kv_head] -> page ids
        num_blocks = len(req.prompt_ids) // self.page_size
        blocks = [np.array([[pages[b] for pages in row] for row in lists], np.int32)
                  for b in range(num_blocks)]
        self.prefix.insert(req.prompt_ids[:num_blocks * self.page_size], blocks, req.extra_key)

    # ---- introspection ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        by_class = dict.fromkeys(self.head_classes.counts(), 0)
        by_class.update(self.tables.pages_in_use_by_kind(self._kinds))
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            pages_total=self.allocator.num_pages,
            pages_in_use=self.allocator.num_pages - self.allocator.num_free,
            pages_in_use_by_class=by_class,
            prefix_cache_queries=self.prefix.queries if self.prefix else 0,
            prefix_cache_hits=self.prefix.hits if self.prefix else 0,
            prefix_cache_query_tokens=self.prefix.query_tokens if self.prefix else 0,
            prefix_cache_hit_tokens=self.prefix.hit_tokens if self.prefix else 0,
            num_preemptions=self.scheduler.num_preemptions,
            host_pages_total=getattr(self.allocator, "host_pages", 0),
            host_pages_in_use=getattr(self.allocator, "host_pages", 0)
            - getattr(self.allocator, "num_free_host", 0),
            pages_offloaded=self.retriever.buffers.pages_offloaded,
            retrieval_rows_total=self.retriever.max_rows,
            retrieval_rows_in_use=self.retriever.rows_in_use())


# ---- logprob extras (top alternatives, prompt logprobs) ----------------------------------------------


def _wants_extras(c: Chunk) -> bool:
    return bool(c.request.sampling.logprobs) or _wants_prompt(c)


def _wants_prompt(c: Chunk) -> bool:
    """The chunk holds prompt positions whose next token's logprob is still owed."""
    return c.request.wants_prompt_logprobs and c.start < len(c.request.prompt_ids) - 1


def _logprob_fields(b: StepBatch, chunks: list[Chunk]) -> None:
    """Sets the step's logprob variant: alternatives (static width MAX_LOGPROBS) when a row or a prompt asks
    for them, and the next prompt token of every position that owes a prompt logprob."""
    prompt = [c for c in chunks if _wants_prompt(c)]
    if any(c.samples and c.request.sampling.logprobs for c in chunks) or any(
            c.request.sampling.prompt_logprobs for c in prompt):
        b.top_width = MAX_LOGPROBS
    if not prompt:
        return
    b.prompt_next = np.full(b.tokens.shape[0], -1, np.int32)
    off = 0
    for c in chunks:
        if _wants_prompt(c):
            ids = c.request.prompt_ids
            end = min(c.start + c.num_tokens, len(ids) - 1)  # position p scores prompt token p + 1
            b.prompt_next[off:off + end - c.start] = ids[c.start + 1:end + 1]
        off += c.num_tokens


def _chunk_extras(chunks: list[Chunk], ex: dict) -> list[dict | None]:
    """The step's extras (host arrays from `ModelRunner.run_extras`) cut per chunk: "top" (ids, logprobs)
    [W] of its sampled row; "prompt" [n] and "prompt_top" ([n, W] each) of its positions."""
    if not ex:
        return [None] * len(chunks)
    out, off = [], 0
    for row, c in enumerate(chunks):
        d = {}
        if "top" in ex:
            d["top"] = (ex["top"][0][row], ex["top"][1][row])
        if "prompt" in ex and _wants_prompt(c):
            n = c.num_tokens
            d["prompt"] = ex["prompt"][off:off + n]
            if "prompt_top" in ex:
                d["prompt_top"] = (ex["prompt_top"][0][off:off + n], ex["prompt_top"][1][off:off + n])
        off += c.num_tokens
        out.append(d)
    return out


def _store_prompt_logprobs(c: Chunk, ex: dict) -> None:
    """Position p of the chunk scored prompt token p + 1: keep it at index p + 1 (a chunked prefill fills
    the request's arrays piece by piece; a recompute after preemption writes the same values again)."""
    req = c.request
    n_prompt = len(req.prompt_ids)
    if req.prompt_lp is None:
        req.prompt_lp = np.full(n_prompt, np.nan, np.float32)
        if "prompt_top" in ex:
            w = ex["prompt_top"][0].shape[-1]
            req.prompt_top = (np.zeros((n_prompt, w), np.int32), np.zeros((n_prompt, w), np.float32))
    end = min(c.start + c.num_tokens, n_prompt - 1)
    m = end - c.start
    req.prompt_lp[c.start + 1:end + 1] = ex["prompt"][:m]
    if req.prompt_top is not None and "prompt_top" in ex:
        req.prompt_top[0][c.start + 1:end + 1] = ex["prompt_top"][0][:m]
        req.prompt_top[1][c.start + 1:end + 1] = ex["prompt_top"][1][:m]


def _prompt_output(req: Request):
    """(logprobs, alternatives) per prompt token for RequestOutput; the first token has neither."""
    n = len(req.prompt_ids)
    k = req.sampling.prompt_logprobs
    lp = req.prompt_lp if req.prompt_lp is not None else np.full(n, np.nan, np.float32)
    logprobs = [None] + [float(x) for x in lp[1:]]
    if not k or req.prompt_top is None:
        return logprobs, [None] + [[] for _ in range(n - 1)]
    ids, lps = req.prompt_top
    return logprobs, [None] + [_pairs(ids[j], lps[j], k) for j in range(1, n)]


def _pairs(ids, lps, k: int) -> list[tuple[int, float]]:
    return [(int(i), float(x)) for i, x in zip(ids[:k], lps[:k])]


def _host_pages(n, host_tier: bool) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"retrieval_host_pages must be an integer >= 0 (got {n!r})")
    if n and not host_tier:
        raise ValueError("retrieval_host_pages is host memory of the retrieval host tier: it needs "
                         "retrieval_host_tier=True")
    return int(n)


def _resolve_policy(policy, budget, model) -> CompressPolicy | RetrievalPolicy | None:
    """A policy object, a registered name (with an optional budget), or None (full cache). Compression
    policies (jaxkv/policies/compress) rewrite the cache; retrieval policies (jaxkv/policies/retrieve) keep it
    and make decode attention read a per-head selection (jaxkv/engine/retrieval.py)."""
    if policy is None or policy == "full":
        if budget is not None:
            raise ValueError("kv_budget needs a kv_policy")
        return None
    if isinstance(policy, str):
        from jaxkv.policies import POLICIES

        if _retrieves(POLICIES.get(policy)):
            policy = get_policy(policy, **({} if budget is None else {"budget": _token_budget(budget)}))
        else:
            policy = get_policy(policy, **({} if budget is None else {"budget": budget}))
        if _retrieves(policy):
            return _bind_retrieval(policy, model)
    elif isinstance(policy, RetrievalPolicy):
        if budget is not None:
            policy = dataclasses.replace(policy, budget=_token_budget(budget))
        return _bind_retrieval(policy, model)
    elif not isinstance(policy, CompressPolicy):
        raise ValueError(f"kv_policy must be a policy name, a CompressPolicy or a RetrievalPolicy "
                         f"(got {type(policy).__name__})")
    elif budget is not None:
        policy = dataclasses.replace(policy, budget=budget)
    return policy.bind(model)


def _retrieves(policy) -> bool:
    """Whether a KV policy (an instance or a registered class; None = full cache) decodes through the
    retrieval seam, by the kind it declares."""
    return getattr(policy, "kind", None) == "retrieval"


def _token_budget(budget) -> int:
    """A retrieval budget is tokens per KV head per decode step: a positive integer (1024.0 is accepted)."""
    if isinstance(budget, bool) or not isinstance(budget, int | float) or budget < 1 or budget != int(budget):
        raise ValueError(f"a retrieval policy's kv_budget is tokens per KV head, a positive integer "
                         f"(got {budget!r})")
    return int(budget)


_RETRIEVAL_CHECKED: set = set()  # (policy class, model path, model id) whose parameters loaded once


def _bind_retrieval(policy: RetrievalPolicy, model) -> RetrievalPolicy:
    """Checks the policy's parameters load for this model (e.g. a retrieval head shipped beside it); once
    per policy class and model, so per-request policies do not re-read files."""
    policy = policy.for_model(model)
    key = (type(policy), str(getattr(model, "path", "")), getattr(model, "model_id", ""))
    if key not in _RETRIEVAL_CHECKED:
        policy.load_params(model)
        _RETRIEVAL_CHECKED.add(key)
    return policy


def _id_array(ids) -> np.ndarray:
    """Token ids as a 1-D int64 array: an integer array or list in one numpy pass (a 33K-token prompt's
    range is then checked by numpy, not by Python's min / max over a list), anything else element by element
    (int() raises on what is not an id)."""
    arr = np.asarray(ids) if not isinstance(ids, str) else None
    if arr is not None and arr.ndim == 1 and (arr.dtype.kind in "iu" or arr.size == 0):
        return arr.astype(np.int64, copy=False)
    return np.asarray([int(t) for t in ids], np.int64).reshape(-1)


def _ids(req: Request, start: int, n: int) -> list[int]:
    """Token ids ``start .. start + n - 1`` of a request without concatenating its whole history."""
    p = len(req.prompt_ids)
    if start + n <= p:
        return req.prompt_ids[start:start + n]
    if start >= p:
        return req.output_ids[start - p:start - p + n]
    return req.prompt_ids[start:] + req.output_ids[:start + n - p]


def _resolve_head_classes(head_classes, model) -> HeadClassMap:
    cfg = model.config
    if isinstance(head_classes, HeadClassMap):
        hc = head_classes
    elif head_classes is not None:
        hc = HeadClassMap.load(head_classes)
    elif getattr(model, "path", None):
        hc = load_or_default(model.path, cfg.num_layers, cfg.num_kv_heads)
    else:
        hc = all_global(cfg.num_layers, cfg.num_kv_heads)
    if (hc.num_layers, hc.num_kv_heads) != (cfg.num_layers, cfg.num_kv_heads):
        raise ValueError(f"head-class map is for {hc.num_layers} layers x {hc.num_kv_heads} KV heads; "
                         f"the model has {cfg.num_layers} x {cfg.num_kv_heads}")
    return hc
