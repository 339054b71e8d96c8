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


def _weak(n):
    """[2.0] * n, weak-typed float32 (as a program may type an output it hands back)."""
    return jnp.full((n,), 2.0)


def test_a_call_typed_otherwise_than_its_precompiled_program_still_runs_it(caplog):
    """A call whose device arrays differ from the installed program's only beyond shape and dtype (here a
    weak type, as a program loaded from the step cache may type its outputs) runs that program: nothing
    traced, one warning naming the difference, and the next such call finds it at once. A call of other
    shapes still takes jit's own path (no look-alike is installed for it), with one warning naming how it
    differs from the nearest program."""
    progs = programs.Programs("test", owned=("cfg",))
    args, static = _args(4), dict(scale=2.0, cfg="model")
    progs.install(progs.signature(_affine, args, static), _compiled(args, static))
    typed = _args(4)
    typed[2]["x"] = _weak(4)
    assert typed[2]["x"].weak_type and typed[2]["x"].dtype == jnp.float32 and not args[2]["x"].weak_type
    assert progs.signature(_affine, typed, static) != progs.signature(_affine, args, static)
    jit_variants = _affine._cache_size()
    with caplog.at_level("WARNING", logger="jaxkv.engine"):
        np.testing.assert_allclose(progs.call(_affine, typed, static), [5.5] * 4)
        np.testing.assert_allclose(progs.call(_affine, typed, static), [5.5] * 4)
    assert _affine._cache_size() == jit_variants  # the precompiled program ran both times
    told = [r.getMessage() for r in caplog.records if "differ from a precompiled program" in r.getMessage()]
    assert len(told) == 1 and "x: float32[4] weak_type True vs False" in told[0]
    assert len(progs) == 2  # the call's own signature now finds the program directly
    with caplog.at_level("WARNING", logger="jaxkv.engine"):
        np.testing.assert_allclose(progs.call(_affine, _args(3), static), [1.5, 3.5, 5.5])  # jit's own
        np.testing.assert_allclose(progs.call(_affine, _args(3), static), [1.5, 3.5, 5.5])
        progs.call(_affine, _args(4), dict(scale=3.0, cfg="model"))
    missed = [r.getMessage() for r in caplog.records if "matched no precompiled program" in r.getMessage()]
    # said once, naming what differs from the nearest program (its shape here)
    assert len(missed) == 1 and "float32[3]" in missed[0] and "float32[4]" in missed[0]
    assert programs._differences(progs.signature(_affine, _args(4), dict(scale=3.0, cfg="model")),
                              progs.signature(_affine, args, static)) == ["static scale: 3.0 vs 2.0"]


def test_a_look_alike_program_that_refuses_the_arguments_leaves_the_call_to_jit(caplog):
    """A look-alike program whose parameters or pool do not fit the call (outside the signature, here an
    int32 pool for a float32 one) refuses it before running: the call takes jit's path, with one warning,
    and the same call later goes to jit without trying the program again."""
    progs = programs.Programs("test", owned=("cfg",))
    args, static = _args(4), dict(scale=2.0, cfg="model")
    progs.install(progs.signature(_affine, args, static), _compiled(args, static))
    typed = _args(4)
    typed = (typed[0], jnp.int32(1), {**typed[2], "x": _weak(4)})
    with caplog.at_level("WARNING", logger="jaxkv.engine"):
        np.testing.assert_allclose(progs.call(_affine, typed, static), [6.0] * 4)
        np.testing.assert_allclose(progs.call(_affine, typed, static), [6.0] * 4)
    refused = [r for r in caplog.records if "refused a call" in r.getMessage()]
    assert len(refused) == 1
    assert progs.signature(_affine, typed, static) in progs._refused and len(progs) == 1


def test_a_host_array_for_a_device_one_runs_the_program_without_a_warning(caplog):
    """A batch entry built on the host (numpy) where the program was compiled for a device array of the
    same shape and dtype runs that program silently, leaving the one look-alike warning for a difference
    worth naming (the weak type after it)."""
    progs = programs.Programs("test", owned=("cfg",))
    args, static = _args(4), dict(scale=2.0, cfg="model")
    progs.install(progs.signature(_affine, args, static), _compiled(args, static))
    host = _args(4)
    host[2]["x"] = np.asarray(host[2]["x"])
    jit_variants = _affine._cache_size()
    with caplog.at_level("WARNING", logger="jaxkv.engine"):
        np.testing.assert_allclose(progs.call(_affine, host, static), [1.5, 3.5, 5.5, 7.5])
        assert not [r for r in caplog.records if "differ from a precompiled program" in r.getMessage()]
        weak = _args(4)
        weak[2]["x"] = _weak(4)
        np.testing.assert_allclose(progs.call(_affine, weak, static), [5.5] * 4)
    assert _affine._cache_size() == jit_variants
    told = [r.getMessage() for r in caplog.records if "differ from a precompiled program" in r.getMessage()]
    assert len(told) == 1 and "x: float32[4] weak_type True vs False" in told[0]


def test_an_aval_difference_past_the_known_attributes_is_named():
    """Two abstract values that print alike and differ in a field the known list lacks (a later jax's) are
    told apart by the aval class's own fields, not printed as `int32[8] vs int32[8]`."""

    class Aval:
        __slots__ = ("shape", "dtype", "flavor")

        def __init__(self, flavor):
            self.shape, self.dtype, self.flavor = (8,), np.dtype(np.int32), flavor

        def str_short(self):
            return "int32[8]"

    said = programs._entry_difference(("tokens", Aval("a")), ("tokens", Aval("b")))
    assert said == "tokens: int32[8] flavor 'a' vs 'b'"
