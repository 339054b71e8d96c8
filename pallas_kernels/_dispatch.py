"""Shared helpers for the kernels' public APIs: implementation choice with a fallback order."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

IMPLEMENTATIONS = ("pallas", "reference")


def default_order() -> tuple[str, ...]:
    """Fallback order when `implementation=None`: the Pallas kernel where it compiles (GPU), else the twin."""
    return ("pallas", "reference") if jax.default_backend() == "gpu" else ("reference",)


def resolve_interpret(interpret: bool | None) -> bool:
    """Pallas interpret mode: on by default off the GPU (CPU tests), off on the GPU."""
    return jax.default_backend() != "gpu" if interpret is None else interpret


def dispatch(name: str, implementation: str | None, impls: dict[str, Callable]):
    """Run the first implementation of the order that traces; `implementation` pins one (no fallback)."""
    if implementation is not None and implementation not in impls:
        raise ValueError(f"{name}: implementation must be one of {sorted(impls)}, got {implementation!r}")
    if implementation is not None:
        return impls[implementation]()
    order: Sequence[str] = default_order()
    errors = []
    for impl in order:
        try:
            return impls[impl]()
        except (NotImplementedError, jax.errors.JaxRuntimeError) as e:  # lowering refused: next in order
            errors.append(f"{impl}: {e}")
    raise RuntimeError(f"{name}: no implementation ran: {errors}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
