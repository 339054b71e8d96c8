"""RedKnot (Liu et al. 2026, arXiv:2606.06256): head-aware recovery + sparse FFN + edge-mass restore.

Every token's hidden state is carried through every layer (global heads need the whole prompt), but K/V are
rewritten per head: a *global* head (head-class map) gets fresh K/V for every token; a *local* head keeps
the rotated cached K/V except where its window changed: the new text, its sink positions and the first
`window` tokens of each segment (whose window reaches across the segment start) — "sink + window repaired".
From layer `dense_until` on, the FFN runs only on the tokens that receive the most attention from the new
text (smallest set holding `mass_thresh` of the probe mass, summed over heads), plus the last `recent_n`
tokens and the new text; the others pass through the residual. Those rows are gathered into a static buffer
of ``ffn_capacity`` x rows (new text and recent tokens first, then by mass; what does not fit is dropped
lowest-mass first and counted in the stats), so the FFN costs the buffer, not the prompt.

Successor dilation (`ffn_dilate`, our addition; the paper only says "top-k tokens by attention score"): the
rows up to `ffn_dilate` positions after a selected row get the FFN too. The question's probes attend to
where their words match (a needle's key), but induction copies the tokens *after* the match (its value),
which receive little probe mass in the middle layers; skipping their FFN is what cost mq_niah
(docs/eval.md, "RedKnot ablation").

FFN reuse (`ffn_reuse`, ours, off by default): a skipped reused row adds its segment's cached FFN output
instead of nothing. On the embedded model a token's FFN output hardly depends on what precedes its segment,
so the cached one stands in for the skipped one almost exactly (docs/eval.md, "FFN reuse").

Local recovery (Algorithm 1 l. 15, Algorithm 2): an unpromoted local head attends to its sinks + window
only (`local_windows`), the visible set whose K/V it repairs; beyond it the head would read stale reused
K/V anyway, and restricting it is what lets the paged kernel skip those pages.

Edge-mass restore (the paper names it, never defines it; our definition): for each local head, the probes'
attention over fresh keys is measured at the window's edge — keys at distance >= (1 - `edge_frac`) *
window from the query, sinks excluded, i.e. the oldest `edge_frac` of the window and everything past it.
If the mean mass there exceeds `edge_thresh`, the head is promoted to full recompute in that layer.
``edge_thresh >= 1`` turns it off.
"""

from __future__ import annotations

import dataclasses
import fractions

import jax.numpy as jnp
import numpy as np

from jaxkv.policies.reuse.base import (
    LayerView,
    Layout,
    ReusePolicy,
    _check_frac,
    _check_int,
    register_reuse,
    spread_forward,
)


