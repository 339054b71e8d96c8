"""Our SnapKV / StreamingLLM / AdaKV against an independent numpy transcription of kvpress 0.5.5's formulas.

kvpress itself is not a test dependency (it pins an older transformers); `python -m benchmarks.kvpress` is the
oracle that runs it on the real model. These tests guard the formulas in CI: the transcriptions below follow
kvpress's source line by line (`SnapKVPress.compute_window_attention` + `score`, `ScorerPress.compress`,
`StreamingLLMPress.score`, `AdaKVPress.compress`, `compute_n_kept`) and are fed the same random queries /
keys as our `score` hooks, built into an `Observation` exactly as `jaxkv.policies.apply` builds it.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.policies import SelectContext, get_policy, select
from jaxkv.policies.base import NEG, Observation


# ---- kvpress, transcribed (numpy, one sequence, keys [Hkv, N, D], window queries [Hq, W, D]) -------------
def kv_compute_n_kept(k_len, compression_ratio):
    return 0 if compression_ratio >= 1.0 else max(1, int(k_len * (1 - compression_ratio)))


def kv_snapkv_score(q, k, window_size, kernel_size):
    hq, w, d = q.shape
    hkv, k_len, _ = k.shape
    groups = hq // hkv
    key_states = np.repeat(k, groups, axis=0)  # repeat_kv: query head h * groups + g reads kv head h
    attn = q @ key_states.transpose(0, 2, 1) / math.sqrt(d)
    mask = np.triu(np.full((w, k_len), -np.inf), k=k_len - window_size + 1)
    attn = attn + mask
    attn = np.exp(attn - attn.max(-1, keepdims=True))
    attn = attn / attn.sum(-1, keepdims=True)
    attn = attn[..., :-window_size]
    scores = attn.mean(axis=-2)  # [Hq, k_len - W]
    pad = kernel_size // 2  # F.avg_pool1d(padding=k//2, stride=1), zeros counted (count_include_pad)
    sp = np.pad(scores, ((0, 0), (pad, pad)))
    scores = np.stack([sp[:, i:i + kernel_size].mean(-1) for i in range(k_len - window_size)], -1)
    scores = scores.reshape(hkv, groups, k_len - window_size).mean(1)
    return np.pad(scores, ((0, 0), (0, window_size)), constant_values=scores.max() + 1)


def kv_topk_keep(scores, n_kept):
    """ScorerPress.compress: scores.topk(n_kept) per head -> sorted kept positions."""
    return [np.sort(np.argsort(-s, kind="stable")[:n_kept]) for s in scores]


def kv_streaming_score(hkv, k_len, compression_ratio, n_sink):
    n_pruned = k_len - int(k_len * (1 - compression_ratio))
    scores = np.ones((hkv, k_len))
    scores[:, n_sink:n_sink + n_pruned] = 0
    return scores


def kv_adakv_keep(scores, compression_ratio, alpha_safeguard):
    """AdaKVPress.compress: per-head safeguard, then the layer's bottom-k pruned across heads."""
    scores = scores.copy()
    hkv, k_len = scores.shape
    n_kept = kv_compute_n_kept(k_len, compression_ratio)
    n_safe = int(n_kept * alpha_safeguard)
    if alpha_safeguard > 0:
        n_safe = max(1, n_safe) if n_kept > 0 else 0
    for h in range(hkv):
        scores[h, np.argsort(-scores[h], kind="stable")[:n_safe]] = np.finfo(np.float32).max
    n_pruned = hkv * (k_len - n_kept)
    pruned = np.argsort(scores.reshape(-1), kind="stable")[:n_pruned]
    keep = np.ones(hkv * k_len, bool)
    keep[pruned] = False
    keep = keep.reshape(hkv, k_len)
    return [np.nonzero(keep[h])[0] for h in range(hkv)]


# ---- ours ---------------------------------------------------------------------------------------------
def observation(q, k, n_valid, window):
    """q [S, W, Hq, D] (window queries of each sequence), k [S, Hkv, N, D]; sequence s holds n_valid[s]
    tokens, the window is its last `window` ones. Built as jaxkv.policies.apply.compress builds it."""
    S, W, hq, d = q.shape
    _, hkv, N, _ = k.shape
    G = hq // hkv
    n_valid = np.asarray(n_valid)
    qpos = n_valid[:, None] - window + np.arange(W)[None]  # [S, W]
    kpos = np.where(np.arange(N)[None] < n_valid[:, None], np.arange(N)[None], -1)
    kpos = np.broadcast_to(kpos[:, None], (S, hkv, N)).astype(np.int32)
    vis = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= qpos[:, None, :, None])
    logits = np.einsum("swhgd,shnd->shgwn", q.reshape(S, W, hkv, G, d), k) * d ** -0.5
    logits = np.where(vis[:, :, None], logits, NEG).astype(np.float32)
    return Observation(q=jnp.asarray(q), q_pos=jnp.asarray(qpos, jnp.int32), k=jnp.asarray(k),
                       v=jnp.asarray(k), k_pos=jnp.asarray(kpos), logits=jnp.asarray(logits))


