"""LSE merge: splitting keys into parts and merging equals attention over all keys."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lse_merge.api import lse_merge


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_lse_merge_equals_full_softmax(implementation, dtype):
    rng = np.random.default_rng(0)
    k, m, n, d = 3, 37, 12, 8
    logits = rng.standard_normal((m, n)) * 3
    v = rng.standard_normal((n, d))
    part = rng.integers(0, k, size=n)
    part[:4] = 0                                    # part 2 may be empty for some rows below
    visible = rng.random((m, n)) < 0.7
    visible[0] = False                              # a row nobody sees
    outs, lses = np.zeros((k, m, d)), np.full((k, m), -np.inf)
    for i in range(k):
        sel = visible & (part == i)[None]
        w = np.where(sel, np.exp(logits), 0)
        tot = w.sum(1)
        outs[i] = np.where(tot[:, None] > 0, w @ v / np.maximum(tot, 1e-300)[:, None], 0)
        lses[i] = np.where(tot > 0, np.log(np.maximum(tot, 1e-300)), -np.inf)
    w = np.where(visible, np.exp(logits), 0)
    ref = np.where(w.sum(1, keepdims=True) > 0, w @ v / np.maximum(w.sum(1, keepdims=True), 1e-300), 0)
    out, lse = lse_merge(jnp.asarray(outs, dtype), jnp.asarray(lses, jnp.float32),
                         implementation=implementation)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=tol)
    assert np.isneginf(np.asarray(lse)[0]) and np.all(np.asarray(out.astype(jnp.float32))[0] == 0)
    np.testing.assert_allclose(np.asarray(lse)[1:], np.log(w.sum(1)[1:]), rtol=1e-5)
