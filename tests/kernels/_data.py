"""Random ragged paged-cache inputs shared by the kernel tests (and their shapes by the benchmark)."""

from __future__ import annotations

import numpy as np


def random_paged_case(rng: np.random.Generator, *, num_seqs=3, num_kv_heads=2, group=2, head_dim=16,
                      page_size=4, max_pages=6, q_lens=(1, 3, 0), ring=False, dtype=np.float32):
    """A random pool + per-(seq, head) page lists with ragged lengths (incl. empty and one-token heads).

    Each head's slot i holds position i (ordered) or, with `ring=True`, a rotated ring of recent positions.
    Queries of sequence s sit at the last q_lens[s] positions of its longest head (causal, contiguous).
    Returns a dict with the contract's arguments (numpy) plus `num_pages`.
    """
    s, hkv, p = num_seqs, num_kv_heads, page_size
    cap = max_pages * p
    lengths = rng.integers(0, cap + 1, size=(s, hkv)).astype(np.int32)
    lengths[0, 0] = 0                      # empty head
    if hkv > 1:
        lengths[0, 1] = 1                  # one-token head
    num_pages = int(np.sum((lengths + p - 1) // p)) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    page_table = -np.ones((s, hkv, max_pages), np.int32)
    slot_pos = -np.ones((num_pages, p), np.int32)
    nxt = 0
    seq_len = np.maximum(lengths.max(axis=1), np.asarray(q_lens[:s]))   # positions of the sequence
    for i in range(s):
        for h in range(hkv):
            npg = (lengths[i, h] + p - 1) // p
            pages = perm[nxt:nxt + npg]
            nxt += npg
            page_table[i, h, :npg] = pages
            n = lengths[i, h]
            if ring and n > 0:
                # keep the most recent n positions of the sequence, stored rotated (ring order)
                pos = np.arange(seq_len[i] - n, seq_len[i])
                pos = np.roll(pos, rng.integers(0, n))
            else:
                pos = np.arange(n)
            flat = -np.ones(npg * p, np.int32)
            flat[:n] = pos
            slot_pos[pages] = flat.reshape(npg, p)
    k_pages = rng.standard_normal((num_pages, p, head_dim)).astype(dtype)
    v_pages = rng.standard_normal((num_pages, p, head_dim)).astype(dtype)
    q_seq, q_pos = [], []
    for i in range(s):
        for j in range(q_lens[i]):
            q_seq.append(i)
            q_pos.append(seq_len[i] - q_lens[i] + j)
    q_seq += [-1, -1]                      # padding tokens
    q_pos += [0, 0]
    t = len(q_seq)
    q = rng.standard_normal((t, hkv * group, head_dim)).astype(dtype)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, slot_pos=slot_pos, page_table=page_table,
                lengths=lengths, q_seq=np.asarray(q_seq, np.int32), q_pos=np.asarray(q_pos, np.int32),
                num_pages=num_pages)


def visible(kpos, qpos, sink, window):
    ok = (kpos >= 0) & (kpos <= qpos)
    if window > 0:
        ok &= (kpos > qpos - window) | (kpos < sink)
    return ok


def oracle_attention(c, sink, window, scale):
    """Independent float64 numpy oracle of the contract (docs/architecture.md); `c["slot_bias"]` (optional)
    is added to each slot's logit."""
    q = c["q"].astype(np.float64)
    t, hq, d = q.shape
    s, hkv, _ = c["page_table"].shape
    g = hq // hkv
    p = c["k_pages"].shape[1]
    out = np.zeros((t, hq, d))
    lse = np.full((t, hq), -np.inf)
    for ti in range(t):
        si = c["q_seq"][ti]
        if si < 0:
            continue
        for qh in range(hq):
            h = qh // g
            n = c["lengths"][si, h]
            idx = np.arange(n)
            pages = c["page_table"][si, h, idx // p]
            kpos = c["slot_pos"][pages, idx % p]
            ok = visible(kpos, c["q_pos"][ti], sink[h], window[h])
            if not ok.any():
                continue
            k = c["k_pages"][pages, idx % p].astype(np.float64)[ok]
            v = c["v_pages"][pages, idx % p].astype(np.float64)[ok]
            logits = k @ q[ti, qh] * scale
            if c.get("slot_bias") is not None:
                logits = logits + c["slot_bias"][pages, idx % p].astype(np.float64)[ok]
            mx = logits.max()
            w = np.exp(logits - mx)
            out[ti, qh] = w @ v / w.sum()
            lse[ti, qh] = mx + np.log(w.sum())
    return out, lse


def random_rewrite_case(rng, s=2, layers=2, h=2, mp=5, p=4, d=8, maxsel=12):
    """Random per-(seq, layer, head) page lists with sorted unique selections (incl. empty heads)."""
    u = s * layers * h
    n = u * mp + 2
    perm = rng.permutation(n)[: u * mp].reshape(s, layers, h, mp).astype(np.int32)
    lengths = rng.integers(0, mp * p + 1, (s, layers, h)).astype(np.int32)
    lengths.flat[0], lengths.flat[1] = 0, 1                  # empty and one-token heads
    pt = np.where(np.arange(mp) < ((lengths + p - 1) // p)[..., None], perm, -1).astype(np.int32)
    cnt = np.minimum(rng.integers(0, maxsel + 1, (s, layers, h)), lengths).astype(np.int32)
    cnt.flat[1] = 1
    sel = np.zeros((s, layers, h, maxsel), np.int32)
    for i in np.ndindex(s, layers, h):
        sel[i][: cnt[i]] = np.sort(rng.choice(lengths[i], cnt[i], replace=False))
    k = rng.standard_normal((n, p, d)).astype(np.float32)
    v = rng.standard_normal((n, p, d)).astype(np.float32)
    pos = rng.integers(0, 100, (n, p)).astype(np.int32)
    return k, v, pos, pt, lengths, sel, cnt
