"""Causal attention of query rows at scattered ascending positions over one sequence's contiguous K/V."""

from pallas_kernels.rows_attention.api import rows_attention

__all__ = ["rows_attention"]
