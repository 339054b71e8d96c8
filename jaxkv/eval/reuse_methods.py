"""Eval methods that run through the serving engine (`jaxkv.engine`): `reuse_full` and the segment-reuse
methods.

Each method owns one `Engine` (all heads full-history, prefix caching off, one sequence) for all instances,
so compilations are shared. A prompt's segments are registered on first sight by the engine's own prefill
(not counted in TTFT: it is the offline part of reuse), then `Engine.add_reuse_request` runs the method and
the request decodes greedily in the ordinary step loop. `reuse_full` is the same path with the `full` policy
(every token recomputed, no segment looked up): it must match the dense `full` oracle. Options reach the
reuse policy as fields (`--method-opts ratio=0.3,full_layers=2`), except `head_classes=PATH` (RedKnot's
global / local heads for a model without a head_classes.json beside it; `Engine(segment_head_classes=...)`),
`anchor` (`anchor=none`: segments prefilled alone, without the BOS anchor; `Engine(segment_anchor=...)`) and
`context`, how the segments were cached (docs/eval.md, "Segment caching protocols"):

- `none` (default): each segment prefilled on its own after the anchor (CacheBlend / EPIC / RedKnot's
  protocol: independently precomputed chunks);
- `shuffled`: the segments as they were in an earlier prompt holding the same prefix and the same documents
  in another order (a seeded permutation, never the identity): each is cached after the prefix and the
  documents before it there (SparseX's protocol, Appendix B: segments cached from a complete prompt);
- `prompt`: cached from this very prompt (prefix and the segments before it): naive reuse is then exact, a
  check of the protocol.
"""

from __future__ import annotations

import zlib

import numpy as np

from jaxkv.cache.head_classes import all_global
from jaxkv.eval import metrics
from jaxkv.eval.registry import Method, MethodOutput, PromptPieces, register_method
from jaxkv.sampling import SamplingParams


class EngineReuse(Method):
    """Base: `policy_name` + `opts` -> a ReusePolicy; one engine per method instance."""

    policy_name = "full"

    def __init__(self, model, **opts):
        super().__init__(model)
        from jaxkv.engine.engine import Engine
        from jaxkv.policies.reuse import get_reuse_policy

        self.head_classes = opts.pop("head_classes", None)  # RedKnot's map for a model without one beside it
        anchor = opts.pop("anchor", "bos")
        self.context = str(opts.pop("context", "none")).lower()
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS} (got {self.context!r})")
        at = opts.pop("anchor_at", None)
        self.segment_start = None if at is None else int(at)
        self.anchor = None if str(anchor).lower() in ("none", "false", "0", "") else anchor
        self.policy = get_reuse_policy(self.policy_name, **opts)
        self._engine_cls = Engine
        self.engine = None

    def _engine_for(self, num_tokens: int, num_segments: int = 0):
        """One engine for the prompts of one task and context, so they share its compiled programs (a new
        engine compiles everything again). It is built for the prompt's power-of-two bucket (at least 1,024
        tokens) with a pool of ~4 such prompts (the request, its segments, slack), which keeps every
        whole-pool op cheap on CPU, and its pages per head have slack for the page-alignment holes of
        `num_segments` segments (at least `MIN_SEGMENTS`), so a prompt whose tokens fit the model's context
        fits however many segments it has. A later prompt keeps it while it fits (`_fits`): prompts of
        one context with their answers straddle a power of two by a few tokens, and a rebuild there would
        compile every program of the eval again. Segments of earlier prompts are dropped when the pool runs
        short, not copied to host memory (`segment_host_bytes=0`): the eval never reads them from there,
        and each copy compiled gathers for its segment's size."""
        num_segments = max(num_segments, MIN_SEGMENTS)
        eng = self.engine
        if eng is None or not self._fits(eng, num_tokens, num_segments):
            cfg = self.model.config
            bucket = 1 << max(10, (num_tokens - 1).bit_length())
            self.engine = None  # release the old pool before allocating the new one
            self.engine = self._engine_cls(
                self.model, page_size=PAGE_SIZE, num_pages=_pages(cfg, bucket, num_segments, POOL_PROMPTS),
                max_num_seqs=1, max_step_tokens=512,
                max_model_len=min(cfg.max_position_embeddings, 2 * bucket + 1024),
                head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), enable_prefix_caching=False,
                segment_anchor=self.anchor, segment_start=self.segment_start,
                segment_head_classes=self.head_classes,
                segment_max_segments=num_segments, segment_host_bytes=0)
            self.engine.reuser.keep_logits = True
        return self.engine

    def _fits(self, eng, num_tokens: int, num_segments: int) -> bool:
        """Whether `eng` serves a prompt (with its answer) of `num_tokens` tokens and `num_segments` segments:
        its context holds the tokens, its slack the segments' holes, and its pool three such prompts (the
        request, its segments and room to spare; segments of earlier prompts are dropped for them)."""
        return (eng.max_model_len >= num_tokens and eng.config.segments.max_segments >= num_segments
                and eng.allocator.num_pages >= _pages(self.model.config, num_tokens, num_segments, 3))

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]) -> MethodOutput:
        cfg = self.model.config
        eng = self._engine_for(len(pieces.ids) + max_new_tokens, len(pieces.segments))
        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=tuple(stop_ids),
                            ignore_eos=True)
        segments = self._cached_segments(eng, pieces)
        rid = eng.add_reuse_request(pieces.prefix, segments, pieces.suffix, reuse=self.policy, sampling=sp)
        out: list[int] = []
        last = None
        while eng.has_unfinished():
            for o in eng.step():
                out += o.new_token_ids
                last = o
        if rid not in eng.reuser.stats:  # refused at admission: say why instead of a missing-key error
            why = getattr(last, "text", "") or getattr(last, "finish_reason", "")
            raise RuntimeError(f"the {self.policy} reuse request was not served: {why}")
        st = eng.reuser.stats.pop(rid)
        if out and out[-1] in stop_ids:
            out = out[:-1]
        n = st.prompt_tokens
        itemsize = np.dtype(eng.runner.pool.k.dtype).itemsize
        held = metrics.kv_bytes(cfg, n + len(out), itemsize)
        loaded = metrics.kv_bytes(cfg, int(np.mean(st.keys_seen)), itemsize)
        loaded += sum(metrics.kv_bytes(cfg, n + i + 1, itemsize) for i in range(len(out)))
        self.last_stats = st
        return MethodOutput(out, st.first_logits, st.prefill_s, held, loaded, flops(cfg, st))

    def _cached_segments(self, eng, pieces: PromptPieces) -> list:
        """The request's segments: token lists (`none`: registered alone on first sight) or the ids of
        segments registered with their earlier prompt's text before them (`shuffled`, `prompt`)."""
        if self.context == "none":
            return pieces.segments
        n = len(pieces.segments)
        order = list(range(n))
        if self.context == "shuffled" and n > 1:
            rng = np.random.default_rng(zlib.crc32(np.asarray(pieces.ids, np.int32).tobytes()))
            while order == list(range(n)):
                order = rng.permutation(n).tolist()
        anchor = list(eng.reuser.anchor)
        prefix = list(pieces.prefix)
        ctx = prefix[len(anchor):] if prefix[:len(anchor)] == anchor else prefix  # the anchor is BOS already
        ids: list = [None] * n
        for j in order:
            ids[j] = eng.register_segment(pieces.segments[j], context=ctx)
            ctx = ctx + list(pieces.segments[j])
        return ids


