"""Public retrieval-logits kernel: `retrieval_logits(..., implementation=None | "pallas" | "reference")`."""

from __future__ import annotations

from pallas_kernels._dispatch import dispatch, resolve_interpret
from pallas_kernels.retrieval_logits.kernel import retrieval_logits_pallas
from pallas_kernels.retrieval_logits.reference import retrieval_logits as retrieval_logits_reference


def retrieval_logits(q, state, rows, q_pos, *, num_slots: int, implementation: str | None = None,
                     interpret: bool | None = None, block_n: int = 256):
    """Decode-query logits of each row over its key-cache row -> [S, Hkv, G, num_slots] float32.

    Contract in reference.py. Fallback order: Pallas on GPU, then the jnp twin."""
    impls = {
        "pallas": lambda: retrieval_logits_pallas(q, state, rows, q_pos, num_slots=num_slots, block_n=block_n,
                                                  interpret=resolve_interpret(interpret)),
        "reference": lambda: retrieval_logits_reference(q, state, rows, q_pos, num_slots=num_slots),
    }
    return dispatch("retrieval_logits", implementation, impls)
