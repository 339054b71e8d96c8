"""SparseX (Zhang et al. 2026, arXiv:2606.01751): Sparse-Q top-k recompute with a full-then-sparse split.

* Sparse-Q: the new text's queries (the probes) score every reused token by the attention it receives,
  ``s_j = sum_i softmax(Q_new K^T)[i, j]`` summed over query heads (or per KV head with ``per_head``), at
  layer ``full_layers`` (ℓ*; layers before it are recomputed for every token, so the keys scored are fresh);
  the top ``ratio`` of the reused tokens are recomputed with the new text in the remaining layers.
* Overflow: one block of `block` tokens on each side of every run of new text is recomputed.
* Tail fallback: when the prompt ends in reused text, its last `tail` tokens are recomputed (the probes
  cannot see them).
* Successor spread (`dilate`, ours, off by default): a token's score is the max over itself and the `dilate`
  tokens before it, so the top-k takes the tokens after a probed match too (what induction copies).
The paper gives no k; `ratio` defaults to CacheBlend's 15 % so the two compare at equal recompute.
"""

from __future__ import annotations

import dataclasses
import math

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
class SparseX(ReusePolicy):
    name = "sparsex"
    selects = True
    full_layers: int = 1  # ℓ*: the paper's 15-20 % of the layers for small dense models (1-2 of 8 here)
    ratio: float = 0.15  # top-k as a fraction of the reused tokens
    block: int = 16  # overflow block (a KV page in the paper)
    tail: int = 64  # tail fallback length
    per_head: bool = False  # select per KV head (each head recomputes its own top-k) instead of aggregated
    dilate: int = 0  # a token scores the max over itself and the `dilate` tokens before it (see `score`)

    def __post_init__(self):
        super().__post_init__()
        _check_frac(self, "ratio")
        _check_int(self, "block")
        _check_int(self, "tail")
        _check_int(self, "dilate")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{self.name}: per_head must be a bool (got {self.per_head!r})")

    @property
    def selects_per_head(self) -> bool:
        return self.per_head

    def forced(self, lay: Layout) -> np.ndarray:
        f = lay.is_new.copy()
        n = lay.num_tokens
        for a, b in lay.new_intervals():
            f[max(0, a - self.block):a] = True  # last block of the reused text before the new run
            f[b:min(n, b + self.block)] = True  # first block after it
        if not lay.is_new[-1] and self.tail:
            start = lay.seg_bounds[-1][0]
            f[max(start, n - self.tail):] = True
        return f

    def num_selected(self, lay: Layout) -> int:
        return math.ceil(self.ratio * lay.num_reused)

    def score(self, view: LayerView):
        mass = view.probe_sum(lambda probs, _: jnp.sum(probs, axis=(1, 2)))  # [Hkv, R]
        score = mass.T if self.per_head else jnp.sum(mass, axis=0)
        return spread_forward(score, view.positions, self.dilate)
