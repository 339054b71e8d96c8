from pallas_kernels.retrieval_logits.api import retrieval_logits

__all__ = ["retrieval_logits"]
