"""The holder of ahead-of-time programs (jaxkv.engine.programs): the installed program runs when its signature
matches, jit's own path otherwise; kept programs load from a real step cache on first use."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine import programs
from jaxkv.engine.step_cache import StepCache


@functools.partial(jax.jit, static_argnames=("scale", "shift", "cfg"))
def _affine(params, pool, b, state=None, *, scale, shift=0.0, cfg=None):
    out = b["x"] * scale + shift + params["bias"] + pool
    return out if state is None else out + state["offset"]


def _args(n, state=None):
    b = {"x": jnp.arange(n, dtype=jnp.float32), "rows": np.zeros(n, np.int32)}
    return ({"bias": jnp.float32(1.0)}, jnp.float32(0.5), b) + (() if state is None else (state,))


def _compiled(args, static):
    return _affine.lower(*args, **static).compile()


def test_an_installed_program_runs_and_other_shapes_take_jits_path():
    progs = programs.Programs("test", owned=("cfg",))
    assert not progs and len(progs) == 0
    args, static = _args(4), dict(scale=2.0, cfg="model")
    before = programs.installed("test")
    progs.install(progs.signature(_affine, args, static), _compiled(args, static))
    progs.install(progs.signature(_affine, args, static), _compiled(args, static))  # the same program again
    assert programs.installed("test") == before + 1 and len(progs) == 1 and progs
    jit_variants = _affine._cache_size()
    np.testing.assert_allclose(progs.call(_affine, args, static), [1.5, 3.5, 5.5, 7.5])
    assert _affine._cache_size() == jit_variants  # the installed program ran, nothing traced
    np.testing.assert_allclose(progs.call(_affine, _args(3), static), [1.5, 3.5, 5.5])
    assert _affine._cache_size() == jit_variants + 1  # no program of that shape: jit's own path


def test_signature_tells_programs_apart_but_not_by_owned_static_arguments():
    progs = programs.Programs("test", owned=("cfg",))
    sig = functools.partial(progs.signature, _affine)
    base = sig(_args(4), dict(scale=2.0, shift=0.0, cfg="a"))
    assert sig(_args(4), dict(cfg="b", shift=0.0, scale=2.0)) == base  # owned values, static arguments' order
    assert sig(_args(4), dict(scale=2.0, shift=1.0, cfg="a")) != base
    assert sig(_args(4), dict(scale=3.0, shift=0.0, cfg="a")) != base  # another static value: another program
    assert sig(_args(5), dict(scale=2.0, shift=0.0, cfg="a")) != base  # another shape
    host = _args(4)
    host[2]["x"] = np.asarray(host[2]["x"])
    assert sig(host, dict(scale=2.0, shift=0.0, cfg="a")) != base  # a host array compiles apart
    static = dict(scale=2.0, shift=0.0, cfg="a")
    with_state = sig(_args(4, {"offset": jnp.zeros(4)}), static)
    assert with_state != base
    assert sig(_args(4, {"offset": jnp.zeros(4, jnp.int32)}), static) != with_state
    assert sig(_args(4, {"offset": jnp.ones(4)}), static) == with_state  # values never


def test_kept_programs_load_from_the_step_cache_on_first_use_and_in_the_background(tmp_path):
    cache = StepCache(tmp_path, "test")
    calls = [(_args(n), dict(scale=2.0)) for n in (4, 6)]
    keys = []
    for args, static in calls:
        key = cache.key(_affine, args, static)
        cache.save(key, _compiled(args, static))
        keys.append(key)
    progs = programs.Programs("test")
    for (args, static), key in zip(calls, keys):
        progs.keep(progs.signature(_affine, args, static), cache, key)
    assert progs and len(progs) == 0 and len(progs.pending) == 2  # kept on disk: not empty
    jit_variants, installed = _affine._cache_size(), programs.installed("test")
    np.testing.assert_allclose(progs.call(_affine, *calls[0]), [1.5, 3.5, 5.5, 7.5])
    assert cache.hits == 1 and len(progs) == 1 and len(progs.pending) == 1
    progs.load_all()
    assert cache.hits == 2 and len(progs) == 2 and not progs.pending
    np.testing.assert_allclose(progs.call(_affine, *calls[1]), np.arange(6) * 2.0 + 1.5)
    assert _affine._cache_size() == jit_variants  # loads, never a compile
    assert programs.installed("test") == installed  # loaded later, as before: not counted as installed
