"""Static block-table rewrite: compaction against a numpy oracle, release lists, no retrace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rewrite.api import rewrite


def _case(rng, s=2, layers=2, h=2, mp=5, p=4, d=8, maxsel=12):
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
