"""Shared helpers for the kernels' public APIs: implementation choice with a fallback order.

A fallback is never silent: when an implementation of the default order fails and a later one runs,
`dispatch` logs a WARNING on the "pallas_kernels" logger, once per (kernel, error type). On a GPU the
Pallas kernel is expected to lower, so a failure there raises instead (a lowering regression must not
turn into a slow run unnoticed) unless JAXKV_ALLOW_KERNEL_FALLBACK=1 is set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import jax

IMPLEMENTATIONS = ("pallas", "reference")
FALLBACK_ENV = "JAXKV_ALLOW_KERNEL_FALLBACK"

log = logging.getLogger("pallas_kernels")
_warned: set[tuple] = set()


def on_gpu() -> bool:
    """True when the default backend is a GPU (the Pallas kernels are expected to lower there)."""
    return jax.default_backend() == "gpu"


def fallback_allowed() -> bool:
    """JAXKV_ALLOW_KERNEL_FALLBACK=1: on a GPU, a failing Pallas kernel falls back instead of raising."""
    return os.environ.get(FALLBACK_ENV, "") == "1"


def _brief(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + "..."


def warn_once(key: tuple, msg: str, *args) -> None:
    """Log `msg % args` as a WARNING on the "pallas_kernels" logger, once per `key` in this process."""
    if key in _warned:
        return
    _warned.add(key)
    log.warning(msg, *args)


def warn_fallback(name: str, failed: str, err: BaseException, used: str) -> None:
    """WARNING, once per (kernel name, error type): `failed` raised `err` and `used` ran instead."""
    warn_once(("fallback", name, type(err).__name__),
              "%s: implementation %r failed (%s: %s); falling back to %r", name, failed,
              type(err).__name__, _brief(err), used)


def default_order() -> tuple[str, ...]:
    """Fallback order when `implementation=None`: the Pallas kernel where it compiles (GPU), else the twin."""
    return ("pallas", "reference") if on_gpu() else ("reference",)


def resolve_interpret(interpret: bool | None) -> bool:
    """Pallas interpret mode: on by default off the GPU (CPU tests), off on the GPU."""
    return jax.default_backend() != "gpu" if interpret is None else interpret


def dispatch(name: str, implementation: str | None, impls: dict[str, Callable]):
    """Run the first implementation of the order that traces; `implementation` pins one (no fallback).

    A failure of the Pallas implementation on a GPU raises RuntimeError unless FALLBACK_ENV=1; every other
    fallback that ends in a working implementation is logged (see the module docstring)."""
    if implementation is not None and implementation not in impls:
        raise ValueError(f"{name}: implementation must be one of {sorted(impls)}, got {implementation!r}")
    if implementation is not None:
        return impls[implementation]()
    order: Sequence[str] = default_order()
    failures: list[tuple[str, BaseException]] = []
    for impl in order:
        try:
            out = impls[impl]()
        except (NotImplementedError, jax.errors.JaxRuntimeError) as e:  # lowering refused: next in order
            if impl == "pallas" and on_gpu() and not fallback_allowed():
                raise RuntimeError(
                    f"{name}: the Pallas kernel failed on the GPU ({type(e).__name__}: {_brief(e)}); "
                    f"set {FALLBACK_ENV}=1 to fall back to the jnp reference") from e
            failures.append((impl, e))
            continue
        for failed, err in failures:
            warn_fallback(name, failed, err, impl)
        return out
    raise RuntimeError(f"{name}: no implementation ran: {[f'{i}: {e}' for i, e in failures]}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
