"""The policy seam: what a KV method sees, what it returns, and the shared selection rule.

A compression method is one frozen dataclass with two pure-jnp hooks:

* ``score(obs) -> [S, Hkv, N]`` runs once per layer inside the jitted observation pass (the last
  ``window`` cached tokens re-run through the model, reading the cache, writing nothing). ``obs`` carries the
  window's queries, every cached key/value of the layer gathered per head, their original positions and the
  window's GQA logits. Higher score = more worth keeping.
* ``counts(scores, ctx) -> [S, L, Hkv]`` turns every layer's scores into per-head keep counts (uniform,
  per-layer pyramid, per-head adaptive, top-p); the default keeps ``ctx.target`` tokens per head.

The shared rule `select` keeps, per head, the forced tokens (the first ``sink`` positions and the recent
``window``) and then the highest-scoring rest up to the count; `jaxkv.policies.apply` compacts the pages
with the static rewrite and the host frees what lies past each head's new length. No method sees the
engine, the pool or the page tables.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

NEG = -1e30  # score of a slot that must never be kept
FORCED = 1e30  # score of a slot that is always kept


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Observation:
    """One layer seen by the observation window. S sequences, W window queries, N cache slots per head."""

    q: jax.Array  # [S, W, Hq, D] post-RoPE queries of the window (fp32)
    q_pos: jax.Array  # [S, W] int32 positions of the window queries, -1 = padding
    k: jax.Array  # [S, Hkv, N, D] cached keys (post-RoPE), slot order of the head's page list
    v: jax.Array  # [S, Hkv, N, D] cached values
    k_pos: jax.Array  # [S, Hkv, N] int32 original position of each slot, -1 = empty / past the length
    logits: jax.Array  # [S, Hkv, G, W, N] float32 scaled q.k, NEG where the query cannot see the key
    layer: int = dataclasses.field(metadata={"static": True}, default=0)

    @property
    def probs(self) -> jax.Array:
        """[S, Hkv, G, W, N] softmax over the visible keys of each window query (0 for padding rows)."""
        m = jnp.max(self.logits, axis=-1, keepdims=True)
        e = jnp.where(self.logits > NEG / 2, jnp.exp(self.logits - m), 0.0)
        return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)

    @property
    def valid(self) -> jax.Array:
        """[S, Hkv, N] slots holding a token."""
        return self.k_pos >= 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelectContext:
    """Everything a `counts` hook may read besides the scores (all device arrays)."""

    lengths: jax.Array  # [S, L, Hkv] int32 slots each head holds now
    positions: jax.Array  # [S, L, Hkv, N] int32 original positions, -1 = empty
    target: jax.Array  # [S] int32 tokens per head the request's budget allows (before head adaptivity)
    recent_from: jax.Array  # [S] int32 first position of the recent window (always kept)
    compressible: jax.Array  # [L, Hkv] bool: heads a policy may compress (not local, not retrieval)
    lower: jax.Array  # [L, Hkv] int32 per-head minimum (head class `budget`, else 0)
    upper: jax.Array  # [L, Hkv] int32 per-head maximum (head class `budget`, else 0 = no cap)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Keep:
    """Per-head keep sets: ``idx[s, l, h, :count[s, l, h]]`` ascending slot indices, the rest padding."""

    idx: jax.Array  # [S, L, Hkv, K] int32
    count: jax.Array  # [S, L, Hkv] int32


@dataclasses.dataclass(frozen=True)
class CompressPolicy:
    """Base of the compression methods. Subclasses set `name` and override `score` and/or `counts`.

    budget: <= 1 is a fraction of the prompt, > 1 a number of tokens per head (averaged over heads for the
    adaptive methods). window: observation-window queries, also kept unconditionally as the recent tokens.
    sink: first positions always kept. decode_interval: 0 = compress once at the end of prefill; N > 0 =
    also every N generated tokens (then the budget is a number of tokens, or a fraction of the prompt).
    merge: fold each evicted token into its most similar kept token (key cosine >= merge_sim) with a logit
    bias that keeps its attention mass (`jaxkv.policies.apply.merge_evicted`; the engine then holds a bias
    per slot, `Engine(kv_merge=True)`, on automatically for an engine-wide merging policy).
    """

    name: ClassVar[str] = "base"
    kind: ClassVar[str] = "compress"  # which seam the engine runs it through (retrieval methods: "retrieval")
    budget: float = 0.25
    window: int = 32
    sink: int = 4
    decode_interval: int = 0
    merge: bool = False
    merge_sim: float = 0.8

    def __post_init__(self):
        if not (isinstance(self.budget, int | float) and math.isfinite(self.budget) and self.budget > 0):
            raise ValueError(f"{self.name}: budget must be a positive fraction (<= 1) or token count "
                             f"(got {self.budget!r})")
        for field in ("window", "sink", "decode_interval"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{self.name}: {field} must be a non-negative integer (got {v!r})")
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1 (got {self.window})")
        if not isinstance(self.merge, bool):
            raise ValueError(f"{self.name}: merge must be true or false (got {self.merge!r})")
        if isinstance(self.merge_sim, bool) or not isinstance(self.merge_sim, int | float) or not (
                -1 <= self.merge_sim <= 1):
            raise ValueError(f"{self.name}: merge_sim must be a cosine in [-1, 1] (got {self.merge_sim!r})")

    # ---- host side --------------------------------------------------------------------------------
    def target_tokens(self, prompt_len: int) -> int:
        """Tokens per head this request keeps (never fewer than sink + window)."""
        n = self.budget * prompt_len if self.budget <= 1 else self.budget
        return max(int(round(n)), self.sink + self.window)

    def device_form(self) -> CompressPolicy:
        """The policy as its compiled program sees it: every field but the budget, which reaches the device
        as each row's target (so requests of any budget share one program)."""
        default = type(self).budget
        return self if self.budget == default else dataclasses.replace(self, budget=default)

    def bind(self, model) -> CompressPolicy:
        """The policy as used with `model` (e.g. with offline calibration found beside it); default: self."""
        return self

    def recent_tokens(self, target: int) -> int:
        """Newest tokens kept unconditionally (the observation window by default)."""
        return self.window

    def max_count(self, target: int, num_kv_heads: int = 1) -> int:
        """Largest per-head count `counts` can return for `target` (sizes the static keep buffer)."""
        return target

    # ---- device side (pure jnp) ---------------------------------------------------------------------
    def score(self, obs: Observation) -> jax.Array:
        raise NotImplementedError

    def counts(self, scores: jax.Array, ctx: SelectContext) -> jax.Array:
        return jnp.broadcast_to(ctx.target[:, None, None], ctx.lengths.shape).astype(jnp.int32)