CONTEXTS = ("none", "shuffled", "prompt")
MIN_SEGMENTS = 16  # reuse slack of every eval engine: the RAG tasks' 16 documents (docs/eval.md)
PAGE_SIZE = 16
POOL_PROMPTS = 4  # prompts of its bucket an eval engine's pool holds


def _pages(cfg, num_tokens: int, num_segments: int, prompts: int) -> int:
    """Pool pages for `prompts` prompts of `num_tokens` tokens, each with a page of slack per segment."""
    return prompts * cfg.num_layers * cfg.num_kv_heads * (-(-num_tokens // PAGE_SIZE) + 16 + num_segments)


def flops(cfg, st) -> dict[str, float]:
    """Analytical prefill FLOPs of what the reuse pass computed (2 per MAC; selection overhead left out):
    q/o projections per query row, k/v projections per written (token, KV head), causal scores + values
    per (query row, visible key), SwiGLU per FFN row."""
    h, d, i, hq = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.num_heads
    attn = ffn = 0.0
    for rows, writes, keys, frows in zip(st.recomputed_rows, st.kv_writes, st.keys_seen, st.ffn_rows,
                                         strict=True):
        attn += 2 * h * d * (2 * hq * rows + 2 * writes) + 4 * hq * d * keys
        ffn += 6 * h * i * frows
    return {"attention": attn, "ffn": ffn, "total": attn + ffn,
            "recompute_fraction": st.recompute_fraction, "reused_tokens": st.reused_tokens}


def _make(name: str, policy: str, doc: str):
    cls = type(f"Eval_{name}", (EngineReuse,), {"policy_name": policy, "name": name, "__doc__": doc})
    return register_method(name)(cls)


_make("reuse_full", "full",
      "The reuse path with the `full` policy: every token prefilled (must equal `full`).")
_make("naive", "naive", "Reuse every segment's rotated K/V, recompute only the new text.")
_make("epic", "epic", "EPIC: recompute the first tokens of each segment plus the new text.")
_make("cacheblend", "cacheblend", "CacheBlend: recompute the reused tokens with the largest K/V deviation.")
_make("sparsex", "sparsex", "SparseX: Sparse-Q top-k + overflow + tail fallback, full-then-sparse split.")
_make("redknot", "redknot", "RedKnot: head-aware recovery, sparse FFN, edge-mass restore.")
