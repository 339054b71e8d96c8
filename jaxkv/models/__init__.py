"""The functional Llama-family model (params pytree + pure forward)."""

from jaxkv.models.llama import AttendFn, dense_logits, forward, init_params, lm_head, param_shapes

__all__ = ["AttendFn", "dense_logits", "forward", "init_params", "lm_head", "param_shapes"]
