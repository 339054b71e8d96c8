"""Static block-table rewrite: compaction against a numpy oracle, release lists, no retrace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rewrite.api import rewrite
from tests.kernels._data import random_rewrite_case as _case


@pytest.mark.parametrize("implementation", ["pallas", "reference"])
def test_rewrite_compacts_selected_slots(implementation):
    rng = np.random.default_rng(3)
    k, v, pos, pt, lengths, sel, cnt = _case(rng)
    p = k.shape[1]
    out = rewrite(*[jnp.asarray(x) for x in (k, v, pos, pt, lengths, sel, cnt)],
                  implementation=implementation, chunk=4)
    k2, v2, pos2, pt2, len2, rel = (np.asarray(x) for x in out)
    np.testing.assert_array_equal(len2, cnt)
    for i in np.ndindex(*cnt.shape):
        c, pages = cnt[i], pt[i]
        for m in range(c):
            src = sel[i][m]
            np.testing.assert_array_equal(k2[pages[m // p], m % p], k[pages[src // p], src % p])
            np.testing.assert_array_equal(v2[pages[m // p], m % p], v[pages[src // p], src % p])
            assert pos2[pages[m // p], m % p] == pos[pages[src // p], src % p]
        for m in range(c, -(-c // p) * p):
            assert pos2[pages[m // p], m % p] == -1
        keep, used = -(-c // p), -(-lengths[i] // p)
        np.testing.assert_array_equal(rel[i][keep:used], pages[keep:used])
        assert np.all(rel[i][:keep] == -1) and np.all(pt2[i][keep:] == -1)
        np.testing.assert_array_equal(pt2[i][:keep], pages[:keep])


def test_rewrite_compiles_once_for_new_contents():
    rng = np.random.default_rng(4)
    compiles = []
    jax.monitoring.register_event_listener(lambda name, **kw: compiles.append(name)
                                           if name == "/jax/compilation_cache/compile_requests_use_cache"
                                           else None)
    fn = jax.jit(lambda *a: rewrite(*a, implementation="reference"), donate_argnums=(0, 1, 2))
    for _ in range(3):
        fn(*[jnp.asarray(x) for x in _case(rng)])
    assert fn._cache_size() == 1
