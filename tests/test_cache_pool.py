"""KVPool pytree + write_kv, and the host PageAllocator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache.allocator import OutOfPages, PageAllocator
from jaxkv.cache.pool import KVPool, init_pool, write_kv, write_kv_donated


def test_init_pool_shapes_and_pytree():
    pool = init_pool(5, 4, 8, jnp.float32)
    assert pool.k.shape == pool.v.shape == (5, 4, 8) and pool.pos.shape == (5, 4)
    assert pool.pos.dtype == jnp.int32 and (np.asarray(pool.pos) == -1).all()
    leaves, treedef = jax.tree_util.tree_flatten(pool)
    assert len(leaves) == 3
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, KVPool) and again.page_size == 4
    with pytest.raises(ValueError):
        init_pool(0, 4, 8)


def test_write_kv_donated_and_no_retrace():
    pool = init_pool(4, 2, 3, jnp.float32)
    traces = []

    def f(pool, k, v, pos, slots):
        traces.append(1)
        return write_kv(pool, k, v, pos, slots)

    step = jax.jit(f, donate_argnums=0)
    for t in range(3):
        k = jnp.full((2, 2, 3), float(t + 1))
        slots = jnp.array([[2 * t, 2 * t + 1], [-1, 7]], jnp.int32)
        pool = step(pool, k, -k, jnp.array([t, t + 10], jnp.int32), slots)
    assert len(traces) == 1
    pos = np.asarray(pool.pos).reshape(-1)
    np.testing.assert_array_equal(pos, [0, 0, 1, 1, 2, 2, -1, 12])
    np.testing.assert_array_equal(np.asarray(pool.k).reshape(8, 3)[:, 0], [1, 1, 2, 2, 3, 3, 0, 3])
    np.testing.assert_array_equal(np.asarray(pool.v).reshape(8, 3)[:, 0], [-1, -1, -2, -2, -3, -3, 0, -3])
    pool = write_kv_donated(pool, k, k, jnp.array([5, 6], jnp.int32), jnp.full((2, 2), -1, jnp.int32))
    assert np.asarray(pool.pos).reshape(-1)[7] == 12


def test_write_kv_casts_to_storage_dtype():
    pool = init_pool(2, 2, 4, jnp.bfloat16)
    new = write_kv(pool, jnp.ones((1, 1, 4), jnp.float32), jnp.ones((1, 1, 4)), jnp.array([0]),
                   jnp.array([[3]]))
    assert new.k.dtype == jnp.bfloat16 and float(new.k[1, 1, 0]) == 1.0


def test_allocator_alloc_free_refcounts():
    a = PageAllocator(6)
    ids = a.allocate(4)
    assert ids.dtype == np.int32 and len(set(ids.tolist())) == 4 and a.num_free == 2
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(OutOfPages):
        a.allocate(3)
    assert a.num_free == 2  # a failed allocation changes nothing
    a.incref(ids[:2])
    np.testing.assert_array_equal(a.refcount(ids), [2, 2, 1, 1])
    with pytest.raises(ValueError):
        a.free(ids[:1])  # shared pages cannot be force-freed
    a.decref(ids)  # first two stay held, last two return
    assert a.num_free == 4
    a.decref(ids[:2])
    assert a.num_free == 6
    with pytest.raises(ValueError):
        a.decref(ids[:1])  # double free
    with pytest.raises(ValueError):
        a.incref(ids[:1])  # incref of a free page
    got = a.allocate(6)
    assert sorted(got.tolist()) == list(range(6))
    a.free(got)
    assert a.num_free == 6
    with pytest.raises(ValueError):
        a.decref([7])
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_allocator_decref_duplicates():
    a = PageAllocator(3)
    ids = a.allocate(2)
    a.incref(ids[0])
    a.decref([ids[0], ids[0]])
    assert a.num_free == 2 and a.refcount(ids[1]) == 1
