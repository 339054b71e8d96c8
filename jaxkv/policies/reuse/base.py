"""The reuse seam: what a segment-reuse method sees and decides (docs/policies.md, "Reuse").

A prompt is ``prefix | segment_1 .. segment_n | suffix``. Every segment's K/V was prefilled once at
positions ``0..n_i-1`` and is copied into the request's pages rotated to its new positions; what a method
decides is which K/V to *recompute* so the answer stays right. The device pass
(`jaxkv.policies.reuse.apply.reuse_prefill`) runs in two phases:

1. layers ``0 .. full_layers-1`` on every prompt token (dense: every token's K/V rewritten);
2. at layer ``full_layers`` the method picks the recompute rows: the host-forced tokens (`forced`, at least
   the new text) plus ``num_selected`` more chosen by `score` (top-k over the reused tokens); layers
   ``full_layers .. L-1`` then run on those rows only, the other reused tokens keep their rotated cached
   K/V. Per layer, `head_writes` says which (row, KV head) K/V are written (all by default; RedKnot repairs
   local heads only near segment starts), whether local heads attend to their window only
   (`local_windows`) and which rows get the FFN (`ffn_rows`, all by default; the chosen rows are gathered
   into a buffer of `ffn_capacity_rows`, so skipped rows cost nothing).

A method is one frozen dataclass: validated fields, host hooks over a `Layout` (numpy), pure-jnp device
hooks over a `LayerView`. No method sees the engine, the pool or the page tables.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30
# Probe queries a `LayerView.probe_sum` step takes at once: a question of up to this many tokens is one step.
PROBE_CHUNK = 64


@dataclasses.dataclass(frozen=True)
class Layout:
    """Host view of one prompt: which tokens are new and where each reused segment sits."""

    num_tokens: int
    is_new: np.ndarray  # [n] bool: prefix / suffix / segments nobody cached (no K/V to reuse)
    seg_index: np.ndarray  # [n] int32 index of the reused segment holding the token, -1 = new
    seg_offset: np.ndarray  # [n] int32 offset of the token inside its segment, -1 = new
    seg_bounds: tuple[tuple[int, int], ...]  # (start, end) prompt positions of every reused segment
    page_size: int

    @property
    def num_reused(self) -> int:
        return int((~self.is_new).sum())

    def new_intervals(self) -> list[tuple[int, int]]:
        """Maximal runs [a, b) of new tokens."""
        edge = np.diff(np.concatenate([[0], np.asarray(self.is_new, np.int8), [0]]))
        return list(zip(np.nonzero(edge == 1)[0].tolist(), np.nonzero(edge == -1)[0].tolist()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
    """One layer of the reuse pass over R rows (prompt tokens in this phase). Pure arrays."""

    q: jax.Array  # [R, Hq, D] post-RoPE queries of the rows (fp32)
    k: jax.Array  # [R, Hkv, D] fresh post-RoPE keys of the rows (from this pass's hidden states)
    v: jax.Array  # [R, Hkv, D] fresh values
    k_cached: jax.Array  # [R, Hkv, D] what the cache holds for the rows before this layer's writes
    v_cached: jax.Array  # [R, Hkv, D]
    positions: jax.Array  # [R] int32, -1 = padding row
    is_new: jax.Array  # [R] bool
    forced: jax.Array  # [R] bool: always recomputed (new text and the method's host-forced tokens)
    seg_offset: jax.Array  # [R] int32 offset inside the reused segment, -1 = new
    probe: jax.Array  # [Np] int32 row indices of the probe queries (the new text after the first segment),
    # front-packed, -1 = padding; Np follows the prompt bucket (read them through `probe_sum`)
    is_global: jax.Array  # [Hkv] bool: the head-class map's global heads of this layer
    sink: jax.Array  # [Hkv] int32 local heads' sink (0 for global heads)
    window: jax.Array  # [Hkv] int32 local heads' window (0 for global heads)
    # The layer: a Python int in the unrolled loop, a traced int32 scalar in a shared layer body (or under
    # the scan). `span` (static) is the layer range [start, stop) the traced body serves ((layer, layer + 1)
    # unrolled); a hook that decides something in Python by layer reads it, and names the layers where its
    # decision changes in `ReusePolicy.layer_breaks`, so no shared body's range crosses one.
    layer: Any = 0
    span: tuple[int, int] = dataclasses.field(metadata={"static": True}, default=(0, 1))
    # Which method of a shared selection program scores (`ScoreUnion`): an int32 scalar, data.
    method: Any = 0

    @property
    def valid(self) -> jax.Array:
        return self.positions >= 0

    def probe_sum(self, fn, k: jax.Array | None = None) -> jax.Array:
        """Sum over the probe queries of ``fn(probs, rows)``, `PROBE_CHUNK` probes at a time: `probs`
        [Hkv, G, C, R] is their softmax over the rows' keys (`k`, default the fresh ones), causal by
        position, fp32, all zero for padding probes (`fn` must give zero for them); `rows` [C] their row
        indices (-1 = padding). The probe array is as long as the prompt bucket, so a question's length is
        no compile key: only the chunks up to the last probe run (a loop of data-dependent length), and a
        long question never holds more than one chunk's probabilities."""
        k = self.k if k is None else k
        probe = self.probe
        pad = -probe.shape[0] % PROBE_CHUNK
        if pad:
            probe = jnp.concatenate([probe, jnp.full((pad,), -1, probe.dtype)])
        last = jnp.max(jnp.where(probe >= 0, jnp.arange(probe.shape[0]), -1))
        chunks = (last + PROBE_CHUNK) // PROBE_CHUNK

        def chunk(c):
            rows = jax.lax.dynamic_slice(probe, (c * PROBE_CHUNK,), (PROBE_CHUNK,))
            return self._probe_probs(rows, k), rows

        # the first chunk always runs (all padding without probes: `fn` of zero probabilities)
        return jax.lax.fori_loop(1, chunks, lambda c, acc: jax.tree.map(jnp.add, acc, fn(*chunk(c))),
                                 fn(*chunk(0)))

    def _probe_probs(self, probe: jax.Array, k: jax.Array) -> jax.Array:
        """[Hkv, G, C, R] softmax of the probe queries at rows `probe` [C] (-1: padding, all zero)."""
        hkv = k.shape[1]
        rows = probe >= 0
        pi = jnp.maximum(probe, 0)
        qp = self.q[pi].astype(jnp.float32)  # [C, Hq, D]
        g = qp.shape[1] // hkv
        qp = qp.reshape(qp.shape[0], hkv, g, -1)
        logits = jnp.einsum("nhgd,rhd->hgnr", qp, k.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * (qp.shape[-1] ** -0.5)
        qpos = self.positions[pi]
        vis = (self.positions[None, :] >= 0) & (self.positions[None, :] <= qpos[:, None]) & rows[:, None]
        logits = jnp.where(vis[None, None], logits, NEG)
        m = jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.where(vis[None, None], jnp.exp(logits - m), 0.0)
        return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def spread_forward(values: jax.Array, positions: jax.Array, width: int) -> jax.Array:
    """values [R, ...] -> each row's max over the rows at most `width` positions before it, itself
    included (rows ascend by position; padding rows, position -1, neither give nor take). Bool values: any.
    Induction reads the token after a match, so a score that finds the match should reach its successors."""
    if width == 0:
        return values
    valid = positions >= 0
    fill = jnp.zeros((), values.dtype) if values.dtype == bool else jnp.asarray(NEG, values.dtype)
    out = values
    for k in range(1, min(width, values.shape[0] - 1) + 1):  # no row lies R or more rows before another
        src = jnp.concatenate([jnp.full((k,) + values.shape[1:], fill), values[:-k]])
        src_pos = jnp.concatenate([jnp.full((k,), -1, positions.dtype), positions[:-k]])
        reach = valid & (src_pos >= 0) & (positions - src_pos <= width)
        out = jnp.maximum(out, jnp.where(reach.reshape(reach.shape + (1,) * (values.ndim - 1)), src, fill))
    return out


def _check_int(policy, field: str, lo: int = 0) -> None:
    v = getattr(policy, field)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{policy.name}: {field} must be an integer >= {lo} (got {v!r})")


def _check_frac(policy, field: str) -> None:
    v = getattr(policy, field)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not 0 <= v <= 1:
        raise ValueError(f"{policy.name}: {field} must be a fraction in [0, 1] (got {v!r})")


@dataclasses.dataclass(frozen=True)
class ReusePolicy:
    """Base of the reuse methods. `full_layers` = layers recomputed for every token before selection."""

    name: ClassVar[str] = "base"
    # Reuses segment K/V at all (False: the prompt is prefilled as plain text, segments are not looked up).
    reuses: ClassVar[bool] = True
    # The method's `score` picks extra rows at layer `full_layers` (else only the forced rows recompute).
    selects: ClassVar[bool] = False
    # Unpromoted local heads attend to their sinks + window only in the sparse phase (RedKnot's local
    # recovery); else every head sees the whole history.
    local_windows: ClassVar[bool] = False
    # The pass's layer loop is one `lax.fori_loop` (`llama.run_layers(rolled=True)`): one compiled layer
    # body instead of one per layer, for a method whose layer body is large (RedKnot: per-layer windowed
    # attention variants, probe-mass loops, sorts); it costs a copy of each layer's weights per pass.
    rolled_layers: ClassVar[bool] = False
    full_layers: int = 0

    def __post_init__(self):
        _check_int(self, "full_layers")

    # ---- capabilities the engine asks for -----------------------------------------------------------
    @property
    def uses_segment_ffn(self) -> bool:
        """The pass reads `ffn_cache` [L, T, hidden]: each reused token's FFN output from its segment's own
        prefill (jaxkv/policies/reuse/ffn_cache.py builds it)."""
        return False

    @property
    def selects_per_head(self) -> bool:
        """`score` ranks rows per KV head ([R, Hkv]), so the pass holds up to Hkv times the selected rows."""
        return False

    # ---- host side --------------------------------------------------------------------------------
    def forced(self, lay: Layout) -> np.ndarray:
        """[n] bool tokens recomputed in every sparse layer (default: the new text)."""
        return lay.is_new.copy()

    def num_selected(self, lay: Layout) -> int:
        """Reused tokens `score` adds to the forced ones (static per prompt bucket)."""
        return 0

    # ---- device side (pure jnp) -------------------------------------------------------------------
    def score(self, view: LayerView) -> jax.Array:
        """[R] (or [R, Hkv] for per-head selection) higher = recompute; called at layer `full_layers`."""
        raise NotImplementedError

    def head_writes(self, view: LayerView, selected: jax.Array) -> jax.Array:
        """[R, Hkv] bool: (row, KV head) whose fresh K/V replaces the cached one in this layer.
        `selected` [R, Hkv] is the per-head choice made at the selection layer (all True by default)."""
        return view.valid[:, None] & selected

    def ffn_rows(self, view: LayerView, probe_mass_fn) -> tuple[jax.Array, ...] | None:
        """(keep [R] bool, priority [R] float) rows that get the FFN in this layer, or None for all. At most
        `ffn_capacity_rows` of them run (highest priority first). `probe_mass_fn()` returns the attention
        mass the probes give each row's key after this layer's writes, summed over the probes and the query
        heads of each KV head ([Hkv, R]). A third item, a traced bool [], makes "all rows" a choice of data
        (true: every valid row runs the FFN in this layer), so one shared layer body serves layers of both
        kinds instead of splitting the loop at a `layer_breaks` boundary."""
        return None

    def ffn_capacity_rows(self, num_rows):
        """Number of rows a sparse-FFN layer gathers out of `num_rows` (all: no cap). Given the bucket's
        rows (an int) it sizes the buffer; given the prompt's valid rows (traced) it is how many of the
        buffer run, so the FFN a row gets does not depend on the bucket its prompt was padded to."""
        return num_rows

    def head_promote(self, view: LayerView) -> jax.Array | None:
        """[Hkv] bool heads to recompute for every row in this layer (RedKnot's restore), or None."""
        return None

    def layer_breaks(self) -> tuple[int, ...]:
        """Layers at which a hook's static (Python) choice changes (it reads `LayerView.span`): the reuse
        pass splits its layer loop there, one shared layer body per range between them."""
        return ()

    def device_form(self) -> ReusePolicy:
        """The policy as its compiled pass sees it. A method that changes host hooks only (`forced`,
        `num_selected`: naive, EPIC, full) keeps the base class's device hooks, so its pass is the plain
        pass of its `full_layers`, and such methods share one program per shape."""
        cls = type(self)
        base = ReusePolicy
        if ((cls.selects, cls.local_windows, cls.rolled_layers) != (base.selects, base.local_windows,
                                                                    base.rolled_layers)
                or any(getattr(cls, h) is not getattr(base, h) for h in DEVICE_HOOKS)):
            return self
        return PlainPass(full_layers=self.full_layers)

    def segment_heads(self, is_global: np.ndarray) -> np.ndarray:
        """[L, Hkv] bool: the (layer, KV head) pairs whose cached segment K/V this method reads; the others
        need not be on the device (segment tiers copy only these up). `is_global` [L, Hkv] is the reuse
        head-class map. Default: every head (a method that keeps any reused K/V of a head reads it)."""
        return np.ones(np.shape(is_global), bool) if self.reuses else np.zeros(np.shape(is_global), bool)


# What the compiled pass reads of a method besides `full_layers`, `selects`, `local_windows` and
# `rolled_layers`.
DEVICE_HOOKS = ("score", "head_writes", "ffn_rows", "ffn_capacity_rows", "head_promote", "layer_breaks",
                "uses_segment_ffn", "selects_per_head")


@dataclasses.dataclass(frozen=True)
class PlainPass(ReusePolicy):
    """The compiled pass of every method with the base class's device hooks (`ReusePolicy.device_form`);
    not a method of its own (never registered)."""

    name = "plain pass"


@dataclasses.dataclass(frozen=True)
class ScoreUnion(ReusePolicy):
    """The selection program several selecting methods share (`jaxkv.engine.reuse_steps`): each method's
    `score` is a branch and the request's method is data (`LayerView.method`), so a server enabling
    CacheBlend and SparseX compiles one selection per token bucket, not one per method. `methods` are the
    members' device forms, all of `full_layers` and of one `selects_per_head`; not a method of its own."""

    name = "score union"
    selects = True
    methods: tuple = ()
    per_head: bool = False

    @property
    def selects_per_head(self) -> bool:
        return self.per_head

    def score(self, view: LayerView) -> jax.Array:
        branches = [lambda m=m: m.score(view).astype(jnp.float32) for m in self.methods]
        return jax.lax.switch(jnp.asarray(view.method, jnp.int32), branches)


REUSE_POLICIES: dict[str, type] = {}


def register_reuse(cls):
    if cls.name in REUSE_POLICIES:
        raise ValueError(f"reuse policy {cls.name!r} is registered twice")
    REUSE_POLICIES[cls.name] = cls
    return cls


def get_reuse_policy(name: str, **fields) -> ReusePolicy:
    """Builds the reuse method `name` with `fields`."""
    if name not in REUSE_POLICIES:
        raise ValueError(f"unknown reuse method {name!r}; choose from {sorted(REUSE_POLICIES)}")
    cls = REUSE_POLICIES[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"reuse method {name!r} has no field(s) {unknown}; fields: {sorted(known)}")
    return cls(**fields)


def resolve_reuse(policy) -> ReusePolicy:
    """A ReusePolicy, or a registered name."""
    if isinstance(policy, str):
        return get_reuse_policy(policy)
    if not isinstance(policy, ReusePolicy):
        raise ValueError(f"reuse must be a method name or a ReusePolicy (got {type(policy).__name__})")
    return policy
