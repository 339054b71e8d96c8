"""Runs a compression policy over some sequences of the paged cache: observe, score, select, rewrite.

The only caller of the policies' device hooks and of the static rewrite. One jitted function per
(model, policy, bucket): the last `window` cached tokens of each sequence re-run through the model reading
the cache (their own K/V are already there, so the hidden states are the prefill's own), each layer's
`policy.score` sees the window's queries against every slot of every head, `counts` + `select` pick the
keep sets, and `rewrite` compacts each compressible head in place on the donated pool. The host then frees
the pages past each head's new length (`HeadPageTables.compact`).

The observation pass computes attention densely over the gathered slots (S x W queries, N slots per head);
it is as exact as the prefill and cheap next to it for W << prompt length.

A policy with `merge=True` folds each evicted token into its most similar kept token (cosine of the
post-RoPE keys) before the rewrite: the kept slot's value becomes the mass-weighted mean of its own and its
merged tokens' values, and its logit bias (`KVPool.bias`) grows by log(total mass / own mass), so the
softmax denominator keeps the evicted tokens' share (docs/policies.md, "LSE-preserving merge").
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
from pallas_kernels.rewrite.reference import rewrite as rewrite_reference


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
    """Keys, values, positions, logit biases of every slot of every head: page_table [S, H, P] ->
    [S, H, P*ps, ...] (bias 0 for a pool without one)."""
    s, h, p = page_table.shape
    ps = pool.page_size
    pages = jnp.maximum(page_table, 0)
    k = pool.k[pages].reshape(s, h, p * ps, -1)
    v = pool.v[pages].reshape(s, h, p * ps, -1)
    pos = jnp.where((page_table >= 0)[..., None], pool.pos[pages], -1).reshape(s, h, p * ps)
    bias = (jnp.zeros((s, h, p * ps), jnp.float32) if pool.bias is None
            else pool.bias[pages].reshape(s, h, p * ps))
    return k, v, pos, bias


def merge_evicted(kc, vc, valid, mass, idx, count, evictable, min_sim: float):
    """One layer's LSE-preserving merge, per (sequence, KV head).

    kc, vc [S, H, N, D] slots; valid [S, H, N]; mass [S, H, N] window-mean attention probability of each
    slot; idx [S, H, K] / count [S, H] the keep set; evictable [S, H] heads being compressed. Every evicted
    slot whose key has cosine >= `min_sim` with some kept key joins the most similar kept slot t:
    v_t <- (m_t v_t + sum m_j v_j) / (m_t + sum m_j) and bias_t += log((m_t + sum m_j) / m_t), capped at
    log(1 + merged count) (a merged token weighs at most what t does). Returns (v_new [S, H, K, D] float32,
    bias_add [S, H, K], merged [S, H, K] how many tokens each kept slot absorbed).
    """
    s, h, n, _ = kc.shape
    kk_n = idx.shape[-1]
    kept_ok = jnp.arange(kk_n) < count[..., None]                                   # [S, H, K]
    idx_c = jnp.clip(idx, 0, n - 1)
    in_keep = jnp.zeros((s, h, n), bool).at[
        jnp.arange(s)[:, None, None], jnp.arange(h)[None, :, None], idx_c].max(kept_ok)
    evict = valid & ~in_keep & evictable[..., None]
    kf = kc.astype(jnp.float32)
    kn = kf * jax.lax.rsqrt(jnp.maximum(jnp.sum(kf * kf, -1, keepdims=True), 1e-30))
    kept_n = jnp.take_along_axis(kn, idx_c[..., None], axis=2)                      # [S, H, K, D]
    sims = jnp.einsum("shnd,shkd->shnk", kn, kept_n, precision=jax.lax.Precision.HIGHEST)
    sims = jnp.where(kept_ok[:, :, None, :], sims, -2.0)
    target = jnp.argmax(sims, axis=-1)                                              # [S, H, N]
    joins = evict & (jnp.max(sims, axis=-1) >= min_sim)
    w = jnp.where(joins, mass, 0.0)
    onehot = (target[..., None] == jnp.arange(kk_n)) & joins[..., None]             # [S, H, N, K]
    hot = onehot.astype(jnp.float32)
    add_mass = jnp.einsum("shnk,shn->shk", hot, w)
    add_v = jnp.einsum("shnk,shnd->shkd", hot, w[..., None] * vc.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    merged = jnp.sum(onehot, axis=2).astype(jnp.int32)
    own_mass = jnp.take_along_axis(mass, idx_c, axis=-1)
    own_v = jnp.take_along_axis(vc, idx_c[..., None], axis=2).astype(jnp.float32)
    total = own_mass + add_mass
    use = kept_ok & (merged > 0) & (total > 0)
    blended = (own_mass[..., None] * own_v + add_v) / jnp.where(use, total, 1.0)[..., None]
    v_new = jnp.where(use[..., None], blended, own_v)
    ratio = jnp.log(jnp.where(use, total, 1.0)) - jnp.log(jnp.maximum(own_mass, 1e-30))
    bias_add = jnp.where(use, jnp.minimum(ratio, jnp.log1p(merged.astype(jnp.float32))), 0.0)
    return v_new, bias_add, jnp.where(kept_ok, merged, 0)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "kmax", "impl", "mesh"),
                   donate_argnames=("pool",))
def compress(params, pool: KVPool, b: dict, heads: dict, *, cfg, policy: CompressPolicy, kmax: int,
             impl: str | None = None, mesh=None):
    """Returns (pool, count [S, L, H]): the compacted pool and each head's new length. `mesh`: tensor
    parallel over KV heads, the pass runs per shard (`jaxkv.parallel.methods.sharded_compress`; `policy` is
    then in placed head order)."""
    if mesh is not None:
        from jaxkv.parallel.methods import sharded_compress

        return sharded_compress(compress_body, params, pool, b, heads, cfg=cfg, policy=policy, kmax=kmax,
                                impl=impl, mesh=mesh)
    return compress_body(params, pool, b, heads, cfg=cfg, policy=policy, kmax=kmax, impl=impl)


def compress_body(params, pool: KVPool, b: dict, heads: dict, *, cfg, policy: CompressPolicy, kmax: int,
                  impl: str | None = None, score=None, reduce=None, counts=None):
    """`compress` on one device or one shard. Per shard (jaxkv.parallel): `score(obs)` is the shard's own
    scoring (per-head policy fields sliced to its heads), `reduce` sums the partial O / down projections,
    `counts(scores, ctx)` the policy's counts over every shard's heads when they depend on each other."""
    score = policy.score if score is None else score
    counts_fn = policy.counts if counts is None else counts
    S, W = b["tokens"].shape
    L, H = cfg.num_layers, cfg.num_kv_heads
    G = cfg.num_heads // H
    scale = cfg.head_dim ** -0.5
    lengths = b["lengths"]

    def attend(layer, q, k_new, v_new, carry):
        del k_new, v_new  # the window's own K/V are already cached
        scores, mass = carry
        kc, vc, kpos, kbias = _gather_head_slots(pool, b["page_table"][:, layer])  # [S, H, N, D], [S, H, N]
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
                            precision=jax.lax.Precision.HIGHEST) * scale + kbias[:, :, None, None, :]
        logits = jnp.where(vis[:, :, None], logits, NEG)
        obs = Observation(q=q.astype(jnp.float32), q_pos=qpos, k=kc, v=vc, k_pos=kpos, logits=logits,
                          layer=layer)
        probs = obs.probs
        out = jnp.einsum("shgwn,shnd->swhgd", probs, vc.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
        scores = scores.at[:, layer].set(score(obs).astype(jnp.float32))
        if policy.merge:  # window-mean attention probability of each slot, over the rows and the GQA group
            rows = jnp.maximum(jnp.sum(qpos >= 0, axis=1), 1).astype(jnp.float32)  # [S]
            mass = mass.at[:, layer].set(jnp.sum(probs, axis=(2, 3)) / (G * rows)[:, None, None])
        return out.reshape(S, W, H * G, -1).astype(q.dtype), (scores, mass)

    n_slots = b["page_table"].shape[-1] * pool.page_size
    scores0 = jnp.zeros((S, L, H, n_slots), jnp.float32)
    mass0 = jnp.zeros((S, L, H, n_slots) if policy.merge else (0,), jnp.float32)
    positions = jnp.maximum(b["positions"], 0)
    layers = params["layers"]
    if isinstance(layers, list | tuple):  # one rolled layer body whatever the engine's layer loop
        params = {**params, "layers": llama.SharedLayers(layers)}
    _, (scores, mass) = llama.forward(params, cfg, b["tokens"], positions, attend, (scores0, mass0),
                                      reduce=reduce, rolled=True)

    # Original positions of every slot, all layers: [S, L, H, N].
    pages = jnp.maximum(b["page_table"], 0)
    slot_pos = jnp.where((b["page_table"] >= 0)[..., None], pool.pos[pages], -1)
    slot_pos = slot_pos.reshape(S, L, H, n_slots)
    slot_pos = jnp.where(jnp.arange(n_slots) < lengths[..., None], slot_pos, -1)
    ctx = SelectContext(lengths=lengths, positions=slot_pos, target=b["target"], recent_from=b["recent_from"],
                        compressible=heads["compressible"], lower=heads["lower"], upper=heads["upper"])
    counts = counts_fn(scores, ctx)
    keep = select(scores, counts, ctx, sink=policy.sink, kmax=kmax)
    shrink = heads["compressible"][None] & (keep.count < lengths)
    if policy.merge:
        pool = _merge_into_pool(pool, b["page_table"], lengths, keep, shrink, mass, policy.merge_sim)
    table = jnp.where(shrink[..., None], b["page_table"], -1)
    counts = jnp.where(shrink, keep.count, 0)
    k, v, pos, *_ = rewrite(pool.k, pool.v, pool.pos, table, lengths, keep.idx, counts, implementation=impl)
    bias = pool.bias
    if bias is not None:  # merged slots carry their bias to their new place (and plain ones their 0)
        bias = rewrite_reference(bias[..., None], bias[..., None], pool.pos, table, lengths, keep.idx,
                                 counts)[0][..., 0]
    return (KVPool(k=k, v=v, pos=pos, page_size=pool.page_size, bias=bias),
            jnp.where(shrink, keep.count, lengths))


def _merge_into_pool(pool: KVPool, page_table, lengths, keep, shrink, mass, min_sim: float) -> KVPool:
    """`merge_evicted` for every layer, written to the kept slots (before the rewrite moves them). The layers
    run under one `lax.fori_loop` (one compiled layer, not L copies: the merge's [H, N, K] cosines are the
    largest temporaries of a compression program), each sequence and KV head under `lax.map` inside it."""
    if pool.bias is None:
        raise ValueError("merge=True needs a pool with a logit bias (Engine(kv_merge=True))")
    L = page_table.shape[1]
    ps = pool.page_size
    n_pages = pool.pos.shape[0]

    def one(args):  # one (sequence, KV head) at a time: the [N, K] cosines of a long width class stay small
        out = merge_evicted(*(a[None, None] for a in args), min_sim)
        return tuple(o[0, 0] for o in out)

    def layer_merge(layer, flat):
        v_flat, b_flat = flat
        table = page_table[:, layer]
        kc, vc, kpos, _ = _gather_head_slots(pool, table)
        s, h, n = kpos.shape
        valid = (kpos >= 0) & (jnp.arange(n) < lengths[:, layer][..., None])
        idx, count = keep.idx[:, layer], keep.count[:, layer]
        rows = (kc, vc, valid, mass[:, layer], idx, count, shrink[:, layer])
        flat_rows = tuple(a.reshape(s * h, *a.shape[2:]) for a in rows)
        v_new, bias_add, merged = (o.reshape(s, h, *o.shape[1:]) for o in jax.lax.map(one, flat_rows))
        idx_c = jnp.clip(idx, 0, n - 1)
        page = jnp.take_along_axis(table, idx_c // ps, axis=-1)  # [S, H, K]
        slot = jnp.where((merged > 0) & (page >= 0), page * ps + idx_c % ps, n_pages * ps).reshape(-1)
        v_flat = v_flat.at[slot].set(v_new.reshape(slot.shape[0], -1).astype(v_flat.dtype), mode="drop")
        b_flat = b_flat.at[slot].add(bias_add.reshape(-1), mode="drop")
        return v_flat, b_flat

    v_flat, b_flat = jax.lax.fori_loop(0, L, layer_merge, (pool.v.reshape(n_pages * ps, -1),
                                                           pool.bias.reshape(n_pages * ps)))
    return KVPool(k=pool.k, v=v_flat.reshape(pool.v.shape), pos=pool.pos, page_size=ps,
                  bias=b_flat.reshape(pool.bias.shape))


def num_compilations() -> int:
    return compress._cache_size()
