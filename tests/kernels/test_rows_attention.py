"""Scattered-row attention: the split (prefix chunks + paged diagonal + LSE merge) equals the twin."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rows_attention import rows_attention
from pallas_kernels.rows_attention.api import chunk_starts
from pallas_kernels.rows_attention.prefix import stats_rows
from pallas_kernels.rows_attention.reference import rows_attention as twin


def _case(seed, t, positions, hq=4, hkv=2, d=16, pad=0, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    r = len(positions) + pad
    q = jax.random.normal(k1, (r, hq, d), dtype)
    k = jax.random.normal(k2, (t, hkv, d), dtype)
    v = jax.random.normal(k3, (t, hkv, d), dtype)
    q_pos = jnp.asarray(list(positions) + [-1] * pad, jnp.int32)
    return q, k, v, q_pos


def _dense_numpy(q, k, v, q_pos, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    r, hq, d = q.shape
    g = hq // k.shape[1]
    out = np.zeros((r, hq, d))
    for i, p in enumerate(np.asarray(q_pos)):
        if p < 0:
            continue
        for h in range(hq):
            s = k[: p + 1, h // g] @ q[i, h] * scale
            w = np.exp(s - s.max())
            out[i, h] = w @ v[: p + 1, h // g] / w.sum()
    return out


LAYOUTS = {
    "dense": list(range(0, 70)),                                    # every token: the diagonal is all
    "sparse": sorted(np.random.default_rng(1).choice(300, 45, replace=False).tolist()),
    "clustered": list(range(3, 9)) + list(range(150, 170)) + [299],  # chunks spanning a long gap
    "from_zero_with_tail": [0, 1, 2] + list(range(280, 300)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("diagonal_impl", ["reference", "pallas"])
def test_split_equals_twin_and_numpy(layout, diagonal_impl):
    pos = LAYOUTS[layout]
    t = 300
    q, k, v, q_pos = _case(0, t, pos, pad=5)
    scale = 0.25
    ref_out, ref_lse = twin(q, k, v, q_pos, scale=scale)
    out, lse = rows_attention(q, k, v, q_pos, scale=scale, implementation="split", chunk=8, page=4,
                              prefix_impl="reference", diagonal_impl=diagonal_impl)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[: len(pos)], np.asarray(ref_lse)[: len(pos)], atol=2e-5)
    np.testing.assert_allclose(np.asarray(ref_out), _dense_numpy(q, k, v, q_pos, scale), atol=2e-5)
    assert np.all(np.asarray(out)[len(pos):] == 0) and np.all(np.isneginf(np.asarray(lse)[len(pos):]))


def test_split_bf16_matches_twin():
    pos = LAYOUTS["sparse"]
    q, k, v, q_pos = _case(3, 300, pos, dtype=jnp.bfloat16)
    ref, _ = twin(q, k, v, q_pos, scale=0.25)
    out, _ = rows_attention(q, k, v, q_pos, scale=0.25, implementation="split", chunk=16, page=8,
                            prefix_impl="reference", diagonal_impl="pallas")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2)


def test_chunk_starts_round_down_to_the_page_and_skip_padding():
    q_pos = jnp.asarray([5, 9, 17, 40, 41, -1, -1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(chunk_starts(q_pos, 2, 4)), [4, 16, 40, 0])


def test_stats_rows_reads_each_segments_rows_from_its_start():
    """cuDNN's packed stats [segments, heads, packed rows]: segment j's row i at [j, :, i], -inf after."""
    nc, c, hq = 3, 2, 4
    stats = np.full((nc, hq, nc * c), -np.inf, np.float32)
    want = np.random.default_rng(0).standard_normal((nc, c, hq)).astype(np.float32)
    for j in range(nc):
        stats[j, :, :c] = want[j].T
    np.testing.assert_array_equal(np.asarray(stats_rows(jnp.asarray(stats), nc, c)), want)


def test_bad_shapes_are_refused():
    q, k, v, q_pos = _case(0, 50, [1, 2, 3])
    with pytest.raises(ValueError, match="q_pos"):
        rows_attention(q, k, v, q_pos[:2], scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        rows_attention(q[:, :3], k, v, q_pos, scale=1.0)
    with pytest.raises(ValueError, match="implementation"):
        rows_attention(q, k, v, q_pos, scale=1.0, implementation="cuda")
