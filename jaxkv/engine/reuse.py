"""Engine side of segment reuse: register segments, lay out a request's pages, run the reuse prefill.

A reuse request is ``prefix | segments | suffix`` plus a method (`jaxkv.policies.reuse`). Segments are named
by id (registered before, e.g. a frozen knowledge base) or given as tokens (looked up by content, prefilled
by the engine on first sight). Admission (`step`, before the scheduler's step) lays the prompt out in fresh
pages per (layer, KV head): the prefix from storage slot 0, then every reused segment from a page boundary
(the tail of the page before it is a hole: position -1, invisible to every attention path), then the
suffix right after the last segment. One jitted call (`reuse_prefill`) copies the segments' pages there
with their RoPE delta, recomputes what the method asks for and samples the first token; the request then
decodes in the ordinary step loop. Reused K/V never enter the prefix cache (they are approximate); a
preempted reuse request is recomputed in full like any other.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.allocator import OutOfPages
from jaxkv.cache.head_classes import HeadClassMap, load_or_default
from jaxkv.cache.segments import SegmentEntry, SegmentError, SegmentStore
from jaxkv.engine.buckets import bucket_for
from jaxkv.engine.programs import Programs
from jaxkv.engine.request import Request, Status
from jaxkv.engine.reuse_steps import (
    one_row_step,
    page_width,
    prepare_call,
    row_stats,
    row_table_calls,
    run_rows,
    run_selected,
    runs_as_steps,
    selection_calls,
)
from jaxkv.engine.segment_tiers import DEFAULT_HOST_BYTES, SegmentTiers
from jaxkv.models import llama
from jaxkv.policies.reuse import Layout, ReusePolicy, resolve_reuse
from jaxkv.policies.reuse.apply import layer_groups, offset_group_ok, reuse_prefill
from jaxkv.policies.reuse.base import PROBE_CHUNK
from jaxkv.policies.reuse.ffn_cache import SegmentFFNCache
from jaxkv.sampling import top_logprobs_host

# Shapes of a reuse pass whose sparse-phase rows are a subset of the prompt (naive, EPIC, CacheBlend,
# SparseX; docs/policies.md, "Buckets"): the token bucket T is a power of two (floor `TOKEN_FLOOR`) capped at
# the context's own bucket, and the rows R the smallest of `row_ladder(T)` that holds them: `MIN_ROWS`, then
# powers of two up to T/16 (small counts, such as naive's or EPIC's new text: at most 63 padded rows, else at
# most 2x), steps of T/32 from T/16 to T/4 (the default 15 % selections of SparseX and CacheBlend with their
# forced rows, padded at most 1.5x, 1.14x near T/4), then T/2 and T. Up to a 32K context: 7 token buckets,
# 76 passes per method (114 with 8-row and 128-token floors); 37 at 4K (66). A method whose rows are its
# tokens (RedKnot) has one bucket of both (`token_rows_bucket`): 19 passes at 32K, 7 at 4K (41 and 17 with
# an 8-row floor and 8 steps per doubling). The bucket changes no token: RedKnot's FFN runs on the same
# share of the prompt's rows whatever the bucket (`ffn_capacity_rows` of the valid rows, as data).
ROW_STEPS = 32    # the ladder's step between T/16 and T/4 is T / ROW_STEPS
# Buckets of a pass whose rows are its tokens: powers of two from TOKEN_ROWS_FLOOR to 2K, then
# TOKEN_ROWS_STEPS per doubling (padding at most 25 %; 8.9 % on average over prompts of 2K-32K tokens,
# 4.4 % with 8 steps). Every row is computed in every layer, so padding costs its share of the pass; each
# bucket costs a compile of ~10 s on an H100 (30-40 s beside 15 others at a cold start), and 8 steps per
# doubling (41 buckets at 32K) made RedKnot's passes 45 % of a cold start's compile work.
TOKEN_ROWS_FLOOR = 512
TOKEN_ROWS_STEPS = 4
# The fewest sparse-phase rows of a method that recomputes a subset: a pass of fewer rows runs the same
# program with padding rows (masked), which at a few dozen rows of one prompt costs next to nothing, and the
# floor takes the 8-, 16- and 32-row buckets out of every ladder.
MIN_ROWS = 64
# The smallest token bucket of a method that recomputes a subset: below 512 slots the pass's per-token work
# (its dense layers, page copies and table) is small, and the 128- and 256-token buckets' ladders go.
TOKEN_FLOOR = 512
# Layer-group programs of a reuse pass whose segments come up from host memory or the store, each dispatched
# after its own layers' transfers, so group g+1's transfer runs while group g computes; and the groups whose
# transfers go out before the first program (each later group's goes out just before the program
# PROMOTE_AHEAD groups ahead of it). Measured on an H100 (8B shape, 8 segments, 4.33 GB from host memory):
# naive 0.176 s in 8 groups one ahead against 0.213 s in one program, SparseX 0.369 s against 0.431 s
# (docs/segments.md, "Layer groups").
LAYER_GROUPS = 8
PROMOTE_AHEAD = 1


@dataclasses.dataclass
class ReuseStats:
    """What one reuse prefill did (per request)."""

    method: str
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose K/V came from segments
    recomputed_rows: list[int]  # per layer: prompt tokens run through the layer (query rows)
    kv_writes: list[int]  # per layer: (token, KV head) K/V written
    ffn_rows: list[int]  # per layer: tokens through the FFN
    promoted_heads: list[int]  # per layer: local heads promoted by RedKnot's edge-mass restore
    keys_seen: list[int]  # per layer: sum over query rows of the keys they may see (causal, windowed heads
    # counted with their window, mean over KV heads)
    prefill_s: float  # wall clock of the reuse prefill (copy + forward + first token), segment prefill
    # excluded
    first_logits: np.ndarray | None = None

    @property
    def recompute_fraction(self) -> float:
        """Share of the reused tokens' (layer, KV head) K/V recomputed."""
        if not self.reused_tokens:
            return 1.0
        new = self.prompt_tokens - self.reused_tokens
        per_head = np.asarray(self.kv_writes, np.float64) / max(self.heads, 1) - new
        return float(np.clip(per_head / self.reused_tokens, 0, 1).mean())

    heads: int = 1
    layer_groups: int = 1  # programs the pass ran in (> 1: segments promoted beside it, layer group by group)
    # host seconds from admission to the dispatch of its first program (a promoted page write or the pass):
    # until then the device has nothing of this request to run beside the transfers
    host_before_program_s: float = 0.0
    # per layer: rows the sparse FFN chose but its capacity dropped (lowest mass first; with RedKnot's
    # ffn_select="deviation" every reused row is a candidate, so this counts every reused row it skipped)
    ffn_dropped: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Pending:
    req: Request
    prefix: list[int]
    segments: list  # str ids or token lists
    suffix: list[int]
    policy: ReusePolicy


