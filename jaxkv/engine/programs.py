"""Programs compiled ahead of time for one owner of device programs (the model runner, the compressor, the
retriever, the segment reuser). `warmup.precompile` installs them here, or marks them kept on disk by the
step cache (`jaxkv.engine.step_cache`) to load on first use or on a background thread; the owner's calls go
through `Programs.call`, which runs the installed program whose signature matches, else the jitted function
itself.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np

log = logging.getLogger("jaxkv.engine")

# One load at a time (all owners). Loads on parallel threads failed with "Failed to materialize symbols:
# entry_mosaic_gpu"; so did loads one at a time, and the cause was Mosaic GPU's runtime library, unknown to a
# process that had lowered no Mosaic GPU kernel yet (`step_cache` now names it before any load).
_LOAD_LOCK = threading.Lock()
_installed: dict[str, int] = {}  # owner kind -> programs installed ahead of time in this process


def installed(kind: str) -> int:
    """Programs installed ahead of time in this process in owners of `kind` ("runner", "compressor",
    "retriever", "reuser"), each signature once per owner; programs loaded later from `pending` are not
    counted. The runner's, the retrieval module's and the reuse pass's `num_compilations()` add theirs to
    jit's own variants."""
    return _installed.get(kind, 0)


class Programs:
    """One owner's compiled programs, by signature (`signature`). `owned`: the static arguments that are the
    same in every call of this owner (its model configuration, mesh, attention implementation): they stay
    out of the signature, since hashing them at every call would cost more than the look-up itself.

    Programs kept on disk (`keep`) sit in `pending` until a call needs one (a load, ~0.3 s, never a compile)
    or `load_all` (a background thread) loads it; a call waiting for a load goes before the background
    loader."""

    def __init__(self, kind: str, owned=()):
        self.kind = kind
        self.owned = frozenset(owned)
        self._programs: dict = {}  # signature -> jax.stages.Compiled
        self.pending: dict = {}  # signature -> step cache key, not loaded yet
        self.cache = None  # the step cache `pending` loads from
        self._loading = False
        self._wanted = 0  # calls waiting in `lookup` for a load
        self._refused: set = set()  # signatures with no look-alike program, or one that refused them
        self._told_alike = self._told_miss = False

    def signature(self, fn, args, static) -> tuple:
        """What tells one program of this owner from another: the function, its static arguments but the
        `owned` ones, and the layout of the per-call arguments. `args`: (parameters, pool, batch, *state):
        the parameters and the pool are the owner's; the batch, a flat dict of arrays, gives each entry's
        name, shape and dtype in its order (device arrays: their abstract value, with weak type and
        placement); any further arguments (a method's state) give their structure and their leaves' abstract
        values. The batch is read entry by entry, not flattened as a pytree: every decode call pays for this
        (CPU: 2.6 us for a decode batch, where the runner's own rule took 3.7)."""
        owned, host = self.owned, np.ndarray
        key = (fn, tuple(sorted([kv for kv in static.items() if kv[0] not in owned])),
               tuple([(k, x.shape, x.dtype) if type(x) is host else (k, x.aval) for k, x in args[2].items()]))
        if len(args) == 3:
            return key
        leaves, treedef = jax.tree.flatten(args[3:])
        return (*key, treedef, tuple([jax.typeof(x) for x in leaves]))

    def install(self, signature, compiled) -> None:
        """A compiled program where `call` looks first (`warmup.precompile`)."""
        if signature not in self._programs:
            _installed[self.kind] = _installed.get(self.kind, 0) + 1
        self._programs[signature] = compiled

    def keep(self, signature, cache, key: str) -> None:
        """A program the step cache `cache` keeps under `key`, loaded when first needed (`lookup`) or by
        `load_all`."""
        self.cache = cache
        self.pending[signature] = key

    def lookup(self, signature):
        """The program of `signature` (loading it first when it is still only on disk), else None."""
        exe = self._programs.get(signature)
        if exe is None and (self.pending or self._loading):  # kept, or being loaded by the other thread
            self._wanted += 1  # the background loader steps aside: a call waiting on a program goes first
            try:
                exe = self._load(signature)
            finally:
                self._wanted -= 1
            if exe is None:
                exe = self._programs.get(signature)  # stored by the other thread since the first look
        return exe

    def call(self, fn, args, static):
        """The installed program of this call when there is one (called as jit would: the same donated
        buffers, the same placements), else one whose signature differs only in its device arrays' types
        beyond shape and dtype (`_alike`), else jit's own path. With nothing installed no signature is
        built."""
        if self._programs or self.pending or self._loading:
            signature = self.signature(fn, args, static)
            exe = self.lookup(signature)
            if exe is not None:
                return exe(*args)
            exe = self._alike(signature)
            if exe is not None:
                try:
                    out = exe(*args)
                except (TypeError, ValueError) as e:  # checked before it runs: nothing donated yet
                    self._refused.add(signature)
                    log.warning("jaxkv: a precompiled %s program refused a call of the same shapes (%s); "
                                "jit compiles its own", self.kind,
                                str(e).splitlines()[0] if str(e) else type(e).__name__)
                else:
                    self._programs[signature] = exe  # the next such call finds it at once
                    return out
        return fn(*args, **static)

    def _alike(self, signature):
        """The program installed for a signature that equals `signature` but in the types of device arrays
        beyond their shapes and dtypes (weak type, placement, memory space), logging the difference the
        first time; None when there is none. A program loaded from the step cache may hand its outputs
        back typed otherwise than the one compiled in this process did, and a step fed from a previous
        step's outputs (a decode's last tokens, a method's state) would miss the precompiled program for
        that alone and compile."""
        if signature in self._refused or not self._programs:
            return None
        want = _shapes(signature)
        for other, exe in list(self._programs.items()):
            if _shapes(other) == want:
                if not self._told_alike and not _host_for_device(signature, other):
                    self._told_alike = True
                    log.warning("jaxkv: %s call's arguments differ from a precompiled program's in type "
                                "beyond shape and dtype (%s); running that program", self.kind,
                                _first_difference(signature, other))
                return exe
        self._refused.add(signature)  # no look-alike: the next such call goes straight to jit
        if not self._told_miss:
            self._told_miss = True
            log.warning("jaxkv: a %s call matched no precompiled program and compiles; the nearest "
                        "differs in %s", self.kind, _nearest_difference(signature, list(self._programs)))
        return None

    def load_all(self) -> None:
        """Loads every pending program, stepping aside while a call waits for one."""
        for signature in list(self.pending):
            while self._wanted:  # a call needs a program now (the lock is not fair: let it in first)
                time.sleep(0.001)
            self._load(signature)

    def _load(self, signature):
        with _LOAD_LOCK:
            exe = self._programs.get(signature)
            if exe is None and signature in self.pending:
                self._loading = True
                try:
                    exe = self.cache.load(self.pending.pop(signature))
                    if exe is not None:
                        self._programs[signature] = exe
                finally:
                    self._loading = False
            return exe

    def __len__(self) -> int:  # programs loaded (installed or loaded from `pending`)
        return len(self._programs)

    def __bool__(self) -> bool:  # one with programs still on disk is not empty
        return bool(self._programs or self.pending or self._loading)

    def values(self):
        return self._programs.values()


