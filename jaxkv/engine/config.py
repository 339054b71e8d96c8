"""The engine's configuration: one frozen tree, so an engine is described by a value (logged, compared,
copied with `dataclasses.replace`) rather than by a long keyword list.

`EngineConfig` holds what every engine has (pool, buckets, scheduling, the engine-wide KV policy); the
options of one family of methods live in their own section (`retrieval`, `segments`), so the engine's own
fields name no method. `Engine(model, config)` takes it; `Engine(model, page_size=..., ...)` still works:
`EngineConfig.from_kwargs` maps the flat names (`retrieval_host_tier` -> `retrieval.host_tier`,
`segment_anchor` -> `segments.anchor`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

DEFAULT_KV_CACHE_BYTES = 1 << 30
# The server's retrieval state rows when requests choose SpeContext per request (not engine-wide): a row is
# a whole context of keys, made for every row up front, and most of a mixed load holds none.
PER_REQUEST_RETRIEVAL_ROWS = 32
DEFAULT_DECODE_STEPS = 16  # decode tokens per dispatch when every running request decodes (docs/engine.md)


@dataclasses.dataclass(frozen=True)
class RetrievalConfig:
    """Retrieval policies' decode (jaxkv/engine/retrieval.py).

    host_tier: a shared method's selection differences load from a host-memory mirror of the pool.
    resident: buffer slots per (sequence, KV head) as a multiple of the budget (None: 2 with the host tier).
    inplace: attention reads the selected slots in the pool, no buffer copy (None: whenever no host tier).
    host_pages: host-memory pages that older K/V moves to when the device pool runs short (host tier only).
    host_overlap: host rows of later layers are gathered beside the earlier layers (host tier only).
    host_eager: every dispatch loads from the host mirror, not only once a request has pages there.
    max_seqs: requests that hold a retrieval state row at once (SpeContext's keys and selection buffer, a row
    of the whole context each: ~67 MB a request at the 8B shape and 32K); the scheduler keeps later ones
    waiting while every row is taken, and the retrieval decodes compile for at most this many sequences.
    None: max_num_seqs (every running request may hold one).
    """

    host_tier: bool = False
    resident: float | None = None
    inplace: bool | None = None
    host_pages: int = 0
    host_overlap: bool = False
    host_eager: bool = False
    max_seqs: int | None = None

    def __post_init__(self):
        n = self.max_seqs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"Engine: retrieval_max_seqs must be a positive integer or None (got {n!r})")


@dataclasses.dataclass(frozen=True)
class SegmentConfig:
    """Segment store and reuse prefill (jaxkv/engine/reuse.py).

    anchor: what segments are prefilled after ("bos": the model's BOS token, so they see the attention sink
    their prompts will give them; "none"; or token ids). start: their first position (None: after the
    anchor). ffn_cache_bytes: device memory for RedKnot's per-segment FFN outputs (None: a quarter of the
    pool). store: a directory or tensorstore URL where registered segments persist (restored into the pool
    when the engine starts; jaxkv/engine/segment_persist.py); None: they live as long as the engine.
    host_bytes: host memory for segments moved off the device when the pool runs short
    (jaxkv/engine/segment_tiers.py). head_classes: RedKnot's global / local heads for reuse (a HeadClassMap
    or a head_classes.json path, e.g. from tools.profile_heads); None: the file beside the model, else the
    engine's own classes. max_segments: a reuse request of up to this many segments fits whenever its
    tokens fit max_model_len: each reused segment starts on a page boundary (up to page_size - 1 empty slots
    before it) and the completion on a fresh page, so the engine's pages per head get `max_segments + 1`
    pages of slack beyond the context's (`Engine.max_pages_per_head`); positions stay within max_model_len.
    0 (the default): no slack, no cost for engines that never reuse; the holes then take context.
    as_steps: a method whose pass recomputes only its forced rows over every head's whole history (naive,
    EPIC, full) runs them as the engine's precompiled ragged step programs (jaxkv/engine/reuse_steps.py)
    instead of a reuse pass of its own (faster on an H100: docs/segments.md, "Reuse as steps"); False keeps
    the pass.
    """

    anchor: Any = "bos"
    start: int | None = None
    ffn_cache_bytes: int | None = None
    store: str | None = None
    host_bytes: int = 4 << 30
    # the reuse methods' head-class map (HeadClassMap | path); None: the file beside the model
    head_classes: Any = None
    max_segments: int = 0
    as_steps: bool = True

    def __post_init__(self):
        if not isinstance(self.as_steps, bool):
            raise ValueError(f"Engine: segment_as_steps must be a bool (got {self.as_steps!r})")
        m = self.max_segments
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ValueError(f"Engine: segment_max_segments must be a non-negative integer (got {m!r})")


LAYER_LOOPS = ("unrolled", "shared", "scan")  # jaxkv/models/llama.py, "Three layouts of layers"


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Pool, buckets, scheduling and the engine-wide KV policy (docs/engine.md)."""

    num_pages: int | None = None  # KV pool pages; None: kv_cache_bytes over a page's bytes
    page_size: int = 16
    max_num_seqs: int = 8
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_step_tokens: int = 512
    head_classes: Any = None  # HeadClassMap | path | None (the model's head_classes.json, else all global)
    enable_prefix_caching: bool = True
    kv_dtype: Any = None  # None: the parameters' dtype
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    attn_impl: str | None = None  # None: the Pallas kernel on a GPU, the jnp twin elsewhere
    decode_steps: int = DEFAULT_DECODE_STEPS
    max_prefill_tokens: int | None = None
    kv_policy: Any = None  # a policy object, a registered name, or None (full cache)
    kv_budget: float | None = None
    kv_merge: bool | None = None  # per-slot logit bias in the pool; None: iff the engine-wide policy merges
    pipeline_decode: bool = True  # dispatch decode call t+1 before reading call t
    # "unrolled" (every layer traced), "shared" (one traced layer body called per layer; the same compiled
    # step, a fraction of the tracing), "scan" (stacked weights under lax.scan). None: $JAXKV_LAYER_LOOP,
    # else "shared" on the CPU and the model's own form elsewhere (docs/engine.md, "Layer loops").
    layer_loop: str | None = None
    # Precompiled programs of more than this many rows (a step's tokens, a decode's sequences, a reuse pass's
    # rows) take cuBLAS GEMMs instead of autotuned Triton ones (`warmup.LARGE_ROW_OPTIONS`; None: every
    # program as XLA_FLAGS say). Few-row GEMMs need the autotuning; large-row ones run as fast on cuBLAS and
    # compile sooner (docs/benchmarks.md, "Autotuning only where it pays").
    autotune_max_rows: int | None = None
    # True: batches without a sampled row run their own programs (an argmax, no sampling work), so every
    # step shape compiles twice; False: one program per shape serves both (a lax.cond skips the sampler for
    # a greedy batch). None: False on an accelerator, where precompile compiles every shape; True on the
    # CPU, where programs compile on first use and the sampler alone takes ~1.9 s of XLA:CPU compile
    # (docs/engine.md, "How many variants").
    greedy_programs: bool | None = None
    # Page-table width classes a step shape is compiled for (`Engine.page_classes`): the widest ones of 32,
    # 256, 2048, ... pages (each 8x the last, the widest every page of max_model_len). Fewer classes, fewer
    # programs: each class is a set of step, press and retrieval variants; a step over a wider table than it
    # needs costs the kernels empty split programs (docs/engine.md, "How many variants"). None: the widest
    # alone on an accelerator (where precompile compiles every variant), every class on the CPU (where the
    # attention's jnp twin gathers the whole table).
    page_classes: int | None = None
    # Ragged steps of at least this many tokens run their layers as one rolled loop (`llama.run_layers(
    # rolled=True)`: XLA compiles one layer body instead of inlining L, and each layer's weights are copied
    # once per step as the loop picks them), for a layer list run through one shared body (`layer_loop`
    # "shared"). The copy is one more pass over the weights, which a compute-bound step of many tokens hides
    # and a decode would not. 0: every step inlined (docs/engine.md, "Layer loops").
    rolled_from_tokens: int = 0
    retrieval: RetrievalConfig = RetrievalConfig()
    segments: SegmentConfig = SegmentConfig()

    def __post_init__(self):
        if self.layer_loop is not None and self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"Engine: layer_loop must be one of {list(LAYER_LOOPS)} "
                             f"(got {self.layer_loop!r})")
        n = self.page_classes
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"Engine: page_classes must be a positive integer or None (got {n!r})")
        n = self.rolled_from_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"Engine: rolled_from_tokens must be an integer >= 0 (got {n!r})")
        for name in ("page_size", "max_num_seqs", "max_step_tokens", "decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Engine: {name} must be a positive integer (got {value!r})")

    @classmethod
    def from_kwargs(cls, base: EngineConfig | None = None, **kwargs) -> EngineConfig:
        """`base` (default: the defaults) with flat keyword overrides; section fields by their prefixed names
        (`retrieval_host_tier`, `segment_anchor`, ...)."""
        base = base or cls()
        sections = {"retrieval": ("retrieval_", RetrievalConfig), "segments": ("segment_", SegmentConfig)}
        top, nested = {}, {name: {} for name in sections}
        fields = {f.name for f in dataclasses.fields(cls)} - set(sections)
        for key, value in kwargs.items():
            if key in fields:
                top[key] = value
                continue
            for name, (prefix, section) in sections.items():
                sub = key[len(prefix):] if key.startswith(prefix) else None
                if sub in {f.name for f in dataclasses.fields(section)}:
                    nested[name][sub] = value
                    break
            else:
                raise TypeError(f"Engine: unknown option {key!r}")
        for name, values in nested.items():
            if values:
                top[name] = dataclasses.replace(getattr(base, name), **values)
        return dataclasses.replace(base, **top)