def resolve_anchor(anchor, cfg) -> tuple[int, ...]:
    """The tokens a segment is prefilled after: "bos" (the default) = the model's BOS token when it has one,
    None or () = none, or explicit token ids."""
    if anchor == "bos":
        return () if cfg.bos_token_id is None else (int(cfg.bos_token_id),)
    if anchor is None:
        return ()
    if isinstance(anchor, str):
        raise ValueError(f"segment_anchor must be 'bos', None or token ids (got {anchor!r})")
    return tuple(int(t) for t in anchor)


class Reuser:
    """`anchor`: tokens every segment is prefilled after, at positions 0..a-1, its own K/V kept from position
    a. A model trained on prompts that start with BOS uses position 0 as its attention sink; a segment
    prefilled alone would make its own first token that sink, and every reused K/V would carry it
    (docs/policies.md, "Segment anchor"). The anchor's K/V are dropped, and the anchor is part of a
    segment's identity (two anchors never share pages)."""

    def __init__(self, engine, reuse_head_classes: HeadClassMap | None = None, keep_logits: bool = False,
                 anchor="bos", start: int | None = None, ffn_cache_bytes: int | None = None):
        self.engine = engine
        cfg = engine.model.config
        self.cfg = cfg
        self.page_size = engine.page_size
        self.anchor = resolve_anchor(anchor, cfg)
        if self.anchor and (min(self.anchor) < 0 or max(self.anchor) >= cfg.vocab_size):
            raise ValueError(f"segment_anchor token ids must lie in [0, {cfg.vocab_size})")
        # `start`: the position of a segment's first token (default: right after the anchor); a larger one
        # leaves a gap, as if the segment sat deeper in a prompt
        self.start = len(self.anchor) if start is None else int(start)
        if self.start < len(self.anchor):
            raise ValueError(f"segment_start {self.start} is inside the anchor ({len(self.anchor)} tokens)")
        model_id = str(getattr(engine.model, "model_id", "model"))
        if self.anchor:
            model_id += f"+anchor{list(self.anchor)}"
        if self.start != len(self.anchor):
            model_id += f"+start{self.start}"
        self.store = SegmentStore(engine.allocator, engine.page_size, model_id)
        self.persist = None  # PersistentSegments when the engine has a segment store (segment_persist.py)
        # Device / host / store placement of the segments (jaxkv/engine/segment_tiers.py); the scheduler
        # demotes idle ones through it when the pool runs short.
        seg_cfg = getattr(getattr(engine, "config", None), "segments", None)
        self.tiers = SegmentTiers(self, DEFAULT_HOST_BYTES if seg_cfg is None else seg_cfg.host_bytes)
        engine.scheduler.segments = self.tiers
        self.segments_prefilled = 0  # registrations that ran the engine's prefill (not found in any tier)
        hc = reuse_head_classes
        if hc is None:
            path = getattr(engine.model, "path", None)
            hc = load_or_default(path, cfg.num_layers, cfg.num_kv_heads) if path else engine.head_classes
        perm = getattr(engine.model, "kv_head_perm", None)
        if perm is not None and hc is not engine.head_classes:  # a tensor-parallel model's placed heads
            from jaxkv.parallel.placement import permute_head_classes
            hc = permute_head_classes(hc, perm)
        kinds = hc.kinds()
        sink = np.array([[c.sink for c in row] for row in hc.classes], np.int32)
        window = np.array([[c.window for c in row] for row in hc.classes], np.int32)
        self.heads = {"is_global": kinds != "local", "sink": np.where(kinds == "local", sink, 0),
                      "window": np.where(kinds == "local", window, 0)}
        # The map's (sinks, windows) per layer as static tuples: a layer where no local head was promoted
        # attends with the fresh-prefill kernel's own sink + window support (jaxkv/policies/reuse/apply.py).
        self.head_windows = tuple((tuple(int(x) for x in self.heads["sink"][i]),
                                   tuple(int(x) for x in self.heads["window"][i])) for i in range(len(kinds)))
        self.impl = "reference" if engine.runner.attn_impl == "reference" else None
        self.waiting: deque[_Pending] = deque()
        # (selection layer, per-head) -> the selection program the precompiled selecting methods share
        # (`reuse_steps.share_selections`)
        self.score_unions: dict = {}
        self.stats: dict[str, ReuseStats] = {}
        self.keep_logits = keep_logits
        # Per-segment FFN outputs for methods that declare `uses_segment_ffn`, with their own budget
        # (default: a quarter of the pool's bytes; jaxkv/policies/reuse/ffn_cache.py).
        pool = engine.runner.pool
        pool_bytes = sum(int(a.size) * a.dtype.itemsize for a in (pool.k, pool.v))
        budget = pool_bytes // 4 if ffn_cache_bytes is None else int(ffn_cache_bytes)
        self.ffn_cache = SegmentFFNCache(self.store, cfg, self.anchor, budget,
                                         params=lambda: engine.runner.params,
                                         bucket=lambda n: row_bucket(n, floor=128))
        # layer-group programs of a pass whose segments are promoted for it (1: always one program)
        self.layer_groups = LAYER_GROUPS
        # groups whose transfers go out before the first program (None or 0: every group's); each later
        # group's goes out just before the program `promote_ahead` groups ahead of it
        self.promote_ahead: int | None = PROMOTE_AHEAD
        # Passes compiled ahead of time on the warm-up pool (`precompile`), looked up by every pass.
        self.compiled = Programs("reuser", owned=("cfg", "impl", "head_windows", "mesh"))

    # ---- segments -----------------------------------------------------------------------------
    def register(self, tokens, extra_key: str | None = None, frozen: bool = False,
                 context=None, tier: str | None = None) -> SegmentEntry:
        """The entry for `tokens` in namespace `extra_key`, prefilled by the engine if new (after the anchor
        and `context`, if given: the segment's K/V then carry that text, whose own K/V are dropped).
        `tier` ("device" or "host", frozen segments only): where it stays (jaxkv/engine/segment_tiers.py)."""
        tokens = [int(t) for t in tokens]
        context = [int(t) for t in (context or ())]
        self._check_tokens(tokens, "segment")
        if context:
            self._check_tokens(context, "segment context")
        if self.start + len(context) + len(tokens) >= self.engine.max_model_len:
            what = f"segment has {len(tokens)} tokens"
            what += f" after {len(context)} of context" if context else ""
            raise SegmentError(f"{what}; the context holds {self.engine.max_model_len}")
        pin = self.tiers.check_pin(frozen, tier)
        e = self.store.find(tokens, extra_key, context)
        if e is None and self.persist is not None:  # committed by another server on the same store
            e = self.persist.find(self.store.id_for(tokens, extra_key, context))
        if e is not None:
            if frozen and (not e.frozen or self.tiers.pins.get(e.segment_id) != pin):
                self.tiers.admit(len(tokens), pin, existing=e)
                self.store.freeze(e)
                self.tiers.pin(e, pin)
                if self.persist is not None:
                    self.persist.save(e)
            return e
        self.tiers.admit(len(tokens), pin)
        L, H, ps = self.cfg.num_layers, self.cfg.num_kv_heads, self.page_size
        n = len(tokens)
        npg = -(-n // ps)
        lead = len(self.anchor) + len(context)
        ids = self._allocate(L * H * npg, _heads(L, H, npg)).reshape(L, H, npg)
        scratch = (self._allocate(L * H * -(-lead // ps), _heads(L, H, -(-lead // ps))).reshape(L, H, -1)
                   if lead else None)
        try:
            self._prefill_segment(tokens, ids, scratch, context)
        except Exception:
            self.engine.allocator.decref(ids)
            raise
        finally:
            if scratch is not None:
                self.engine.allocator.decref(scratch)
        self.segments_prefilled += 1
        e = self.store.insert(tokens, extra_key, ids, frozen=frozen, start=self.start + len(context),
                              context=context)
        if self.persist is not None:
            self.persist.save(e)
        self.tiers.pin(e, pin)
        return e

    def _prefill_segment(self, tokens, pages, scratch=None, context=()) -> None:
        """The engine's own prefill of `self.anchor + context + tokens`: the anchor and the context into
        `scratch` pages (freed after), the segment into `pages` [L, H, n] (chunks of max_step_tokens). The
        anchor sits at 0..; the context and then the segment from `self.start`. Storage slot j of the table
        is the scratch pages, then the segment's; the last scratch page is blanked past the lead, so the
        positions run on without a gap while each segment page starts with its token."""
        eng, ps = self.engine, self.page_size
        L, H = self.cfg.num_layers, self.cfg.num_kv_heads
        c = len(context)
        a, n = len(self.anchor) + c, len(tokens)
        sp = 0 if scratch is None else scratch.shape[2]
        allp = pages if not sp else np.concatenate([scratch, pages], axis=2)
        step = eng.scheduler.max_step_tokens
        # the engine's page-width classes (what precompile compiled), not the page count itself: segments of
        # every length share a few step variants instead of compiling one per length in pages; a power of
        # two past the widest class (anchor + context + segment beyond the context's pages)
        n_pages = allp.shape[2]
        P = (bucket_for(n_pages, eng._page_buckets) if n_pages <= eng._page_buckets[-1]
             else 1 << (n_pages - 1).bit_length())
        row = np.full((L, H, P), -1, np.int32)
        row[:, :, :allp.shape[2]] = allp
        seq = list(self.anchor) + list(context) + list(tokens)
        positions = np.concatenate([np.arange(a - c), self.start + np.arange(c + n)]).astype(np.int32)
        # storage index of every token of `seq`: the anchor from slot 0, the segment from its first page
        store_at = np.concatenate([np.arange(a), sp * ps + np.arange(n)]).astype(np.int64)
        if sp and a % ps:  # the anchor's page past the anchor: position -1 before anything attends
            eng.runner.pool = _blank(eng.runner.pool, np.asarray(scratch[:, :, -1].ravel(), np.int32), a % ps)
        for s in range(0, a + n, step):
            idx = store_at[s:s + step]
            slots = allp[:, :, idx // ps].transpose(2, 0, 1) * ps + (idx % ps)[:, None, None]
            eng.runner.run(one_row_step(eng, row, int(idx[-1]) + 1, seq[s:s + step], positions[s:s + step],
                                        slots))
        if n % ps:  # blank the stale positions past the segment's end in its last page
            last = pages[:, :, -1].ravel()
            eng.runner.pool = _blank(eng.runner.pool, np.asarray(last, np.int32), n % ps)

    def _allocate(self, n: int, heads=None) -> np.ndarray:
        """`n` pages (`heads`: the KV head of each, which a tensor-parallel pool needs to place them)."""
        alloc = self.engine.allocator
        while not alloc.can_allocate(n):
            short = n - alloc.num_free
            if self.tiers.evict(short) > 0:
                continue
            if self.engine.prefix is not None and self.engine.prefix.evict(short) > 0:
                continue
            raise OutOfPages(f"segment reuse needs {n} pages, {alloc.num_free} are free")
        if heads is None and self.engine.runner.mesh is not None:
            raise ValueError("placing segment pages on a tensor-parallel pool needs the KV head of each page")
        return alloc.allocate(n) if heads is None else alloc.allocate(n, heads=heads)

    def _check_tokens(self, tokens, what: str) -> None:
        vocab = self.cfg.vocab_size
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
            raise ValueError(f"{what} token ids must lie in [0, {vocab})")

    def _blank_batch(self, T: int, npg: int) -> dict:
        """A reuse pass's inputs for a prompt bucket of T tokens and `npg` pages per head, all padding (every
        position, slot and page -1: a pass over it writes nothing), its page copies aside (`_group_copies`:
        the whole table's worth for one program, each group's share for a grouped pass). Every size but T
        follows T where it can, so layouts of one bucket share a compiled pass (docs/policies.md, "Buckets"):
        pages per head are the bucket of max(npg, T / page size) (T holds the layout's slots, so T's own),
        the probes T (read `PROBE_CHUNK` at a time, up to the last)."""
        L, H = self.cfg.num_layers, self.cfg.num_kv_heads
        Pb = self._table_pages(T, npg)
        Np = -(-T // PROBE_CHUNK) * PROBE_CHUNK  # probes are prompt tokens: never more than T
        i32 = lambda shape, v=-1: np.full(shape, v, np.int32)  # noqa: E731
        return {"tokens": i32(T, 0), "positions": i32(T), "is_new": np.zeros(T, bool),
                "forced": np.zeros(T, bool), "seg_offset": i32(T), "storage": i32(T),
                "page_table": i32((1, L, H, Pb)), "lengths": i32((1, L, H), 0), "last": i32((), 0),
                "num_selected": i32((), 0), "probe": i32(Np), "temperature": np.zeros(1, np.float32),
                "top_k": i32(1, 0), "top_p": np.ones(1, np.float32), "seeds": np.zeros(1, np.uint32),
                "counters": i32(1, 0)}

    def _table_pages(self, T: int, npg: int) -> int:
        """Page-table width of a pass of token bucket T over a layout of `npg` pages per head."""
        Pb = row_bucket(max(npg, -(-T // self.page_size)), floor=4, geometric_from=32)
        return min(Pb, max(npg, self.engine.max_pages_per_head))

    # ---- precompile ---------------------------------------------------------------------------
    def precompile(self, reuse, progress: bool = True, background: bool = True, step_cache=None) -> int:
        """Compiles the pass of `reuse` (a method, its name, or a list of them) for every shape a request
        can hit up to the engine's context (`pass_shapes`) and, where its segments may come up from a
        lower tier (`promotes`), the layer-group programs that pass then runs in (`calls`), so no request
        of it waits on a compile; returns how many programs. They are ordinary ahead-of-time programs
        (`warmup.precompile_reuse`): lowered one after another, compiled on the warm-up pool, installed in
        `compiled`, and kept in the step cache, from which a later start loads them (`background`: on a
        background thread, a program needed before loading itself; `step_cache`: its directory, False: off,
        None: the default). Under tensor parallelism each pass runs once instead, in turn, on its
        all-padding batch (every position, slot, page and copy entry -1: nothing in the pool is written)."""
        from jaxkv.engine import warmup

        methods = [reuse] if isinstance(reuse, str | ReusePolicy) else list(reuse)
        # every name checked before anything compiles; a method named twice compiles once
        policies = list(dict.fromkeys(resolve_reuse(m) for m in methods))
        if self.engine.tables.local.any():
            raise ValueError("segment reuse needs an engine whose heads all keep full history "
                             "(head_classes='all_global', server: --head-classes global)")
        if self.engine.runner.mesh is None:
            try:
                return warmup.precompile_reuse(self.engine, policies, progress, step_cache=step_cache,
                                               background=background)
            except MemoryError as e:  # the largest pass cannot fit beside the weights and the pool
                raise ValueError(str(e)) from None
        return self._run_each(policies, progress)

    def promotes(self, policy: ReusePolicy) -> bool:
        """Whether a request of `policy` may have to bring segment heads up from a lower tier, so that its
        pass runs in layer groups (`_groups`): the method reads some segment heads
        (`ReusePolicy.segment_heads`), and host memory has a budget or a segment store is attached."""
        return (bool(policy.segment_heads(self.heads["is_global"]).any())
                and (self.tiers.host_bytes > 0 or self.persist is not None))

    def calls(self, policy: ReusePolicy) -> list[tuple]:
        """(variant, call) of every program of `policy`: its pass for each shape (`pass_shapes`), then the
        layer-group programs of each shape (`_group_calls`); a call returns (signature, function, arguments,
        static arguments) on an all-padding batch of that shape, nothing traced, as a request's pass looks
        it up (`_prefill`, `_grouped`). The variant is ("reuse <method>", rows, tokens, pages per head), a
        group program's with its layers (l0, l1) after."""
        def call(T, R, select_cap):
            fn, args, static = self._pass_call(policy, T, R, select_cap)
            return self.compiled.signature(fn, args, static), fn, args, static

        if self.as_steps(policy) and policy.selects:  # its selection, then steps from its selection layer
            return selection_calls(self, policy)
        if self.as_steps(policy):  # the step programs run it: only its page copies compile
            def pages(P):
                fn, args, static = prepare_call(self, P)
                return self.compiled.signature(fn, args, static), fn, args, static

            return [(("reuse pages", 0, 0, P), functools.partial(pages, P))
                    for P in self.engine._page_buckets] + row_table_calls(self)

        shapes = pass_shapes(policy, self.engine.max_pages_per_head * self.page_size)
        out = [((f"reuse {policy.name}", R, T, self._table_pages(T, 1)), functools.partial(call, T, R, cap))
               for T, R, cap in shapes]
        return out + self._group_calls(policy, shapes)

    def _group_calls(self, policy: ReusePolicy, shapes) -> list[tuple]:
        """(variant, call) of the layer-group programs of `policy`'s pass at each of `shapes`, one per
        distinct program (the first group, the last, and the middle ones: one per size where their layer
        offset is data, else each); none where no pass runs in groups (nothing the method reads can come
        from a lower tier, one group, tensor parallelism). A token bucket's inputs go to the device once,
        as `_grouped` sends them, and serve each of its row buckets; the carry between groups is abstract,
        its shapes those of the first group's output (`jax.eval_shape`, once) with each shape's rows."""
        groups = self._groups(policy)
        if len(groups) < 2 or not self.promotes(policy):
            return []
        L, runner = self.cfg.num_layers, self.engine.runner
        # a request's batch holds an FFN cache for such a method (`_prefill`), which no group slices by data
        by_offset = offset_group_ok(policy.device_form(), runner.params,
                                    {"ffn_cache": None} if policy.uses_segment_ffn else {})
        distinct = {}  # program -> the first group that runs it
        for g, (l0, l1) in enumerate(groups):
            distinct.setdefault(("middle", l1 - l0) if shares_program((l0, l1), L, by_offset) else g, g)
        inputs, first_out = {}, []

        def call(T, R, select_cap, g):
            if T not in inputs:
                b = self._pass_batch(policy, T)
                inputs[T] = self._group_inputs(b, _group_copies([], b["page_table"][0], groups), groups)
            common, per_group, heads, offsets = inputs[T]
            static = self._pass_static(policy, R, select_cap)
            carry = None
            if g > 0:
                if not first_out:  # the carry's structure and dtypes: the first group's output, once
                    fn, args, st = group_call(runner.params, runner.pool, {**common, **per_group[0]}, heads,
                                              None, offsets[0], groups[0], L, by_offset, static)
                    first_out.append(jax.eval_shape(functools.partial(fn, **st), *args)[1])
                carry = _carry_rows(first_out[0], R)
            fn, args, static = group_call(runner.params, runner.pool, {**common, **per_group[g]}, heads,
                                          carry, offsets[g], groups[g], L, by_offset, static)
            return self.compiled.signature(fn, args, static), fn, args, static

        return [((f"reuse {policy.name}", R, T, self._table_pages(T, 1), groups[g]),
                 functools.partial(call, T, R, cap, g)) for T, R, cap in shapes for g in distinct.values()]

    def _pass_call(self, policy: ReusePolicy, T: int, R: int, select_cap: int):
        """(function, arguments, static arguments) of the pass of shape (T, R, select_cap) on an all-padding
        batch whose pages per head follow T alone, as a request of this bucket has."""
        eng = self.engine
        return (reuse_prefill, (eng.runner.params, eng.runner.pool, self._pass_batch(policy, T), self.heads),
                self._pass_static(policy, R, select_cap))

    def _pass_batch(self, policy: ReusePolicy, T: int) -> dict:
        """The all-padding batch of token bucket T, with the FFN cache a method that reads one gets."""
        b = self._blank_batch(T, 1)
        b.update(_group_copies([], b["page_table"][0], [(0, self.cfg.num_layers)])[0])
        if policy.uses_segment_ffn:
            b["ffn_cache"] = self.ffn_cache.for_prompt([], T)
        return b

    def _pass_static(self, policy: ReusePolicy, R: int, select_cap: int) -> dict:
        """The static arguments of a pass of R rows, as `_prefill` gives them."""
        return dict(cfg=self.cfg, policy=policy.device_form(), num_rows=R, select_cap=select_cap,
                    impl=self.impl, rows_are_tokens=forces_every_token(policy),
                    head_windows=self.head_windows, mesh=self.engine.runner.mesh)

    def _group_inputs(self, b: dict, per_group: list[dict], groups) -> tuple:
        """A grouped pass's inputs on the device: (the batch but its page lists, each group's page lists
        (`_group_copies`), the reuse heads, each group's first layer as int32 [])."""
        common = {k: v for k, v in b.items() if k not in ("src", "dst", "delta", "clear")}
        offsets = [np.int32(l0) for l0, _ in groups]
        return jax.device_put((common, per_group, self.heads, offsets))

    def _run_each(self, policies, progress: bool) -> int:
        """Runs every pass of `policies` once, in turn, on its all-padding batch (traced, compiled by jit);
        returns how many."""
        from tqdm.auto import tqdm

        eng, total = self.engine, 0
        todo = [call for pol in policies for _, call in self.calls(pol)]
        for call in tqdm(todo, desc="jaxkv: compiling reuse passes", disable=not progress):
            _, fn, args, static = call()
            pool, tok, *_ = self.compiled.call(fn, args, static)
            eng.runner.pool = pool
            jax.block_until_ready(tok)
            total += 1
        return total

    # ---- requests -----------------------------------------------------------------------------
    def check(self, segments, extra_key, reuse) -> ReusePolicy:
        """Validates a reuse request's segments and method before anything is queued (SegmentError /
        ValueError naming the problem); returns the resolved policy."""
        policy = resolve_reuse(reuse)
        if self.engine.tables.local.any():
            raise ValueError("segment reuse needs an engine whose heads all keep full history "
                             "(head_classes='all_global'); the reuse method reads its own head-class map")
        for s in segments:
            n = self.store.get(s, extra_key).length if isinstance(s, str) else len(s) + self.start
            if not isinstance(s, str):
                self._check_tokens([int(t) for t in s], "segment")
            if n >= self.engine.max_model_len:
                name = repr(s) if isinstance(s, str) else "a segment"
                raise SegmentError(f"{name} has {n} tokens; the context holds {self.engine.max_model_len}")
        return policy

    def add(self, req: Request, prefix, segments, suffix, policy: ReusePolicy) -> None:
        self.waiting.append(_Pending(req, list(prefix), list(segments), list(suffix), policy))
        if policy.reuses and self.persist is not None:  # segments only in the store: read them while queued
            known = []
            for s in segments:
                try:
                    known += [self.store.get(s, req.extra_key)] if isinstance(s, str) else []
                except SegmentError:
                    pass  # reported when the request is admitted
            self.tiers.prefetch(known, policy.segment_heads(self.heads["is_global"]))

    def remove(self, req: Request) -> bool:
        for p in list(self.waiting):
            if p.req is req:
                self.waiting.remove(p)
                return True
        return False

    def step(self) -> list:
        """Admits queued reuse requests (prefill + first token); returns their RequestOutputs."""
        outs = []
        while self.waiting:
            p = self.waiting[0]
            try:
                out = self._admit(p)
            except OutOfPages:
                break  # head of line waits for pages
            except SegmentError as err:  # e.g. a segment deleted while the request waited
                p.req.status, p.req.finish_reason = Status.FINISHED, "abort"
                p.req.text = f"error: {err}"
                self.engine._requests.pop(p.req.request_id, None)
                out = self.engine._output(p.req, [], [])
            self.waiting.popleft()
            if out is not None:
                outs.append(out)
        return outs

    def _admit(self, p: _Pending):
        _eng, req, pol = self.engine, p.req, p.policy
        _L, _H, _ps = self.cfg.num_layers, self.cfg.num_kv_heads, self.page_size
        entries: list[SegmentEntry | None] = []
        seg_tokens = []
        for s in p.segments:
            if isinstance(s, str):
                e = self.store.get(s, req.extra_key)  # may have been deleted while queued
                seg_tokens.append(list(e.tokens))
            else:
                seg_tokens.append([int(t) for t in s])
                e = self.register(s, req.extra_key) if pol.reuses and len(s) else None
            entries.append(e if pol.reuses else None)
        for e in entries:
            if e is not None:
                self.store.acquire(e)
        self._admitted_at, self.tiers.first_write_at = time.perf_counter(), None
        try:
            # The heads the method reads come to the device (from host memory or the store) first: all at
            # once before a single-program pass, or layer group by layer group beside a grouped one.
            groups = self._groups(pol)
            promotion = self.tiers.promote(entries, pol.segment_heads(self.heads["is_global"]),
                                           defer=len(groups) > 1)
            try:
                if promotion is not None:  # page ids and rows now, then the first group's K/V (below)
                    promotion.start(groups, send=self._send_at_admission(promotion, groups))
                return self._prefill(p, entries, seg_tokens, promotion, groups)
            finally:
                if promotion is not None:
                    promotion.finish()
        finally:
            for e in entries:
                if e is not None:
                    self.store.release(e)

    @staticmethod
    def _send_at_admission(promotion, groups) -> int:
        """Groups whose K/V leave at admission: the first one of a grouped pass from pinned host memory, so
        its copy runs while the host lays the prompt out (the pass's pageable inputs, sent later, then wait
        at most for what is left of it); none when a segment is still read from the store (sending would
        wait for the read) or for a single program (its inputs go first, `_grouped`)."""
        return int(len(groups) > 1 and not promotion.reads_pending())

    def as_steps(self, pol: ReusePolicy) -> bool:
        """Whether `pol`'s requests run as the engine's ragged steps (`runs_as_steps`); not where the pass's
        first logits are kept (`keep_logits`), which only the pass has."""
        return runs_as_steps(self.engine, pol) and not self.keep_logits

    def _groups(self, pol: ReusePolicy) -> list[tuple[int, int]]:
        """Layer ranges of the pass's programs when its segments must be promoted: `layer_groups` of them
        on one device; one under tensor parallelism (the sharded pass is one shard_map program)."""
        L = self.cfg.num_layers
        if (self.engine.runner.mesh is not None or self.layer_groups <= 1 or not pol.reuses
                or self.as_steps(pol)):  # steps: every group's pages come up first
            return [(0, L)]
        return layer_groups(pol, L, self.layer_groups)

    def _prefill(self, p: _Pending, entries, seg_tokens, promotion=None, groups=None):
        eng, req, pol = self.engine, p.req, p.policy
        cfg = self.cfg
        L, H, ps = cfg.num_layers, cfg.num_kv_heads, self.page_size
        # Layout: token -> storage slot (same for every head); reused segments start on a page boundary.
        # Per piece, not per token: a 33K-token prompt is a few numpy ranges, not 33K list appends.
        tokens, storage, is_new, seg_index, seg_offset, bounds, copies = [], [], [], [], [], [], []
        slot, start = 0, 0
        pieces = [(p.prefix, None)] + list(zip(seg_tokens, entries)) + [(p.suffix, None)]
        for toks, e in pieces:
            m = len(toks)
            if e is not None:
                slot = -(-slot // ps) * ps
                bounds.append((start, start + m))
                copies.append((e, slot // ps, start - e.start))
            tokens.append(np.asarray(toks, np.int32).reshape(m))
            storage.append(np.arange(slot, slot + m, dtype=np.int64))
            is_new.append(np.full(m, e is None))
            seg_index.append(np.full(m, len(bounds) - 1 if e is not None else -1, np.int32))
            seg_offset.append(np.arange(m, dtype=np.int32) if e is not None else np.full(m, -1, np.int32))
            slot, start = slot + m, start + m
        tokens, storage = np.concatenate(tokens), np.concatenate(storage)
        n = start
        npg = -(-slot // ps)
        # Positions were checked against max_model_len (`Engine.add_request`); slots against pages per head
        # here: generation ends at max_tokens or at the context's last position, whichever comes first.
        room = generation_room(npg, ps, eng.max_pages_per_head)
        if min(req.sampling.max_tokens, eng.max_model_len - n) > room:
            raise SegmentError(
                f"max_tokens={req.sampling.max_tokens} does not fit: the prompt laid out with page-aligned "
                f"segments takes {npg} of the engine's {eng.max_pages_per_head} pages per head "
                f"({eng.context_pages} for the {eng.max_model_len}-token context + {eng.slack_pages} of "
                f"slack, segment_max_segments={eng.config.segments.max_segments}), which leaves room for "
                f"{max(room, 0)} generated tokens (with segment_max_segments >= {len(bounds)}, its "
                f"{len(bounds)} reused segments fit whenever its tokens do)")
        lay = Layout(n, np.concatenate(is_new), np.concatenate(seg_index), np.concatenate(seg_offset),
                     tuple(bounds), ps)
        forced = pol.forced(lay)
        forced[n - 1] = True
        k_sel = pol.num_selected(lay) if pol.selects else 0
        k_sel = min(k_sel, int((~forced).sum()))
        width = H if pol.selects_per_head else 1
        rows_are_tokens = forces_every_token(pol) and bool(forced.all())
        # The token bucket holds the laid-out slots (tokens + page-alignment holes), so the page table's
        # width is the one the bucket alone gives (`_blank_batch`): many segments never widen it past
        # what precompile compiled.
        T, R, select_cap = pass_shape(slot, int(forced.sum()) + width * k_sel, pol.selects, rows_are_tokens,
                                      eng.max_pages_per_head * ps)

        table = self._allocate(L * H * npg, _heads(L, H, npg)).reshape(L, H, npg)
        steps = promotion is None and self.as_steps(pol)
        if steps and not pol.selects:
            return self._prefill_steps(req, pol, lay, tokens, storage, forced, table, slot, copies)
        first_reused = bounds[0][0] if bounds else n
        probe = np.nonzero(lay.is_new & (np.arange(n) > first_reused))[0]
        if probe.size == 0:
            probe = np.nonzero(lay.is_new)[0]
        grouped = promotion is not None and len(groups) > 1
        b = self._blank_batch(T, npg)
        b["lengths"][:] = slot
        b["last"][...], b["num_selected"][...] = n - 1, k_sel
        b["tokens"][:n], b["positions"][:n], b["is_new"][:n] = tokens, np.arange(n), lay.is_new
        b["forced"][:n], b["seg_offset"][:n], b["storage"][:n] = forced, lay.seg_offset, storage
        b["page_table"][0, :, :, :npg] = table
        b["probe"][:probe.size] = probe
        per_group = _group_copies(copies, b["page_table"][0], groups if grouped else [(0, L)])
        if not grouped:
            b.update(per_group[0])
        if pol.uses_segment_ffn:
            b["ffn_cache"] = self.ffn_cache.for_prompt(pieces, T)
        sp = req.sampling
        b["temperature"][0], b["top_k"][0], b["top_p"][0], b["seeds"][0] = (sp.temperature, sp.top_k,
                                                                            sp.top_p, req.seed)

        static = dict(cfg=cfg, policy=pol.device_form(), num_rows=R, select_cap=select_cap, impl=self.impl,
                      rows_are_tokens=rows_are_tokens, head_windows=self.head_windows, mesh=eng.runner.mesh)
        t0 = self._pass_at = time.perf_counter()  # `_grouped` sets it at its first program
        if steps:  # the pass up to its selection, then the rows it picked as steps
            tok, logprob, top, st = run_selected(self, req, pol, b, T, tokens, storage, table, slot)
            return self._finish(req, pol, lay, table, slot, tok, logprob, None if top is None else [top], st,
                                t0, None, programs=1)
        if promotion is None:
            pool, tok, logprob, logits, st = self.compiled.call(
                reuse_prefill, (eng.runner.params, eng.runner.pool, b, self.heads), static)
            eng.runner.pool = pool
            programs = 1
        else:
            tok, logprob, logits, st = self._grouped(b, per_group, groups, promotion, static)
            programs = len(groups)
        # One sync for the token, its logprob and the stats (a fetch each cost ~0.5-0.9 ms on an H200).
        alts = req.sampling.logprobs  # the first token's alternatives come from its logits, on the host
        tok, logprob, st, logits = jax.device_get((tok, logprob, st,
                                                   logits if self.keep_logits or alts else None))
        tok, logprob = int(tok[0]), float(logprob[0])
        top = None
        if alts:
            ids, lps = top_logprobs_host(logits, alts)
            top = [[(int(i), float(x)) for i, x in zip(ids, lps)]]
            logits = logits if self.keep_logits else None
        return self._finish(req, pol, lay, table, slot, tok, logprob, top, st, t0, logits, programs)

    def _prefill_steps(self, req, pol: ReusePolicy, lay: Layout, tokens, storage, forced, table, slot: int,
                       copies):
        """`_prefill` through the engine's step program (`jaxkv.engine.reuse_steps`): the page copies as
        one `prepare_pages` program of the table's width class, then the forced tokens as ragged steps."""
        eng, (L, H, npg) = self.engine, table.shape
        t0 = self._pass_at = time.perf_counter()
        P = page_width(eng, npg)
        wide = np.full((L, H, P), -1, np.int32)
        wide[:, :, :npg] = table
        eng.runner.pool = self.compiled.call(*prepare_call(self, P, _group_copies(copies, wide, [(0, L)])[0]))
        idx = np.nonzero(forced)[0]
        tok, logprob, top = run_rows(eng, wide, slot, tokens, storage, idx, req)
        st = row_stats(len(tokens), idx, idx.size * H, L, H)
        return self._finish(req, pol, lay, table, slot, tok, logprob, None if top is None else [top], st, t0,
                            None, programs=1)

    def _finish(self, req, pol: ReusePolicy, lay: Layout, table, slot: int, tok: int, logprob: float, top,
                st: dict, t0: float, logits, programs: int):
        """Records the prefill's statistics, hands the request its pages and first token, and queues it
        for decoding (or finishes it)."""
        eng, n, H = self.engine, lay.num_tokens, self.cfg.num_kv_heads
        elapsed = time.perf_counter() - t0
        first = min(t for t in (self.tiers.first_write_at, self._pass_at) if t is not None)
        ints = lambda name: [int(round(float(x))) for x in st[name]]  # noqa: E731
        self.stats[req.request_id] = ReuseStats(
            pol.name, n, lay.num_reused, ints("query_rows"), ints("kv_writes"), ints("ffn_rows"),
            ints("promoted_heads"), ints("keys_seen"), elapsed,
            logits, heads=H, layer_groups=programs, ffn_dropped=ints("ffn_dropped"),
            host_before_program_s=first - self._admitted_at)

        eng.tables.adopt_pages(req.request_id, table, slot, n - 1)
        req.num_computed = n
        req.output_ids.append(tok)
        req.output_logprobs.append(logprob)
        eng._check_stop(req)
        out = eng._output(req, [tok], [logprob], top)
        if req.finished:
            eng.tables.release(req.request_id)
            eng._requests.pop(req.request_id, None)
        else:
            eng.scheduler.add_running(req)
        return out

    def _grouped(self, b: dict, per_group: list[dict], groups, promotion, static: dict):
        """The reuse pass as one program per layer group, each dispatched right after its layers' promoted
        pages are written, so it depends on no later group's transfer: a program waits for all its inputs,
        and XLA runs a transfer beside a program only when the transfer was dispatched first (docs/
        segments.md, "Layer groups"). The first group's K/V left at admission (`_send_at_admission`); the
        pass's inputs go next (pageable numpy: a synchronous transfer, which waits for what is left of that
        copy, little by now: the host has laid out the prompt meanwhile), then each later group's K/V one
        program ahead. Returns what `reuse_prefill` does, the pool aside (set on the runner)."""
        eng, params, L = self.engine, self.engine.runner.params, self.cfg.num_layers
        common, per_group, heads, offsets = self._group_inputs(b, per_group, groups)
        # middle groups of one size share a compiled program: their layer offset is data
        by_offset = offset_group_ok(static["policy"], params, b)
        ahead = self.promote_ahead or None  # None / 0: every group's transfer first
        promotion.send(ahead)
        carry = None
        for g, (l0, l1) in enumerate(groups):
            promotion.write(g)
            if ahead is not None:  # the next group's transfer, dispatched before this group's program
                promotion.send(g + 1 + ahead)
            if g == 0:
                self._pass_at = time.perf_counter()
            # the program precompile installed for this group (`calls`), else jit's
            out = self.compiled.call(*group_call(params, eng.runner.pool, {**common, **per_group[g]}, heads,
                                                 carry, offsets[g], (l0, l1), L, by_offset, static))
            if l1 < L:
                eng.runner.pool, carry = out
        eng.runner.pool = out[0]
        return out[1:]


def shares_program(group: tuple[int, int], num_layers: int, by_offset: bool) -> bool:
    """Whether layer group `group` = (l0, l1) runs as a middle group whose layer offset is data
    (`by_offset`: `offset_group_ok`), so that every such group of its size shares one program."""
    return by_offset and 0 < group[0] and group[1] < num_layers


def group_call(params, pool, b: dict, heads, carry, offset, group: tuple[int, int], num_layers: int,
               by_offset: bool, static: dict):
    """(function, arguments, static arguments) of layer group `group` = (l0, l1) of a reuse pass over batch
    `b` (`carry`: what the group before returned, None for the first; `offset`: l0 as int32 [] data): a
    group that `shares_program` runs its own layers as a whole model's, any other the model's layers
    [l0, l1). `_grouped` runs it, `Reuser.calls` precompiles it."""
    l0, l1 = group
    if shares_program(group, num_layers, by_offset):
        part = {**params, "layers": llama.SharedLayers(params["layers"][l0:l1])}
        return reuse_prefill, (part, pool, b, heads, carry, offset), {**static, "layers": (0, l1 - l0)}
    return reuse_prefill, (params, pool, b, heads, carry), {**static, "layers": (l0, l1)}


def _carry_rows(carry, R: int) -> tuple:
    """The abstract carry between layer groups (rows' hidden states [R, hidden], row indices [R], their
    selection [R, H'], per-layer stats) of a pass of R rows, from one of another row count."""
    rows = lambda x: jax.ShapeDtypeStruct((R, *x.shape[1:]), x.dtype, weak_type=x.weak_type)  # noqa: E731
    xr, idx, sel, stats = carry
    return rows(xr), rows(idx), rows(sel), stats


def _group_copies(copies, table: np.ndarray, groups) -> list[dict]:
    """Per layer group, the pass's page copies (src / dst / delta) of that group's layers and the pages to
    blank (clear), each padded to the group's share of the table ((l1 - l0) * H * P entries of the [L, H, P]
    `table`), so groups of one size share their shapes. `copies`: (entry, first page, position shift) per
    reused segment, segment by segment, each in [layer, head, page] order (heads the method does not read
    may be off the device: source -1, no copy)."""
    _, H, P = table.shape
    out = []
    for l0, l1 in groups:
        size = (l1 - l0) * H * P
        part = {"src": np.full(size, -1, np.int32), "dst": np.full(size, -1, np.int32),
                "delta": np.zeros(size, np.int32), "clear": np.full(size, -1, np.int32)}
        at = 0
        for e, page0, d in copies:
            m = e.pages.shape[2]
            src = e.pages[l0:l1].reshape(-1)
            part["src"][at:at + src.size] = src
            dst = table[l0:l1, :, page0:page0 + m].reshape(-1)
            part["dst"][at:at + src.size] = np.where(src >= 0, dst, -1)
            part["delta"][at:at + src.size] = d
            at += src.size
        clear = table[l0:l1].reshape(-1)
        part["clear"][:clear.size] = clear
        out.append(part)
    return out


def prompt_pages(pieces, page_size: int) -> int:
    """Pages per head of a reuse prompt laid out as `_prefill` does: `pieces` are (length, is_segment) in
    prompt order; every segment starts on a page boundary, so the padding before it takes slots too."""
    slot = 0
    for n, is_segment in pieces:
        if is_segment:
            slot = -(-slot // page_size) * page_size
        slot += n
    return -(-slot // page_size)


def generation_room(npg: int, page_size: int, max_pages_per_head: int) -> int:
    """Tokens a reuse request may generate after a prompt of `npg` pages per head: its completion starts on
    a fresh page and the whole must stay within the context's pages per head (<= 0: none)."""
    return (max_pages_per_head - npg) * page_size


def _heads(L: int, H: int, n: int) -> np.ndarray:
    """KV head of every page of an [L, H, n] page block (flattened as `reshape(L, H, n)` reads it)."""
    return np.broadcast_to(np.arange(H, dtype=np.int32)[None, :, None], (L, H, n)).ravel()


def row_bucket(n: int, floor: int, geometric_from: int = 2048, steps: int = 8) -> int:
    """Static size for `n` rows (prompt tokens, sparse-phase rows, pages per head): powers of two up to
    `geometric_from`, then `steps` (a power of two) per doubling (8: ratio <= 1.125; for rows multiples of
    256 from 2K, 512 from 4K, ..., 4096 from 32K). Padding is at most 12.5 % instead of up to 100 % (33,040
    tokens -> 36,864, not 65,536), and the compiled variants stay bounded: 8 per doubling, 48 from 2K to
    128K rows."""
    n = max(n, floor)
    if n <= geometric_from:
        return 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - steps.bit_length())
    return -(-n // step) * step


def token_rows_bucket(n: int, limit: int) -> int:
    """The one bucket of a pass whose rows are the prompt's `n` slots (RedKnot): `row_bucket` with floor
    `TOKEN_ROWS_FLOOR` and `TOKEN_ROWS_STEPS` per doubling, capped at the context's own fine bucket (of
    `limit` slots, as `token_bucket`), so a prompt that nearly fills the context pads no further than it
    (33,040 slots of a 33,072-slot context: 36,864, not 40,960)."""
    ladder = row_bucket(n, floor=TOKEN_ROWS_FLOOR, steps=TOKEN_ROWS_STEPS)
    return min(ladder, row_bucket(limit, floor=8))


def token_bucket(n: int, limit: int) -> int:
    """Token bucket of a pass whose rows are a subset of the prompt's `n` slots: a power of two (floor
    `TOKEN_FLOOR`), capped at the bucket of `limit` (the context's slots), so a prompt that nearly fills
    the context is padded no further than the context's own bucket (33,040 slots of a 33,072-slot context:
    36,864, not 65,536). Such a pass runs only its dense layers (`full_layers`: none for naive and EPIC,
    one for CacheBlend and SparseX) on every token; T sizes the other per-token arrays and the page table."""
    return min(max(TOKEN_FLOOR, 1 << (max(n, 1) - 1).bit_length()), row_bucket(limit, floor=128))


def row_ladder(T: int) -> tuple[int, ...]:
    """The sparse-phase row buckets of a token bucket T (see `ROW_STEPS`): `MIN_ROWS` (or T when smaller),
    powers of two from there to T/16, multiples of T/32 (rounded up to 8) from T/16 to T/4, then T/2 and
    T."""
    floor = min(MIN_ROWS, T)
    small = [1 << e for e in range(3, T.bit_length()) if 1 << e <= T // 16]
    steps = [-(-(k * T) // (ROW_STEPS * 8)) * 8 for k in range(ROW_STEPS // 16, ROW_STEPS // 4 + 1)]
    return tuple(sorted({max(floor, r) for r in small + steps + [T // 2, T]}))


def forces_every_token(policy: ReusePolicy) -> bool:
    """Whether the method recomputes every prompt token (RedKnot, `full`): its rows are the tokens, so one
    bucket serves both and the pass takes the fresh-prefill attention path."""
    n = 32
    probe = Layout(n, np.arange(n) == n - 1, np.where(np.arange(n) < n - 1, 0, -1).astype(np.int32),
                   np.where(np.arange(n) < n - 1, np.arange(n), -1).astype(np.int32), ((0, n - 1),), 16)
    return bool(np.asarray(policy.forced(probe)).all())


def pass_shape(n: int, rows: int, selects: bool, rows_are_tokens: bool, limit: int) -> tuple[int, int, int]:
    """(T, R, select_cap) of a reuse pass over `n` prompt slots (tokens and page-alignment holes) of which
    `rows` are recomputed in the sparse phase, on a context of `limit` slots: when the rows are the tokens,
    one bucket of both (`token_rows_bucket`); else `token_bucket` and the smallest of its row buckets
    (`row_ladder`) that holds the rows. The top-k cap is R for a method that selects (it picks at most R
    rows; the exact k is data), so it adds no compile key."""
    if rows_are_tokens:
        T = token_rows_bucket(n, limit)
        return T, T, 0
    T = token_bucket(n, limit)
    R = next(r for r in row_ladder(T) if r >= min(rows, T))
    return T, R, (R if selects else 0)


def pass_shapes(policy: ReusePolicy, limit: int) -> list[tuple[int, int, int]]:
    """Every (T, R, select_cap) a request of `policy` can hit on a context of `limit` slots (the engine's
    pages per head x page size: max_model_len rounded up to a page, plus the reuse slack): what
    `Reuser.precompile` compiles, and what counts its passes without compiling."""
    if forces_every_token(policy):
        return [(T, T, 0) for T in sorted({token_rows_bucket(n, limit) for n in range(1, limit + 1)})]
    buckets = sorted({token_bucket(n, limit) for n in range(1, limit + 1)})
    return [(T, R, R if policy.selects else 0) for T in buckets for R in row_ladder(T)]


@functools.partial(jax.jit, donate_argnums=0)
def _blank_impl(pos, pages, start):
    keep = jnp.arange(pos.shape[1])[None] < start
    return pos.at[pages].set(jnp.where(keep, pos[pages], -1))


def _blank(pool, pages: np.ndarray, start: int):
    """Sets slots ``start..page_size-1`` of `pages` to position -1 (outside any step)."""
    return dataclasses.replace(pool, pos=_blank_impl(pool.pos, pages, np.int32(start)))