def _types(signature) -> list:
    """The per-argument entries of a signature: the batch's (name, shape, dtype) or (name, aval), then the
    state's abstract values."""
    batch = list(signature[2])
    return batch + (list(signature[4]) if len(signature) > 3 else [])


def _shape_of(entry):
    if isinstance(entry, tuple):  # a batch entry
        name, *rest = entry
        return (name, *_shape_of(rest[0])) if len(rest) == 1 else (name, tuple(rest[0]), rest[1])
    return (tuple(entry.shape), entry.dtype) if hasattr(entry, "shape") else (entry,)


def _shapes(signature) -> tuple:
    """`signature` with every argument reduced to its shape and dtype."""
    rest = (signature[3],) if len(signature) > 3 else ()
    return (signature[0], signature[1], *rest, tuple(_shape_of(e) for e in _types(signature)))


def _host_for_device(a, b) -> bool:
    """Whether `a` differs from `b` only in host arrays where `b` had device arrays of the same shape and
    dtype, strongly typed (a caller that builds a batch entry on the host, such as a segment's own prefill,
    runs the same program: nothing worth a warning)."""
    def same(x, y):
        if x == y:
            return True
        host, dev = (x, y) if len(x) == 3 else (y, x)
        if len(host) != 3 or len(dev) != 2 or host[0] != dev[0]:
            return False
        aval = dev[1]
        return (tuple(aval.shape), aval.dtype) == (tuple(host[1]), host[2]) and not aval.weak_type

    ta, tb = list(a[2]), list(b[2])
    return a[:2] == b[:2] and a[3:] == b[3:] and len(ta) == len(tb) and all(map(same, ta, tb))


