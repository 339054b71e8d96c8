"""Head-class prefill: global heads through a dense causal flash kernel, local heads through sink + window."""

from pallas_kernels.head_class_prefill.api import GLOBAL_IMPLS, LOCAL_IMPLS, check_gpu, head_class_prefill

__all__ = ["GLOBAL_IMPLS", "LOCAL_IMPLS", "check_gpu", "head_class_prefill"]
