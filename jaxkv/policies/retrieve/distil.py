"""The target's attention as the retrieval head's teacher, and the distillation loss.

`teacher_attention` runs the target over one sequence (dense causal attention in query blocks, so 8K+
tokens fit in a few hundred MB) and returns the residual streams the head reads (its keys'
after ``key_layer`` layers, its query's after ``tap_layer``) plus every later layer's attention
probabilities at chosen query positions. Used by `python -m tools.distil_retrieval_head` (targets).

Loss (docs/specontext.md): the pruned head has no LM head, so Eq. 2's KL(P_T || P_S) is applied to what
it does produce, its attention distribution: per query head g and query t, the target distribution is
the target's attention of head g averaged over layers tap_layer..L-1 (the layers the shared selection
serves), and the loss is the cross-entropy against the head's softmax (KL up to the target's entropy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.models import llama, rope
from jaxkv.policies.retrieve.specontext import RetrievalHead, head_keys, head_logits, head_query, own_key_lag

_BLOCK = 1024  # query block of the teacher's dense attention


def _blocked_causal_attention(q, k, v, block: int):
    """q [1, T, Hq, D], k/v [1, T, Hkv, D] -> out [1, T, Hq, D]; causal, fp32 softmax, `block` queries at a
    time (T a multiple of block, or smaller than it)."""
    _, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    b = min(block, t)
    qb = q[0].reshape(t // b, b, hkv, g, d)
    kf, vf = k[0].astype(jnp.float32), v[0].astype(jnp.float32)

    def one(args):
        i, qq = args
        s = jnp.einsum("qhgd,khd->hgqk", qq.astype(jnp.float32), kf, precision=jax.lax.Precision.HIGHEST)
        qpos = i * b + jnp.arange(b)
        s = jnp.where(jnp.arange(t)[None, :] <= qpos[:, None], s * d ** -0.5, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("hgqk,khd->qhgd", p, vf, precision=jax.lax.Precision.HIGHEST)

    out = jax.lax.map(one, (jnp.arange(t // b), qb))
    return out.reshape(1, t, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "tap_layer", "mean", "key_layer"))
def teacher_attention(params, cfg, tokens, qidx, *, tap_layer: int, mean: bool, key_layer: int | None = None):
    """tokens [1, T] (positions 0..T-1), qidx [Q] query positions ->
    (x_key [T, hidden], x_query [Q, hidden], probs), streams float32: x_key the residual stream after
    ``key_layer`` layers (default ``tap_layer``) at every position, x_query the stream after ``tap_layer``
    layers at the query positions; probs [L - tap_layer, Hq, Q, T] float32, or their mean over layers
    [Hq, Q, T] with ``mean=True``. Rows of probs are each query's softmax over keys 0..qidx."""
    key_layer = tap_layer if key_layer is None else key_layer
    t = tokens.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    freqs = rope.inv_freq(cfg)
    vis = jnp.arange(t)[None, :] <= qidx[:, None]  # [Q, T]

    def attend(layer, q, k, v, acc):
        out = _blocked_causal_attention(q, k, v, _BLOCK)
        if layer < tap_layer:
            return out, acc
        g = cfg.num_heads // cfg.num_kv_heads
        kr = jnp.repeat(k[0].astype(jnp.float32), g, axis=1)  # [T, Hq, D]
        s = jnp.einsum("qhd,khd->hqk", q[0, qidx].astype(jnp.float32), kr,
                       precision=jax.lax.Precision.HIGHEST) * cfg.head_dim ** -0.5
        p = jax.nn.softmax(jnp.where(vis[None], s, -jnp.inf), axis=-1)
        acc = acc + p if mean else acc.at[layer - tap_layer].set(p)
        return out, acc

    shape = (cfg.num_heads, qidx.shape[0], t)
    acc = jnp.zeros(shape if mean else (cfg.num_layers - tap_layer, *shape), jnp.float32)
    x = params["embed"][tokens]
    streams = {}
    for i, p in enumerate(llama.layer_list(params)):
        streams[i] = x
        x, acc = llama.decoder_layer(p, cfg, i, x, positions, freqs, attend, acc)
    if mean:
        acc = acc / (cfg.num_layers - tap_layer)
    x_key = streams[key_layer][0].astype(jnp.float32)
    return x_key, streams[tap_layer][0, qidx].astype(jnp.float32), acc