def _first_difference(a, b) -> str:
    return (_differences(a, b) or ["nothing"])[0]


def _differences(a, b) -> list[str]:
    """What tells signature `a` from `b`: static arguments, then per-argument types (`call` vs program)."""
    out = []
    sa, sb = dict(a[1]), dict(b[1])
    out += [f"static {k}: {sa.get(k)!r} vs {sb.get(k)!r}" for k in sorted(sa.keys() | sb.keys())
            if sa.get(k) != sb.get(k)]
    ta, tb = _types(a), _types(b)
    if len(ta) != len(tb) or (len(a) > 3) != (len(b) > 3) or (len(a) > 3 and a[3] != b[3]):
        out.append(f"argument structure ({len(ta)} vs {len(tb)} arrays)")
    out += [_entry_difference(x, y) for x, y in zip(ta, tb) if x != y]
    return out


# What besides shape and dtype tells two abstract values apart (their reprs may read the same); the aval
# class's own fields are read too (`_aval_attrs`), so an attribute a jax version adds is named as well
_AVAL_ATTRS = ("weak_type", "sharding", "memory_space", "vma", "manual_axis_type")


def _aval_attrs(aval) -> tuple[str, ...]:
    slots = [a for cls in type(aval).__mro__ for a in getattr(cls, "__slots__", ())
             if a not in ("shape", "dtype", "__weakref__", "__dict__")]
    return tuple(dict.fromkeys([*_AVAL_ATTRS, *slots]))


def _entry_difference(x, y) -> str:
    """One argument's difference, naming the attributes beyond shape and dtype where those are equal (two
    avals of one shape and dtype print alike: `int32[8]` vs `int32[8]`)."""
    if _shape_of(x) == _shape_of(y):
        ax, ay = (e[-1] if isinstance(e, tuple) else e for e in (x, y))
        attrs = [f"{a} {getattr(ax, a, None)!r} vs {getattr(ay, a, None)!r}" for a in _aval_attrs(ax)
                 if getattr(ax, a, None) != getattr(ay, a, None)]
        if attrs:
            name = f"{x[0]}: " if isinstance(x, tuple) else ""
            shape = ax.str_short() if hasattr(ax, "str_short") else repr(ax)
            return f"{name}{shape} {', '.join(attrs)}"
    return f"{x!r} vs {y!r}"


def _nearest_difference(signature, others) -> str:
    """The differences from the installed signature of the same function closest to `signature`."""
    same = [o for o in others if o[0] is signature[0]]
    if not same:
        return "its function (no program of it is installed)"
    diffs = min((_differences(signature, o) for o in same), key=len)
    return "; ".join(diffs[:3]) + (f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else "")
