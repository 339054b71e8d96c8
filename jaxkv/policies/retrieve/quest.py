"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference").

Per page of the KV cache (a page = the engine's pool page: ``page_size`` consecutive slots of one (layer,
KV head)) the element-wise min and max of its keys are a bounding box. At decode, the current query bounds
every page's best attention logit by ``sum_d max(q_d * min_d, q_d * max_d)``; each (layer, KV head) reads
only its top pages up to the token budget (GQA: the bound is max-reduced over the query heads of the group),
and attention runs over those pages only. Selection is **per layer** (each layer's own query), so Quest is a
layer-wise retrieval policy (`layer_wise = True`); the paper keeps the first two layers dense
(``dense_layers``). The page holding the current token is always read, as are pages holding a position
``< sink`` or ``>= pos - recent``.

The per-page min/max is Quest's state, `PageBounds` (``Quest.page_state``): the engine keeps one beside the
pool and folds every K write of a step that holds a Quest request into it (prefill included), so a decode
step reads 2 x D bounds per page (`Quest.read_pages`) plus the selected pages' K/V; `page_bounds` is the
same bound computed from a page's keys (tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.policies.registry import register
from jaxkv.policies.retrieve.base import RetrievalPolicy


def page_bounds(k_pages: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k_pages [..., P, ps, D], valid [..., P, ps] bool -> (kmin, kmax) [..., P, D] float32 over the valid
    slots (+inf / -inf for an empty page)."""
    kf = k_pages.astype(jnp.float32)
    m = valid[..., None]
    return jnp.min(jnp.where(m, kf, jnp.inf), axis=-2), jnp.max(jnp.where(m, kf, -jnp.inf), axis=-2)


class PageBounds:
    """Quest's per-page state: the key bounds (kmin, kmax) [num_pages, D] in the pool's dtype, indexed by
    page id (empty: +inf / -inf)."""

    @staticmethod
    def init(num_pages: int, head_dim: int, dtype):
        shape = (num_pages, head_dim)
        return jnp.full(shape, jnp.inf, dtype), jnp.full(shape, -jnp.inf, dtype)

    @staticmethod
    def update(bounds, k: jax.Array, slots: jax.Array, page_size: int):
        """Folds one layer's new keys k [T, Hkv, D] at flat slots [T, Hkv] (-1 = skipped) into the bounds. A
        write at a page's offset 0 is the page's first (the engine fills a global head's pages in order), so
        it resets the page (a page reused after another sequence freed it starts clean)."""
        kmin, kmax = bounds
        n, d = kmin.shape
        flat = slots.reshape(-1)
        page = jnp.where(flat >= 0, flat // page_size, n)  # out of bounds: dropped
        first = jnp.where((flat >= 0) & (flat % page_size == 0), page, n)
        kk = k.reshape(-1, d).astype(kmin.dtype)
        kmin = kmin.at[first].set(jnp.inf, mode="drop").at[page].min(kk, mode="drop")
        kmax = kmax.at[first].set(-jnp.inf, mode="drop").at[page].max(kk, mode="drop")
        return kmin, kmax


@register
@dataclasses.dataclass(frozen=True)
class Quest(RetrievalPolicy):
    """budget: tokens per (layer, KV head) per step, read as ``max(1, budget // page_size)`` whole pages."""

    name = "quest"
    layer_wise = True
    page_state = PageBounds
    dense_layers: int = 2

    def __post_init__(self):
        super().__post_init__()
        v = self.dense_layers
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{self.name}: dense_layers must be a non-negative integer (got {v!r})")

    def tap_layer(self, head) -> int:
        """The first ``dense_layers`` layers read the whole cache; the page choice starts after them."""
        return self.dense_layers

    def scores(self, head, state, x, positions):
        raise NotImplementedError("quest scores pages inside each layer (page_scores), not once per step")

    def read_pages(self, bounds, page_table, lengths, q, q_pos, page_size: int):
        """This layer's read set from the maintained bounds: page_table [S, Hkv, P] page ids (-1 padding),
        lengths [S, Hkv], q [S, Hq, D], q_pos [S] -> (page ids [S, Hkv, n], keep [S, Hkv, n, page_size]: the
        slots of those pages attention reads). Reads 2 x D bound values per page of the list."""
        p = page_table.shape[-1]
        ptc = jnp.maximum(page_table, 0)
        j = jnp.arange(p * page_size, dtype=jnp.int32).reshape(p, page_size)
        valid = (j < lengths[..., None, None]) & (page_table >= 0)[..., None]  # [S, Hkv, P, ps]
        kmin, kmax = bounds[0][ptc].astype(jnp.float32), bounds[1][ptc].astype(jnp.float32)
        idx, count = self.select_pages(self.page_scores(q, kmin, kmax), lengths, page_size, q_pos)
        pages = jnp.take_along_axis(ptc, idx, axis=-1)
        keep = (jnp.arange(idx.shape[-1]) < count[..., None])[..., None] & jnp.take_along_axis(
            valid, idx[..., None], axis=2)
        return pages, keep

    def num_pages(self, page_size: int) -> int:
        return max(1, self.budget // page_size)

    def page_scores(self, q: jax.Array, kmin: jax.Array, kmax: jax.Array) -> jax.Array:
        """q [S, Hq, D] (post-RoPE), kmin/kmax [S, Hkv, P, D] -> upper bounds [S, Hkv, P] (max over the GQA
        group of sum_d max(q_d min_d, q_d max_d)); empty pages give -inf or nan, which `select_pages`
        masks."""
        s, hq, d = q.shape
        hkv = kmin.shape[1]
        qg = q.astype(jnp.float32).reshape(s, hkv, hq // hkv, 1, d)
        ub = jnp.sum(jnp.maximum(qg * kmin[:, :, None], qg * kmax[:, :, None]), axis=-1)  # [S, Hkv, G, P]
        return jnp.max(ub, axis=2)

    def select_pages(self, scores: jax.Array, lengths: jax.Array, page_size: int, q_pos: jax.Array):
        """scores [S, Hkv, P], lengths [S, Hkv] stored slots (storage index == position on the global heads
        Quest serves), q_pos [S] -> (page indices [S, Hkv, n] ascending into the page list, count [S, Hkv]);
        n = min(num_pages(page_size), P)."""
        p = scores.shape[-1]
        n = min(self.num_pages(page_size), p)
        j = jnp.arange(p, dtype=jnp.int32)
        npages = (lengths + page_size - 1) // page_size  # [S, Hkv]
        valid = j < npages[..., None]
        first, last = j * page_size, j * page_size + page_size - 1  # positions a page holds (global heads)
        qp = q_pos[:, None, None]
        forced = valid & ((j == npages[..., None] - 1) | (first < self.sink) | (last >= qp - self.recent + 1)
                          & (self.recent > 0))
        s = jnp.where(valid, scores.astype(jnp.float32), -jnp.inf)
        s = jnp.where(jnp.isnan(s), -jnp.inf, s)
        rank = jnp.where(forced, jnp.inf, s)
        _, top = jax.lax.top_k(rank, n)
        count = jnp.minimum(n, npages).astype(jnp.int32)
        big = jnp.iinfo(jnp.int32).max
        idx = jnp.sort(jnp.where(jnp.arange(n) < count[..., None], top, big), axis=-1)
        return jnp.where(idx == big, 0, idx).astype(jnp.int32), count