def forced_mask(positions, sink: int, recent_from) -> jax.Array:
    """[S, L, H, N] slots that every policy keeps: sinks and the recent window."""
    valid = positions >= 0
    return valid & ((positions < sink) | (positions >= recent_from[:, None, None, None]))


def ranked(scores, positions, sink: int, recent_from) -> jax.Array:
    """Scores with forced slots on top and empty slots at the bottom."""
    valid = positions >= 0
    s = jnp.where(valid, scores.astype(jnp.float32), NEG)
    return jnp.where(forced_mask(positions, sink, recent_from), FORCED, s)


def select(scores, counts, ctx: SelectContext, *, sink: int, kmax: int) -> Keep:
    """The shared keep rule: forced slots, then the best-scoring ones, `counts` per head, ascending.

    Counts are clipped to [forced, length] and to `kmax`; a head that is not compressible keeps everything
    (its count becomes its length and the rewrite skips it).
    """
    r = ranked(scores, ctx.positions, sink, ctx.recent_from)
    n_forced = jnp.sum(forced_mask(ctx.positions, sink, ctx.recent_from), axis=-1)
    count = jnp.clip(jnp.maximum(counts, n_forced), 0, ctx.lengths)
    count = jnp.minimum(count, kmax)
    count = jnp.where(ctx.compressible[None], count, ctx.lengths).astype(jnp.int32)
    k = min(kmax, r.shape[-1])
    _, top = jax.lax.top_k(r, k)  # [S, L, H, k] best first
    take = jnp.arange(k) < count[..., None]
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(take, top, big), axis=-1)
    idx = jnp.where(idx == big, 0, idx).astype(jnp.int32)
    if k < kmax:
        idx = jnp.pad(idx, [(0, 0)] * 3 + [(0, kmax - k)])
    return Keep(idx=idx, count=count)


def window_vote(obs: Observation, reduce: str = "mean") -> jax.Array:
    """[S, Hkv, N] attention mass each slot receives from the window, summed over queries and reduced over
    the GQA group (SnapKV's vote)."""
    mass = jnp.sum(obs.probs, axis=3)  # [S, Hkv, G, N]
    return {"mean": jnp.mean, "max": jnp.max, "sum": jnp.sum}[reduce](mass, axis=2)


def pool1d(x, kernel: int, kind: str = "max") -> jax.Array:
    """Same-size 1-D pooling along the last axis (SnapKV's smoothing; padding keeps the length)."""
    if kernel <= 1:
        return x
    pad = kernel // 2
    if kind == "max":
        xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, kernel - 1 - pad)], constant_values=-jnp.inf)
        return jax.lax.reduce_window(xp, -jnp.inf, jax.lax.max, (1,) * (x.ndim - 1) + (kernel,),
                                     (1,) * x.ndim, "VALID")
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, kernel - 1 - pad)])
    return jax.lax.reduce_window(xp, 0.0, jax.lax.add, (1,) * (x.ndim - 1) + (kernel,), (1,) * x.ndim,
                                 "VALID") / kernel
