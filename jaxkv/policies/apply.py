"""Runs a compression policy over some sequences of the paged cache: observe, score, select, rewrite.

The only caller of the policies' device hooks and of the static rewrite. One jitted function per
(model, policy, bucket): the last `window` cached tokens of each sequence re-run through the model reading
the cache (their own K/V are already there, so the hidden states are the prefill's own), each layer's
`policy.score` sees the window's queries against every slot of every head, `counts` + `select` pick the
keep sets, and `rewrite` compacts each compressible head in place on the donated pool. The host then frees
the pages past each head's new length (`HeadPageTables.compact`).

The observation pass computes attention densely over the gathered slots (S x W queries, N slots per head);
it is as exact as the prefill and cheap next to it for W << prompt length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.pool import KVPool
from jaxkv.models import llama
from jaxkv.policies.base import NEG, CompressPolicy, Observation, SelectContext, select
from pallas_kernels.rewrite.api import rewrite


@dataclasses.dataclass
class CompressBatch:
    """Host-built inputs for `compress`: S sequence rows, W window tokens, P page bucket."""

    tokens: np.ndarray  # [S, W] int32 window tokens (already in the cache), padding 0
    positions: np.ndarray  # [S, W] int32, -1 = padding
    page_table: np.ndarray  # [S, L, H, P] int32, -1 = padding
    lengths: np.ndarray  # [S, L, H] int32
    target: np.ndarray  # [S] int32 tokens per head
    recent_from: np.ndarray  # [S] int32 first position of the kept recent window


def _gather_head_slots(pool: KVPool, page_table):
    """Keys, values, positions of every slot of every head: page_table [S, H, P] -> [S, H, P*ps, ...]."""
    s, h, p = page_table.shape
    ps = pool.page_size
    pages = jnp.maximum(page_table, 0)
    k = pool.k[pages].reshape(s, h, p * ps, -1)
    v = pool.v[pages].reshape(s, h, p * ps, -1)
    pos = jnp.where((page_table >= 0)[..., None], pool.pos[pages], -1).reshape(s, h, p * ps)
    return k, v, pos


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "kmax", "impl"), donate_argnames=("pool",))
def compress(params, pool: KVPool, b: dict, heads: dict, *, cfg, policy: CompressPolicy, kmax: int,
             impl: str | None = None):
    """Returns (pool, count [S, L, H]): the compacted pool and each head's new length."""
    S, W = b["tokens"].shape
    L, H = cfg.num_layers, cfg.num_kv_heads
    G = cfg.num_heads // H
    scale = cfg.head_dim ** -0.5
    lengths = b["lengths"]

    def attend(layer, q, k_new, v_new, scores):
        del k_new, v_new  # the window's own K/V are already cached
        kc, vc, kpos = _gather_head_slots(pool, b["page_table"][:, layer])  # [S, H, N, D], [S, H, N]
        n = kpos.shape[-1]
        kpos = jnp.where(jnp.arange(n)[None, None] < lengths[:, layer][..., None], kpos, -1)
        qpos = b["positions"]  # [S, W]
        sink, window = heads["sink"][layer], heads["window"][layer]  # [H]
        vis = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= qpos[:, None, :, None])  # [S, H, W, N]
        inwin = (kpos[:, :, None, :] > qpos[:, None, :, None] - window[None, :, None, None]) | (
            kpos[:, :, None, :] < sink[None, :, None, None])
        vis &= (window[None, :, None, None] == 0) | inwin
        vis &= (qpos >= 0)[:, None, :, None]
        qg = q.reshape(S, W, H, G, -1).astype(jnp.float32)
        logits = jnp.einsum("swhgd,shnd->shgwn", qg, kc.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * scale
        logits = jnp.where(vis[:, :, None], logits, NEG)
        obs = Observation(q=q.astype(jnp.float32), q_pos=qpos, k=kc, v=vc, k_pos=kpos, logits=logits,
                          layer=layer)
        probs = obs.probs
        out = jnp.einsum("shgwn,shnd->swhgd", probs, vc.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
        scores = scores.at[:, layer].set(policy.score(obs).astype(jnp.float32))
        return out.reshape(S, W, H * G, -1).astype(q.dtype), scores

    n_slots = b["page_table"].shape[-1] * pool.page_size
    scores0 = jnp.zeros((S, L, H, n_slots), jnp.float32)
    positions = jnp.maximum(b["positions"], 0)
    _, scores = llama.forward(params, cfg, b["tokens"], positions, attend, scores0)

    # Original positions of every slot, all layers: [S, L, H, N].
    pages = jnp.maximum(b["page_table"], 0)
    slot_pos = jnp.where((b["page_table"] >= 0)[..., None], pool.pos[pages], -1)
    slot_pos = slot_pos.reshape(S, L, H, n_slots)
    slot_pos = jnp.where(jnp.arange(n_slots) < lengths[..., None], slot_pos, -1)
    ctx = SelectContext(lengths=lengths, positions=slot_pos, target=b["target"], recent_from=b["recent_from"],
                        compressible=heads["compressible"], lower=heads["lower"], upper=heads["upper"])
    counts = policy.counts(scores, ctx)
    keep = select(scores, counts, ctx, sink=policy.sink, kmax=kmax)
    shrink = heads["compressible"][None] & (keep.count < lengths)
    table = jnp.where(shrink[..., None], b["page_table"], -1)
    k, v, pos, *_ = rewrite(pool.k, pool.v, pool.pos, table, lengths, keep.idx,
                            jnp.where(shrink, keep.count, 0), implementation=impl)
    return KVPool(k=k, v=v, pos=pos, page_size=pool.page_size), jnp.where(shrink, keep.count, lengths)


def num_compilations() -> int:
    return compress._cache_size()
