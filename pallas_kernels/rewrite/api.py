"""Public static block-table rewrite: `rewrite(..., implementation=None | "pallas" | "reference")`."""

from __future__ import annotations

from pallas_kernels._dispatch import dispatch, resolve_interpret
from pallas_kernels.rewrite.kernel import rewrite_pallas
from pallas_kernels.rewrite.reference import rewrite as rewrite_reference


def rewrite(k_pages, v_pages, slot_pos, page_table, lengths, sel_idx, sel_count, *,
            implementation: str | None = None, interpret: bool | None = None, chunk: int = 64):
    """Compact per-head selected slots into the head's first pages (contract in reference.rewrite).

    Returns (k_pages, v_pages, slot_pos, page_table, lengths, release). The Pallas path donates the pools.
    Fallback order: Pallas on GPU, then the jnp twin.
    """
    args = (k_pages, v_pages, slot_pos, page_table, lengths, sel_idx, sel_count)
    impls = {
        "pallas": lambda: rewrite_pallas(*args, chunk=chunk, interpret=resolve_interpret(interpret)),
        "reference": lambda: rewrite_reference(*args),
    }
    return dispatch("rewrite", implementation, impls)
