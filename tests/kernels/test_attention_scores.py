"""Attention scores: per-key probability mass with GQA reductions, against a float64 oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention_scores.api import attention_scores
from tests.kernels._data import oracle_attention, random_paged_case, visible

ARGS = ("q", "k_pages", "slot_pos", "page_table", "lengths", "q_seq", "q_pos")


def _oracle(c, sink, window, scale, lse, reduce):
    s, hkv, mp = c["page_table"].shape
    p = c["k_pages"].shape[1]
    hq = c["q"].shape[1]
    g = hq // hkv
    acc = np.zeros((s, hkv, g, mp * p))
    for t, si in enumerate(c["q_seq"]):
        if si < 0:
            continue
        for qh in range(hq):
            h = qh // g
            n = c["lengths"][si, h]
            idx = np.arange(n)
            pages = c["page_table"][si, h, idx // p]
            kpos = c["slot_pos"][pages, idx % p]
            ok = visible(kpos, c["q_pos"][t], sink[h], window[h])
            logit = c["k_pages"][pages, idx % p].astype(np.float64) @ c["q"][t, qh].astype(np.float64) * scale
            acc[si, h, qh % g, :n] += np.where(ok, np.exp(logit - lse[t, qh]), 0)
    return {"max": acc.max(2), "mean": acc.mean(2), "sum": acc.sum(2)}[reduce]


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("reduce", ["max", "mean", "sum"])
def test_attention_scores_match_oracle(implementation, reduce):
    rng = np.random.default_rng(5)
    c = random_paged_case(rng, q_lens=(3, 0, 18), max_pages=5)
    sink, window = np.array([0, 2], np.int32), np.array([0, 5], np.int32)
    _, lse = oracle_attention(c, sink, window, 0.3)
    want = _oracle(c, sink, window, 0.3, lse, reduce)
    got = attention_scores(*[jnp.asarray(c[a]) for a in ARGS], jnp.asarray(sink), jnp.asarray(window),
                           jnp.asarray(lse, jnp.float32), scale=0.3, reduce=reduce,
                           implementation=implementation, pages_per_block=2)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
    if reduce == "sum":     # every query's probability mass sums to 1 over the keys it sees
        n_q = np.array([(c["q_seq"] == s).sum() for s in range(3)])
        g = c["q"].shape[1] // 2
        seen = np.isfinite(lse).reshape(lse.shape[0], 2, g)
        for s in range(3):
            for h in range(2):
                expect = seen[c["q_seq"] == s, h].sum()
                np.testing.assert_allclose(np.asarray(got)[s, h].sum(), expect, rtol=1e-4)
        assert n_q.sum() > 0
