"""Public attention-score kernel: `attention_scores(..., implementation=None | "pallas" | "reference")`."""

from __future__ import annotations

from pallas_kernels._dispatch import dispatch, resolve_interpret
from pallas_kernels.attention_scores.kernel import attention_scores_pallas
from pallas_kernels.attention_scores.reference import REDUCTIONS
from pallas_kernels.attention_scores.reference import attention_scores as attention_scores_reference


def attention_scores(q, k_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, lse, *,
                     scale, reduce: str = "mean", implementation: str | None = None,
                     interpret: bool | None = None, pages_per_block: int = 8, block_t: int = 16):
    """Per-key probability mass from a query window -> [S, Hkv, max_pages * page_size] float32.

    Contract in reference.attention_scores; `lse` is the paged-attention LSE of the same queries.
    Fallback order: Pallas on GPU, then the jnp twin.
    """
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")
    args = (q, k_pages, slot_pos, page_table, lengths, q_seq, q_pos, sink, window, lse)
    impls = {
        "pallas": lambda: attention_scores_pallas(*args, scale=scale, reduce=reduce,
                                                  pages_per_block=pages_per_block, block_t=block_t,
                                                  interpret=resolve_interpret(interpret)),
        "reference": lambda: attention_scores_reference(*args, scale=scale, reduce=reduce),
    }
    return dispatch("attention_scores", implementation, impls)
