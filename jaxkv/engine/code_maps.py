"""The host's memory-mapping cap, which XLA:CPU's compiled code counts against.

XLA:CPU loads every compiled kernel into its own three memory mappings (code, read-only data, data):
about 400 per engine step variant of the embedded model. Linux caps a process at `vm.max_map_count`
mappings (65530 by default). Past the cap LLVM cannot map the next kernel ("LLVM compilation error:
Cannot allocate memory") and the process dies with SIGSEGV. A CPU engine that keeps meeting new step
variants (a long-lived server, a test process that builds many engines) gets there after ~150 variants;
`Engine.precompile` of a max_num_seqs=8, max_model_len=1024 engine on the CPU got there on its own.

`MapGuard.check` drops every compiled executable (`jax.clear_caches`) once the process holds more than
`fraction` of the cap; later steps recompile what they use (a stall instead of a crash). It reads
/proc/self/maps (~1 ms per 1,000 mappings) only after `every` new backend compiles, since only compiles
add mappings. GPU kernels live in device modules, not host mappings: the guard does nothing there.
"""

from __future__ import annotations

import gc
import logging

import jax

log = logging.getLogger("jaxkv")

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_compiles = 0


def _on_event(event: str, duration: float, **_) -> None:
    global _compiles
    if event == COMPILE_EVENT:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


def compiles() -> int:
    """Backend compiles in this process since jaxkv was imported."""
    return _compiles


def map_count() -> int | None:
    """Memory mappings this process holds (None where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def near_cap(fraction: float) -> tuple[int, int] | None:
    """(mappings, cap) when this is a CPU-backend process holding more than `fraction` of its cap."""
    if jax.default_backend() != "cpu":
        return None
    n, cap = map_count(), map_limit()
    if n is None or cap is None or n <= fraction * cap:
        return None
    return n, cap


def clear_compiled() -> None:
    """Drops every compiled executable (and the mappings of its kernels)."""
    jax.clear_caches()
    gc.collect()


class MapGuard:
    def __init__(self, fraction: float = 0.75, every: int = 8):
        self.fraction = fraction
        self.every = every
        self.cleared = 0  # times it dropped the compiled executables
        self._seen = compiles()

    def check(self) -> bool:
        """Clears the compiled executables if the process is near the mapping cap; True if it did. Call
        it between device calls (nothing in flight)."""
        if compiles() - self._seen < self.every:
            return False
        self._seen = compiles()
        hit = near_cap(self.fraction)
        if hit is None:
            return False
        clear_compiled()
        self.cleared += 1
        log.warning("jaxkv: %d of %d memory mappings (vm.max_map_count) in use by compiled XLA:CPU code; "
                    "dropped the compiled step variants, they recompile on next use", *hit)
        return True
