from pallas_kernels.lse_merge.api import lse_merge

__all__ = ["lse_merge"]
