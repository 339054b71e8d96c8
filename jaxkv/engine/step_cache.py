"""Compiled programs kept on disk under the engine's own key, so a restart skips tracing and lowering.

JAX's persistent compilation cache is keyed by the lowered program: a warm start still traces and lowers every
step variant before it can look one up (1B shape, 130 variants on an H100: ~40 s warm, nearly all of it
tracing and lowering). This cache is keyed by what determines the program without tracing it: the function,
its static arguments, the shapes, dtypes and placements of its arguments, and a fingerprint of everything
else a program can depend on (jax and jaxlib versions, the device kind, XLA flags, the source of jaxkv and
its kernels, the model's configuration and parameter layout). A hit loads the serialized executable
(`jax.experimental.serialize_executable`); a miss traces, lowers, compiles and writes it.

On by default on accelerators (in ``<compilation cache dir>/jaxkv-steps``); ``JAXKV_STEP_CACHE=0`` turns it
off, ``=1`` turns it on for the CPU too. On the CPU a program XLA loaded from its own persistent cache
does not survive a second serialization (it fails at run time: "Function wrapped_iota not found"), so there
only programs compiled in this process are kept, and the CPU default is off. Entries are written
atomically (a temporary file renamed); an unreadable entry is a miss.

A program holding a Mosaic GPU kernel links that kernel's host launcher against Mosaic GPU's runtime library
when it loads; jax names that library in ``MOSAIC_GPU_RUNTIME_LIB_PATH`` only once its Mosaic GPU module is
imported, which a process that loads every program and lowers none never does ("Symbols not found:
mosaic_gpu_launch_kernel"). A cache imports it when it is made (`_mosaic_gpu_runtime`), before any load.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import sys
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger("jaxkv.engine")

SUBDIR = "jaxkv-steps"


def enabled() -> bool:
    flag = os.environ.get("JAXKV_STEP_CACHE", "")
    if flag in ("0", "1"):
        return flag == "1"
    return jax.default_backend() != "cpu"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """Digest of every Python source of jaxkv and pallas_kernels (a program's code is part of its key)."""
    import jaxkv
    import pallas_kernels

    h = hashlib.sha256()
    for pkg in (jaxkv, pallas_kernels):
        root = Path(pkg.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def describe(tree) -> str:
    """Structure, shapes, dtypes and placements of a pytree of arrays (numpy arrays as host inputs)."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [str(treedef)]
    for x in leaves:
        if isinstance(x, jax.Array):
            parts.append(f"{x.shape}{x.dtype}{x.weak_type}{x.sharding}")
        elif isinstance(x, np.ndarray | np.generic):
            parts.append(f"np{x.shape}{x.dtype}")
        else:
            parts.append(f"{type(x).__name__}:{x!r}")
    return "|".join(parts)


def environment() -> str:
    """What a compiled program depends on outside its own arguments."""
    import jaxlib

    dev = jax.devices()[0]
    client = getattr(dev, "client", None)
    return "|".join([
        jax.__version__, jaxlib.__version__, sys.version.split()[0], jax.default_backend(),
        str(getattr(client, "platform_version", "")), dev.device_kind, str(jax.device_count()),
        os.environ.get("XLA_FLAGS", ""), os.environ.get("JAXKV_PREFILL_GLOBAL_IMPL", ""),
        str(jax.config.jax_enable_x64),
        str(jax.config.jax_default_matmul_precision), source_digest()])


@functools.lru_cache(maxsize=1)
def _mosaic_gpu_runtime() -> str | None:
    """Path of Mosaic GPU's runtime library, made known to the kernels' loader (None where jax has none)."""
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401 - sets MOSAIC_GPU_RUNTIME_LIB_PATH
    except Exception:  # noqa: BLE001 - no Mosaic GPU in this jaxlib: no program can hold its kernels
        return None
    return os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH")


class StepCache:
    """Serialized executables in `directory`, one file per key, for one engine (`fingerprint`)."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str):
        self.dir = Path(directory)
        _mosaic_gpu_runtime()  # before jax's own cache loads a program holding such a kernel, too
        self.fingerprint = hashlib.sha256((environment() + "|" + fingerprint).encode()).hexdigest()
        self.hits = self.misses = self.errors = 0  # loads run one at a time (a lock, or precompile)

    @classmethod
    def for_engine(cls, engine, directory: str | os.PathLike | None = None) -> StepCache | None:
        """The engine's cache in `directory` (given: on whatever the backend), else the default one (None
        when it is off or there is no compilation cache directory)."""
        if directory is None:
            base = jax.config.jax_compilation_cache_dir
            if not enabled() or not base:
                return None
            directory = Path(base) / SUBDIR
        runner = engine.runner
        fp = "|".join([repr(engine.model.config), describe(runner.params), describe(runner.pool),
                       repr(sorted(runner._kw(True).items(), key=lambda kv: kv[0]))])
        return cls(directory, fp)

    def key(self, fn, args, static, options: dict | None = None) -> str:
        """A program's key: the function, its static arguments and its per-call arguments' layout (the
        parameters and the pool, args[0:2], are in the fingerprint), and the compiler `options` it was
        compiled with. Two jitted forms of one function (other compiler options) tell themselves apart by a
        `step_cache_name` attribute."""
        name = getattr(fn, "step_cache_name", None) or (
            f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', fn))}")
        parts = [self.fingerprint, name, repr(sorted(static.items(), key=lambda kv: kv[0])),
                 describe(args[2:])]
        if options:
            parts.append(repr(sorted(options.items())))
        text = "|".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str):
        """The compiled program under `key`, or None (absent or unreadable)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.dir / f"{key}.bin"
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(data)
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - a stale or damaged entry is a miss, compiled again
            log.warning("jaxkv: step cache entry %s unreadable (%s); compiling it again", path.name,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.errors += 1
            return None
        self.hits += 1
        return compiled

    def has(self, key: str) -> bool:
        return (self.dir / f"{key}.bin").is_file()

    def scratch(self, key: str) -> int:
        """Device memory the kept program needs beyond its arguments (written beside it; 0 if unknown)."""
        try:
            return int((self.dir / f"{key}.scratch").read_text())
        except (OSError, ValueError):
            return 0

    def save(self, key: str, compiled, scratch: int = 0) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            data = pickle.dumps(serialize(compiled))
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / f"{key}.scratch").write_text(str(int(scratch)))
            tmp = self.dir / f".{key}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.dir / f"{key}.bin")
        except Exception as e:  # noqa: BLE001 - a program that cannot be kept compiles again next start
            log.warning("jaxkv: could not keep a compiled step in %s (%s)", self.dir,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