def our_keep(policy, scores, kpos, target, recent_from, kmax):
    """`counts` + the shared `select` for one layer: [S, Hkv, N] scores -> per (s, h) kept positions."""
    S, H, N = scores.shape
    ctx = SelectContext(lengths=jnp.asarray((kpos >= 0).sum(-1)[:, None], jnp.int32),
                        positions=jnp.asarray(kpos[:, None], jnp.int32),
                        target=jnp.asarray(target, jnp.int32),
                        recent_from=jnp.asarray(recent_from, jnp.int32),
                        compressible=jnp.ones((1, H), bool), lower=jnp.zeros((1, H), jnp.int32),
                        upper=jnp.zeros((1, H), jnp.int32))
    s = jnp.asarray(scores)[:, None]
    keep = select(s, policy.counts(s, ctx), ctx, sink=policy.sink, kmax=kmax)
    idx, cnt = np.asarray(keep.idx), np.asarray(keep.count)
    return [[np.sort(kpos[b, h][idx[b, 0, h, :cnt[b, 0, h]]]) for h in range(H)] for b in range(S)]


def random_case(seed, lengths=(200, 173), window=16, hq=8, hkv=4, d=16):
    rng = np.random.default_rng(seed)
    N = max(lengths)
    k = rng.normal(size=(len(lengths), hkv, N, d)).astype(np.float32)
    # Queries correlated with a few keys so the attention is peaked, as in a real model.
    q = rng.normal(size=(len(lengths), window, hq, d)).astype(np.float32)
    for s, n in enumerate(lengths):
        hot = rng.integers(0, n, size=(hq,))
        q[s] += 1.5 * np.repeat(k[s], hq // hkv, axis=0)[np.arange(hq), hot][None]
    return q, k, np.asarray(lengths)


@pytest.mark.parametrize("seed,kernel,window", [(0, 5, 16), (1, 7, 16), (2, 3, 8), (3, 1, 16)])
def test_snapkv_score_is_kvpress_score(seed, kernel, window):
    q, k, lengths = random_case(seed, window=window)
    pol = get_policy("snapkv", window=window, kernel=kernel, pooling="avg", sink=0)
    ours = np.asarray(pol.score(observation(q, k, lengths, window)))
    for s, n in enumerate(lengths):
        qs = q[s].transpose(1, 0, 2)  # [Hq, W, D]
        theirs = kv_snapkv_score(qs.astype(np.float64), k[s, :, :n].astype(np.float64), window, kernel)
        np.testing.assert_allclose(ours[s, :, :n - window], theirs[:, :n - window], rtol=2e-5, atol=1e-8)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.125])
def test_snapkv_keeps_kvpress_set(budget):
    window, kernel = 16, 5
    q, k, lengths = random_case(10, lengths=(256, 231), window=window)
    obs = observation(q, k, lengths, window)
    kpos = np.asarray(obs.k_pos)
    for s, n in enumerate(lengths):
        n_kept = kv_compute_n_kept(n, 1 - budget)
        pol = get_policy("snapkv", budget=n_kept, window=window, kernel=kernel, pooling="avg", sink=0)
        ours = our_keep(pol, np.asarray(pol.score(obs)), kpos, [n_kept] * 2, lengths - window, 256)[s]
        theirs = kv_topk_keep(kv_snapkv_score(q[s].transpose(1, 0, 2).astype(np.float64),
                                              k[s, :, :n].astype(np.float64), window, kernel), n_kept)
        for o, t in zip(ours, theirs):
            np.testing.assert_array_equal(o, t)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.125])
def test_streaming_llm_keeps_kvpress_set(budget):
    q, k, lengths = random_case(20, lengths=(200, 187), window=8)
    obs = observation(q, k, lengths, 8)
    kpos = np.asarray(obs.k_pos)
    for s, n in enumerate(lengths):
        n_kept = kv_compute_n_kept(n, 1 - budget)
        pol = get_policy("streaming_llm", budget=n_kept, sink=4, window=8)
        ours = our_keep(pol, np.asarray(pol.score(obs)), kpos, [n_kept] * 2, lengths - 8, 256)[s]
        theirs = kv_topk_keep(kv_streaming_score(k.shape[1], n, 1 - budget, 4), n_kept)
        for o, t in zip(ours, theirs):
            np.testing.assert_array_equal(o, t)


@pytest.mark.parametrize("budget", [0.5, 0.25])
def test_adakv_without_safeguard_keeps_kvpress_set(budget):
    """alpha = 0: both are the plain flattened top-k over the layer's heads (window always kept). With
    alpha > 0 they differ by design: kvpress's safeguard is alpha * (its whole per-head budget, window
    included, and the window ranks first), ours and the AdaKV reference code's is alpha * (budget - window)
    of non-window tokens; see docs/eval.md, "kvpress peer oracle"."""
    window, kernel = 16, 5
    q, k, lengths = random_case(30, lengths=(256, 256), window=window)
    obs = observation(q, k, lengths, window)
    kpos = np.asarray(obs.k_pos)
    n = 256
    n_kept = kv_compute_n_kept(n, 1 - budget)
    pol = get_policy("adakv", budget=n_kept, window=window, kernel=kernel, pooling="avg", sink=0, alpha=0.0)
    ours = our_keep(pol, np.asarray(pol.score(obs)), kpos, [n_kept] * 2, lengths - window, 256)
    for s in range(2):
        sc = kv_snapkv_score(q[s].transpose(1, 0, 2).astype(np.float64), k[s].astype(np.float64), window,
                             kernel).astype(np.float32)
        theirs = kv_adakv_keep(sc, 1 - budget, 0.0)
        assert sum(map(len, ours[s])) == sum(map(len, theirs)) == k.shape[1] * n_kept
        for o, t in zip(ours[s], theirs):
            np.testing.assert_array_equal(o, t)
