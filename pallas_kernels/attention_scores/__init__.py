from pallas_kernels.attention_scores.api import attention_scores

__all__ = ["attention_scores"]
