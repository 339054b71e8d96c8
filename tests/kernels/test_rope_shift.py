"""RoPE shift + page copy against an independent float64 rotation, all styles and frequency kinds."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rope_shift.api import rope_inv_freq, rope_shift

SCALINGS = [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}]


def _rope64(x, pos, inv, style):
    ang = pos[..., None] * inv.astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    if style == "neox":
        h = x.shape[-1] // 2
        return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
    return out


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "llama3", "yarn"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_rope_shift_moves_keys_to_new_positions(implementation, style, scaling, dtype):
    rng = np.random.default_rng(1)
    n, p, d = 12, 4, 16
    inv = rope_inv_freq(d, 10000.0, scaling)
    raw = rng.standard_normal((n, p, d))
    pos = rng.integers(0, 300, (n, p)).astype(np.int32)
    pos[1, 2:] = -1                                           # empty slots stay empty
    k = _rope64(raw, pos.astype(np.float64), inv, style)      # stored after RoPE at original positions
    v = rng.standard_normal((n, p, d))
    src = np.array([0, 1, -1, 2, 3], np.int32)
    dst = np.array([6, 7, 8, 9, 10], np.int32)
    delta = np.array([5, -3, 7, 1000, 0], np.int32)
    kq, vq = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    k_in, v_in = np.asarray(kq.astype(jnp.float32)), np.asarray(vq.astype(jnp.float32))  # pools are donated
    k_out, v_out, p_out = rope_shift(kq, vq, jnp.asarray(pos), jnp.asarray(src), jnp.asarray(dst),
                                     jnp.asarray(delta), jnp.asarray(inv), style=style,
                                     implementation=implementation)
    k_out, v_out, p_out = (np.asarray(x.astype(jnp.float32)) if x.dtype != np.int32 else np.asarray(x)
                           for x in (k_out, v_out, p_out))
    tol = 1e-5 if dtype == np.float32 else 2e-2
    for s, t, dl in zip(src, dst, delta, strict=True):
        if s < 0:
            np.testing.assert_array_equal(k_out[t], k_in[t])      # padding entry writes nothing
            continue
        expect_pos = np.where(pos[s] >= 0, pos[s] + dl, -1)
        np.testing.assert_array_equal(p_out[t], expect_pos)
        np.testing.assert_array_equal(v_out[t], v_in[s])
        want = _rope64(raw[s], (pos[s] + dl).astype(np.float64), inv, style)
        used = pos[s] >= 0                                        # empty slots hold no key
        np.testing.assert_allclose(k_out[t][used], want[used], atol=tol * 4, rtol=tol)
    np.testing.assert_array_equal(k_out[:6], k_in[:6])            # sources untouched
