"""Pure-jnp reference twin of the head-class prefill op (the spec every implementation is tested against).

One fresh sequence: q [T, Hq, D], k/v [T, Hkv, D] at positions 0..T-1, causal. KV head h is global when
``window[h] == 0``; otherwise query position p sees key position k iff ``k <= p`` and (``k > p - window[h]``
or ``k < sink[h]``) -- the visibility of the paged contract, `visible_mask` of
pallas_kernels/paged_attention/reference.py, used here verbatim. GQA: query head j reads KV head j // G.

Written to be obviously correct, not fast: a dense masked softmax in fp32 over all T keys for every head,
mapped over chunks of queries so the [C, Hq, T] logits stay bounded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import visible_mask

# Upper bound on the elements of one chunk's [C, Hq, T] logits.
_MAX_LOGIT_ELEMS = 1 << 24


def head_class_prefill(q, k, v, sink, window, *, scale, global_impl=None, local_impl=None, interpret=None):
    """Dense masked twin -> (out [T, Hq, D] q.dtype, lse [T, Hq] float32, natural log).

    sink, window: per-KV-head ints (length Hkv; 0 window = global head). `global_impl`, `local_impl` and
    `interpret` are accepted for signature parity with api.head_class_prefill and ignored.
    """
    del global_impl, local_impl, interpret
    t, hq, d = q.shape
    hkv = k.shape[1]
    if len(sink) != hkv or len(window) != hkv:
        raise ValueError(f"sink/window must have one entry per KV head ({hkv}), "
                         f"got {len(sink)}/{len(window)}")
    if hq % hkv:
        raise ValueError(f"num query heads {hq} is not a multiple of num KV heads {hkv}")
    g = hq // hkv
    if t == 0:
        return jnp.zeros((0, hq, d), q.dtype), jnp.zeros((0, hq), jnp.float32)
    sink_a = jnp.asarray(sink, jnp.int32)
    window_a = jnp.asarray(window, jnp.int32)
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (hkv, t))      # [Hkv, T]
    valid = jnp.ones((hkv, t), bool)

    c = max(1, min(t, _MAX_LOGIT_ELEMS // max(1, hq * t)))
    n = -(-t // c)
    tp = n * c
    qc = jnp.pad(q, ((0, tp - t), (0, 0), (0, 0))).reshape(n, c, hkv, g, d)
    pc = jnp.arange(tp, dtype=jnp.int32).reshape(n, c)

    def chunk(args):
        qq, pos = args                                                  # [C, Hkv, G, D], [C]
        logits = jnp.einsum("chgd,hjd->chgj", qq.astype(jnp.float32), kf.transpose(1, 0, 2),
                            precision=jax.lax.Precision.HIGHEST) * scale
        vis = visible_mask(kpos, valid, pos, sink_a, window_a)[:, :, None, :]   # [C, Hkv, 1, T]
        logits = jnp.where(vis, logits, -jnp.inf)
        m = jnp.max(logits, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.where(vis, jnp.exp(logits - m_safe), 0.0)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        o = jnp.einsum("chgj,hjd->chgd", e, vf.transpose(1, 0, 2), precision=jax.lax.Precision.HIGHEST)
        o = o / jnp.where(denom > 0, denom, 1.0)
        den = denom[..., 0]
        lse = jnp.where(den > 0, m_safe[..., 0] + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
        return o.reshape(c, hq, d).astype(q.dtype), lse.reshape(c, hq)

    out, lse = jax.lax.map(chunk, (qc, pc))
    return out.reshape(tp, hq, d)[:t], lse.reshape(tp, hq)[:t]
