from pallas_kernels.rewrite.api import rewrite

__all__ = ["rewrite"]