def head_log_probs(head: RetrievalHead, x, qidx, xq=None) -> jax.Array:
    """x [S, T, hidden] (the key stream), qidx [S, Q], xq [S, Q, hidden] (the query stream at qidx; default
    x's, for a head whose query and keys read one stream) -> log-softmax of the head's attention
    [S, Hq, Q, T] (causal). A lagged head's query also reads x at qidx - 1 (teacher forcing)."""
    s, t, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    take = functools.partial(jnp.take_along_axis, axis=1)
    if xq is None:
        if head.config.lagged:
            raise ValueError("a lagged head's distillation needs the query stream (xq)")
        xq = take(x, qidx[:, :, None])
    prev = take(x, jnp.maximum(qidx - 1, 0)[:, :, None]) if head.config.lagged else None
    qq = head_query(head, xq, qidx, prev)  # [S, Q, Hq, Dr]
    k = head_keys(head, x, positions)
    logits = head_logits(head, qq, k)  # [S, Hkv, G, Q, T]
    logits = logits.reshape(s, head.config.num_heads, *logits.shape[3:])
    vis = jnp.arange(t)[None, None, :] <= qidx[:, :, None] - own_key_lag(head)  # [S, Q, T]
    return jax.nn.log_softmax(jnp.where(vis[:, None], logits, -jnp.inf), axis=-1)


def sharpen(target, power: float):
    """Rows of target [..., T] raised to `power` and renormalised: power > 1 moves the teacher's mass onto
    its peaks (the few keys a retrieval step needs) and away from the diffuse bulk."""
    if power == 1.0:
        return target
    t = jnp.where(target > 0, target, 0.0) ** power
    return t / jnp.maximum(jnp.sum(t, axis=-1, keepdims=True), 1e-30)


def distil_loss(head: RetrievalHead, x, qidx, target, *, xq=None, power: float = 1.0, top_k: int = 0,
                top_weight: float = 0.0) -> jax.Array:
    """Mean over (row, query head, query) of the cross-entropy -sum_t target' * log p_head, target' =
    `sharpen(target, power)` (target [S, Hq, Q, T], rows summing to 1 over visible keys).

    With ``top_weight > 0`` it adds ``top_weight x -log p_head(teacher's top_k keys)``: the head is asked to
    put its mass on the keys the teacher ranks first, which is what a top-B selection reads. The plain KL
    spends the head's capacity on the diffuse bulk of the attention, and a head with a low KL can still
    rank the one key a step needs below B (docs/specontext.md, "Oracle selections")."""
    logp = head_log_probs(head, x, qidx, xq)
    if own_key_lag(head):  # the query's own key is not scored (served the same way): its mass is dropped
        own = jnp.arange(target.shape[-1])[None, None, None, :] == qidx[:, None, :, None]
        target = jnp.where(own, 0.0, target)
        target = target / jnp.maximum(jnp.sum(target, axis=-1, keepdims=True), 1e-30)
    t = sharpen(target, power)
    loss = -jnp.mean(jnp.sum(jnp.where(t > 0, t * logp, 0.0), axis=-1))
    if top_weight > 0 and top_k > 0:
        val, idx = jax.lax.top_k(target, top_k)
        lp = jnp.where(val > 0, jnp.take_along_axis(logp, idx, axis=-1), -jnp.inf)
        loss = loss - top_weight * jnp.mean(jax.nn.logsumexp(lp, axis=-1))
    return loss
