from pallas_kernels.rope_shift.api import rope_inv_freq, rope_shift

__all__ = ["rope_inv_freq", "rope_shift"]
