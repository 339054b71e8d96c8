"""Public RoPE shift + page copy: `rope_shift(..., implementation=None | "pallas" | "reference")`."""

from __future__ import annotations

from pallas_kernels._dispatch import dispatch, resolve_interpret
from pallas_kernels.rope_shift.kernel import rope_shift_pallas
from pallas_kernels.rope_shift.reference import rope_inv_freq
from pallas_kernels.rope_shift.reference import rope_shift as rope_shift_reference

__all__ = ["rope_inv_freq", "rope_shift"]

DEFAULT_BLOCK = {"neox": 1, "gptj": 2}   # H200: neox 3.44 TB/s at 1 page/program vs 2.84 at 2; gptj flat


def rope_shift(k_pages, v_pages, slot_pos, src_pages, dst_pages, deltas, inv_freq, *, style: str = "neox",
               implementation: str | None = None, interpret: bool | None = None, block: int | None = None):
    """Copy pages src -> dst rotating K by delta (fp32) and shifting positions; see reference.rope_shift.

    The Pallas path donates the three pool arrays (in-place update). Fallback order: Pallas on GPU, twin.
    `block` = pages per program; None = DEFAULT_BLOCK[style] (H200 sweep, docs/benchmarks.md).
    """
    block = block or DEFAULT_BLOCK.get(style, 4)
    args = (k_pages, v_pages, slot_pos, src_pages, dst_pages, deltas, inv_freq)
    impls = {
        "pallas": lambda: rope_shift_pallas(*args, style=style, block=block,
                                            interpret=resolve_interpret(interpret)),
        "reference": lambda: rope_shift_reference(*args, style=style),
    }
    return dispatch("rope_shift", implementation, impls)