@register_reuse
@dataclasses.dataclass(frozen=True)
class RedKnot(ReusePolicy):
    name = "redknot"
    # Its layer body (a flash branch per windowed head-class configuration of the map, probe-mass loops,
    # sorts) compiled once per layer: 79 s to over 100 s per 8K pass shape on an H100 (SmolLM2); rolled,
    # once per pass: 11-37 s (docs/benchmarks.md, "Reuse pass compile").
    rolled_layers = True
    dense_until: int = 2  # layers with a dense FFN (the paper's 20 of 32-80; 2 of 8 here)
    mass_thresh: float = 0.8  # the paper's 0.5 selects fewer sources than the dilation can use (docs/eval.md)
    recent_n: int = 128
    edge_frac: float = 0.25
    edge_thresh: float = 0.2
    # Sparse-FFN buffer as a fraction of the rows (1 = no cap). 0.5: the mass_thresh=0.5 selection keeps
    # 14-42 % of a 2K prompt's rows on the embedded model (docs/eval.md), so the cap does not bind there.
    ffn_capacity: float = 0.5
    # Unpromoted local heads attend to sinks + window only (the paper); False: whole history, stale K/V
    # included (costs full attention; with the restore off it is what keeps this repo's 2K evals right).
    local_windows: bool = True
    # Rows within this many positions after a selected row get the FFN too (priority: the selected row's
    # share). Induction copies the token *after* the one the question matches: the probes' mass finds the
    # match, the answer is its successor.
    ffn_dilate: int = 16  # 0 + mass_thresh 0.5: the paper's rule
    # Reused rows whose FFN is skipped add the FFN output their segment's own prefill gave them (after its
    # anchor) instead of nothing (the paper's Z = 0). Costs a [layers, tokens, hidden] array per segment,
    # computed on the segment's first use by such a request (docs/policies.md, "FFN reuse").
    ffn_reuse: bool = False
    # How the sparse FFN ranks the reused rows: "mass" (the paper: attention the new text gives them, plus
    # the dilation) or "deviation" (how far each row's fresh K moved from its cached K, summed over KV heads:
    # the rows whose context changed them; with `ffn_reuse` the others add a cached FFN output that was
    # computed in nearly the same context). The buffer (`ffn_capacity`) takes the top rows either way.
    ffn_select: str = "mass"

    def __post_init__(self):
        super().__post_init__()
        _check_int(self, "dense_until")
        _check_int(self, "recent_n")
        _check_int(self, "ffn_dilate")
        _check_frac(self, "mass_thresh")
        _check_frac(self, "edge_frac")
        _check_frac(self, "ffn_capacity")
        for f in ("local_windows", "ffn_reuse"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{self.name}: {f} must be a bool (got {getattr(self, f)!r})")
        if self.ffn_select not in ("mass", "deviation"):
            raise ValueError(f"{self.name}: ffn_select must be 'mass' or 'deviation' "
                             f"(got {self.ffn_select!r})")
        if self.ffn_capacity == 0:
            raise ValueError(f"{self.name}: ffn_capacity must be > 0 (the last prompt token needs the FFN)")
        if not isinstance(self.edge_thresh, int | float) or self.edge_thresh < 0:
            raise ValueError(f"{self.name}: edge_thresh must be >= 0 (got {self.edge_thresh!r})")

    @property
    def uses_segment_ffn(self) -> bool:
        return self.ffn_reuse

    def forced(self, lay: Layout) -> np.ndarray:
        return np.ones(lay.num_tokens, bool)  # every hidden state is carried

    def head_promote(self, view: LayerView):
        if self.edge_thresh >= 1:
            return None
        far = (1 - self.edge_frac) * view.window  # [Hkv]

        def edge_mass(p, probe):  # p [Hkv, G, C, R] over fresh keys -> [Hkv] summed over the chunk's probes
            qpos = view.positions[jnp.maximum(probe, 0)]  # [C]
            dist = qpos[:, None] - view.positions[None, :]  # [C, R]
            edge = (dist[None] >= far[:, None, None]) & (
                view.positions[None, None, :] >= view.sink[:, None, None])  # [Hkv, C, R]
            mass = jnp.sum(p * edge[:, None], axis=-1)  # [Hkv, G, C]
            return jnp.sum(jnp.mean(mass, axis=1), axis=-1)

        nprobe = jnp.maximum(jnp.sum(view.probe >= 0), 1)
        mean = view.probe_sum(edge_mass) / nprobe  # [Hkv]
        return ~view.is_global & (mean > self.edge_thresh)

    def segment_heads(self, is_global):
        """A global head's K/V are recomputed for every token in every layer before anything attends to
        them, so only local heads read cached segment K/V (global ones too with ffn_select="deviation",
        which compares fresh and cached keys of every head)."""
        if self.ffn_select == "deviation":
            return np.ones(np.shape(is_global), bool)
        return ~np.asarray(is_global, bool)

    def head_writes(self, view: LayerView, selected):
        pos, off = view.positions[:, None], view.seg_offset[:, None]
        repaired = view.is_new[:, None] | (pos < view.sink[None]) | ((off >= 0) & (off < view.window[None]))
        return view.valid[:, None] & (view.is_global[None] | repaired)

    def ffn_rows(self, view: LayerView, probe_mass_fn):
        # Dense FFN before `dense_until`, sparse from it on. A body serving layers on both sides of it (one
        # rolled loop, so one compiled layer body per pass) gets that choice as data.
        span = (view.layer, view.layer + 1) if isinstance(view.layer, int) else view.span
        if span is not None and span[1] <= self.dense_until:
            return None
        dense = None if span is not None and span[0] >= self.dense_until else view.layer < self.dense_until
        last = jnp.max(view.positions)
        must = (view.positions > last - self.recent_n) | view.is_new
        if self.ffn_select == "deviation":  # every reused row is a candidate; the buffer keeps the top
            k, kc = view.k.astype(jnp.float32), view.k_cached.astype(jnp.float32)
            dev = jnp.where(view.valid & ~must, jnp.sum(jnp.linalg.norm(k - kc, axis=-1), -1), 0.0)
            share = dev / jnp.maximum(jnp.max(dev), 1e-30)  # in [0, 1]: below the forced rows' 2 +
            return _with_dense(view.valid, share + 2.0 * must, dense)
        mass = jnp.sum(probe_mass_fn(), axis=0)  # [R] probe mass received
        order = jnp.argsort(-mass)
        csum = jnp.cumsum(mass[order]) / jnp.maximum(jnp.sum(mass), 1e-30)
        keep_sorted = (csum - mass[order] / jnp.maximum(jnp.sum(mass), 1e-30)) < self.mass_thresh
        top = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        share = mass / jnp.maximum(jnp.sum(mass), 1e-30)
        top, share = _dilate(top, share, view.positions, self.ffn_dilate)
        return _with_dense(view.valid & (top | must), share + 2.0 * must, dense)

    def ffn_capacity_rows(self, num_rows):
        """ceil(ffn_capacity x rows) rounded up to a multiple of 8 (a bounded set of buffer shapes), in
        integers (`ffn_capacity` as a fraction of denominator <= 1000), so a traced count of valid rows gets
        the host's number exactly."""
        frac = fractions.Fraction(self.ffn_capacity).limit_denominator(1000)
        need = -(-(frac.numerator * num_rows) // frac.denominator)
        rounded = -(-need // 8) * 8
        return min(num_rows, rounded) if isinstance(num_rows, int) else jnp.minimum(num_rows, rounded)


def _with_dense(keep, priority, dense):
    return (keep, priority) if dense is None else (keep, priority, dense)


def _dilate(sel, share, positions, width: int):
    """Adds the rows at most `width` positions after a selected row; a row added takes the largest share
    of the selected rows that reach it (its priority under the capacity cap)."""
    if width == 0:
        return sel, share
    best = spread_forward(jnp.where(sel, share, -1.0), positions, width)  # shares are >= 0: -1 = none
    return best >= 0, jnp.where(sel, share, jnp.maximum(best, 0.0))
