"""Retrieval-logits kernel (interpret mode on CPU) against its jnp twin and a numpy oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.retrieval_logits import retrieval_logits


@pytest.mark.parametrize("g,d,num_slots,block_n,dtype", [(2, 16, 40, 16, "float32"),
                                                          (1, 8, 64, 32, "float32"),
                                                          (4, 32, 33, 16, "float32"),
                                                          (3, 16, 50, 16, "bfloat16")])
def test_kernel_equals_twin_and_oracle(g, d, num_slots, block_n, dtype):
    s, hkv, r, n = 3, 2, 5, 64
    kq, ks = jax.random.split(jax.random.PRNGKey(g * 100 + d))
    q = jax.random.normal(kq, (s, hkv, g, d), jnp.float32)
    state = jax.random.normal(ks, (r, n, hkv, d), jnp.float32).astype(dtype)  # bf16: the oracle reads it too
    rows = jnp.array([4, 0, 2], jnp.int32)
    q_pos = jnp.array([num_slots - 1, 5, 0], jnp.int32)
    got = retrieval_logits(q, state, rows, q_pos, num_slots=num_slots, implementation="pallas",
                           interpret=True, block_n=block_n)
    twin = retrieval_logits(q, state, rows, q_pos, num_slots=num_slots, implementation="reference")
    assert got.shape == (s, hkv, g, num_slots)
    np.testing.assert_allclose(np.asarray(got), np.asarray(twin), rtol=1e-5, atol=1e-5)
    qn, sn = np.asarray(q, np.float64), np.asarray(state.astype(jnp.float32), np.float64)
    for i in range(s):
        want = np.einsum("hgd,nhd->hgn", qn[i], sn[int(rows[i]), :num_slots])
        want[..., int(q_pos[i]) + 1:] = -np.inf
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-5, atol=1e-5)


def test_too_many_slots_is_an_error():
    q = jnp.zeros((1, 1, 1, 8))
    state = jnp.zeros((1, 16, 1, 8))
    with pytest.raises(ValueError, match="exceeds"):
        retrieval_logits(q, state, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32), num_slots=17,
                         implementation="pallas", interpret=True)


def test_kernel_lowers_to_triton_for_cuda():
    """The Pallas -> Triton lowering (not the Triton compile) runs on CPU: catches unsupported ops early."""
    from pallas_kernels.retrieval_logits.kernel import retrieval_logits_pallas

    q = jnp.zeros((2, 2, 2, 64), jnp.float32)
    state = jnp.zeros((3, 256, 2, 64), jnp.float32)
    f = jax.jit(lambda q, st, r, p: retrieval_logits_pallas(q, st, r, p, num_slots=200, interpret=False))
    try:
        text = f.trace(q, state, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    except (TypeError, NotImplementedError, AttributeError) as e:  # API differences across jax versions
        pytest.skip(f"cross-platform lowering unavailable: {e!r}"[:200])
    assert text.count("xla.gpu.triton") == 1
