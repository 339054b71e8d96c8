"""jnp twin of the attention-score kernel: probability mass each cached key receives from a query window."""

from __future__ import annotations

import jax
import jax.numpy as jnp

REDUCTIONS = ("max", "mean", "sum")


def _visible(kpos, qpos, sink, window):
    ok = (kpos >= 0) & (kpos <= qpos)
    return ok & ((window == 0) | (kpos > qpos - window) | (kpos < sink))


def attention_scores(q, k_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, lse, *,
                     scale, reduce: str = "mean"):
    """Column sums of softmax per key, never materialising more than one query's row at a time.

    q [T, Hq, D] (the window's queries, contiguous per sequence), lse [T, Hq] float32 from paged
    attention over the same keys; other arguments as in paged attention. Returns scores
    [S, Hkv, max_pages * page_size] float32: for slot i of head h of sequence s, sum over the window's
    queries t of sequence s of softmax_t(i), reduced over the GQA group with max/mean/sum. Slots past
    the head's length or never visible score 0.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    t, hq, d = q.shape
    s, hkv, mp = page_table.shape
    p = k_pages.shape[1]
    g = hq // hkv
    slots = jnp.arange(mp * p)
    pages = jnp.maximum(page_table, 0)[:, :, slots // p]                # [S, Hkv, L]
    kpos = jnp.where(slots[None, None] < lengths[..., None], slot_pos[pages, slots % p], -1)
    keys = k_pages[pages, slots % p].astype(jnp.float32)              # [S, Hkv, L, D]

    def one(carry, args):
        qt, st, pt, lt = args                                         # [Hq, D], (), (), [Hq]
        sc = jnp.clip(st, 0, s - 1)
        logits = jnp.einsum("hgd,hld->hgl", qt.reshape(hkv, g, d).astype(jnp.float32), keys[sc],
                            precision=jax.lax.Precision.HIGHEST) * scale
        vis = _visible(kpos[sc], pt, sink[:, None], window[:, None])[:, None, :] & (st >= 0)
        prob = jnp.where(vis, jnp.exp(logits - lt.reshape(hkv, g)[..., None]), 0.0)
        return carry.at[sc].add(prob), None

    acc = jnp.zeros((s, hkv, g, mp * p), jnp.float32)
    acc, _ = jax.lax.scan(one, acc, (q, q_seq, q_pos, lse.astype(jnp.float32)))
    return {"max": jnp.max, "mean": jnp.mean, "sum": jnp.sum}[reduce](acc, axis=2)
