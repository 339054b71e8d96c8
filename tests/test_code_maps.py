"""The XLA:CPU mapping guard (jaxkv/engine/code_maps.py) on the real process: compiled kernels hold host
mappings, and the guard drops them once the process is past its threshold."""

import jax
import jax.numpy as jnp
import pytest

from jaxkv.engine import code_maps

pytestmark = pytest.mark.skipif(code_maps.map_count() is None or code_maps.map_limit() is None,
                                reason="needs /proc (Linux)")


def _compile_some(n: int):
    fns = [jax.jit(lambda x, i=i: jnp.sin(x * (i + 1.0)) @ x.T + jnp.cos(x).sum(0)) for i in range(n)]
    for f in fns:
        f(jnp.ones((8, 8))).block_until_ready()
    return fns


def test_compiled_kernels_hold_mappings_and_the_guard_releases_them():
    code_maps.clear_compiled()
    before_compiles, before_maps = code_maps.compiles(), code_maps.map_count()
    fns = _compile_some(12)
    assert code_maps.compiles() - before_compiles >= 12  # the compile listener sees backend compiles
    grown = code_maps.map_count()
    assert grown > before_maps + 12  # every executable maps its kernels
    assert all(f._cache_size() == 1 for f in fns)
    guard = code_maps.MapGuard(fraction=(before_maps - 1) / code_maps.map_limit(), every=12)
    guard._seen = before_compiles
    assert guard.check() and guard.cleared == 1
    assert all(f._cache_size() == 0 for f in fns)
    assert code_maps.map_count() < grown
    assert not guard.check()  # no compile since: no second read, nothing cleared


def test_the_guard_leaves_a_process_below_its_fraction_alone():
    fns = _compile_some(2)
    guard = code_maps.MapGuard(fraction=1.0, every=0)
    assert not guard.check() and guard.cleared == 0
    assert all(f._cache_size() == 1 for f in fns)
