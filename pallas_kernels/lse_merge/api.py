"""Public LSE merge: `lse_merge(outs, lses, implementation=None | "pallas" | "reference")`."""

from __future__ import annotations

from pallas_kernels._dispatch import dispatch, resolve_interpret
from pallas_kernels.lse_merge.kernel import lse_merge_pallas
from pallas_kernels.lse_merge.reference import lse_merge as lse_merge_reference


def lse_merge(outs, lses, *, out_dtype=None, implementation: str | None = None,
              interpret: bool | None = None):
    """Merge K partial attention results (outs [K, ..., D], lses [K, ...]) -> (out [..., D], lse [...]).

    Fallback order: Pallas on GPU, then the jnp twin (see `pallas_kernels._dispatch`).
    """
    impls = {
        "pallas": lambda: lse_merge_pallas(outs, lses, out_dtype=out_dtype,
                                           interpret=resolve_interpret(interpret)),
        "reference": lambda: lse_merge_reference(outs, lses, out_dtype=out_dtype),
    }
    return dispatch("lse_merge", implementation, impls)
