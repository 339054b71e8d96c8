"""jnp twin of the static block-table rewrite (per-head compaction after a policy selects tokens)."""

from __future__ import annotations

import jax.numpy as jnp


def release_and_tables(page_table, lengths, sel_count, page_size: int):
    """New page table (pages past the compacted length -> -1), pages to release, new lengths."""
    j = jnp.arange(page_table.shape[-1])
    keep = (sel_count + page_size - 1) // page_size
    used = (lengths + page_size - 1) // page_size
    new_table = jnp.where(j < keep[..., None], page_table, -1)
    release = jnp.where((j >= keep[..., None]) & (j < used[..., None]), page_table, -1)
    return new_table, release, sel_count.astype(lengths.dtype)


def rewrite(k_pages, v_pages, slot_pos, page_table, lengths, sel_idx, sel_count):
    """Compact each head's selected slots into its first pages.

    k_pages, v_pages [N, P, D]; slot_pos [N, P] int32; page_table [S, L, Hkv, MP]; lengths [S, L, Hkv];
    sel_idx [S, L, Hkv, MAXSEL] int32 indices into the head's slot list (first sel_count valid,
    ascending and unique, each < lengths); sel_count [S, L, Hkv] <= MAXSEL.
    Slot m < count of the head receives K, V and position of its slot sel_idx[m]; the tail of its last
    kept page gets position -1. Returns (k_pages, v_pages, slot_pos, page_table, lengths, release) where
    release [S, L, Hkv, MP] lists the head's pages past the compacted length (-1 elsewhere).
    """
    n, p, d = k_pages.shape
    mp = page_table.shape[-1]
    maxsel = sel_idx.shape[-1]
    pt = jnp.maximum(page_table, 0).reshape(-1, mp)                         # [U, MP]
    cnt = sel_count.reshape(-1)
    sel = jnp.clip(sel_idx.reshape(-1, maxsel), 0, mp * p - 1)
    u = pt.shape[0]
    hi = (cnt + p - 1) // p * p                                             # slots of the kept pages

    def slot_of(idx):                                                       # head slot index -> flat slot
        return jnp.take_along_axis(pt, jnp.minimum(idx // p, mp - 1), axis=1) * p + idx % p

    m = jnp.broadcast_to(jnp.arange(maxsel), (u, maxsel))
    valid = m < cnt[:, None]
    drop = n * p
    dst_v = jnp.where(valid, slot_of(m), drop).reshape(-1)
    src_v = jnp.where(valid, slot_of(sel), 0).reshape(-1)
    kf, vf, pf = k_pages.reshape(n * p, d), v_pages.reshape(n * p, d), slot_pos.reshape(n * p)
    kf = kf.at[dst_v].set(kf[src_v], mode="drop")                          # gather all, then scatter
    vf = vf.at[dst_v].set(vf[src_v], mode="drop")
    pf_new = pf.at[dst_v].set(pf[src_v], mode="drop")
    width = min(maxsel + p, mp * p)
    m2 = jnp.broadcast_to(jnp.arange(width), (u, width))
    tail = (m2 >= cnt[:, None]) & (m2 < hi[:, None])
    pf_new = pf_new.at[jnp.where(tail, slot_of(m2), drop).reshape(-1)].set(-1, mode="drop")
    new_table, release, new_len = release_and_tables(page_table, lengths, sel_count, p)
    return kf.reshape(n, p, d), vf.reshape(n, p, d), pf_new.reshape(n, p), new_table, new_len, release
