"""How many programs this process has compiled: step programs (the engine's jitted steps, by their jit
caches) and every XLA program (through `jax.monitoring`), so a server can show that it never compiles while
it serves."""

from __future__ import annotations

import threading

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation
_CACHE_HIT = "/jax/compilation_cache/cache_hits"  # one per program loaded from the persistent cache
_lock = threading.Lock()
_counts = {"compiled": 0, "persistent_cache": 0}
_seconds: dict[str, float] = {}  # compile-pipeline event -> seconds spent (tracing, lowering, XLA)
_programs: dict[str, float] = {}  # function name -> seconds of XLA compilation
_installed = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if not event.startswith("/jax/core/compile/"):
        return
    with _lock:
        _seconds[event] = _seconds.get(event, 0.0) + duration
        if event == _BACKEND_COMPILE:
            _counts["compiled"] += 1
            name = str(kwargs.get("fun_name", "?"))
            _programs[name] = _programs.get(name, 0.0) + duration


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        with _lock:
            _counts["persistent_cache"] += 1


def install() -> None:
    """Starts counting XLA programs (idempotent; counts from the first call on)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def xla_programs() -> dict[str, int]:
    """XLA programs since `install()`: {"compiled": built by XLA, "persistent_cache": loaded from disk}.
    A persistent-cache load also records a backend compile in some jax versions, so "compiled" is an upper
    bound of real compilations."""
    with _lock:
        return dict(_counts)


def seconds() -> tuple[dict[str, float], dict[str, float]]:
    """(seconds per compile-pipeline stage, seconds of XLA compilation per function name) since install."""
    with _lock:
        return dict(_seconds), dict(_programs)


def step_programs() -> int:
    """Step-program variants traced so far: the engine's ragged steps and decodes, the device step
    metadata, compression rewrites, retrieval decodes and reuse passes (their jit cache sizes)."""
    from jaxkv.engine import retrieval, runner
    from jaxkv.policies import apply as compress_apply
    from jaxkv.policies.reuse import apply as reuse_apply

    return (runner.num_compilations() + retrieval.num_compilations() + compress_apply.num_compilations()
            + reuse_apply.num_compilations())
