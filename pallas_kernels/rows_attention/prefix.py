"""The split's prefix part on a GPU: cuDNN flash attention with the row chunks as segments of one ragged
batch whose key ranges all start at key 0 (they overlap; cuDNN reads each segment's keys through its
offset, so the shared K/V is never copied per chunk).

`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` with `q_offsets` / `kv_offsets` (the
packed-sequence form) and `return_residual=True` for the fp32 softmax stats (natural log). The public
`jax.nn.dot_product_attention` exposes neither the offsets nor fp32 stats. Its paged form
(`paged_attention`, chunks as a batch over one page table) runs as fast but its Python shape check
requires one private block per (batch, page).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cudnn_prefix(qc, k, v, kv_len, *, scale: float):
    """qc [NC, C, Hq, D] (16-bit), k/v [T, Hkv, D], kv_len [NC] -> (out [NC, C, Hq, D], lse [NC, C, Hq] f32).
    Raises NotImplementedError where it cannot run (no GPU, fp32, no cuDNN SDPA in this jax)."""
    if jax.default_backend() != "gpu":
        raise NotImplementedError(f"the cuDNN prefix needs a GPU backend (got {jax.default_backend()!r})")
    if qc.dtype not in (jnp.bfloat16, jnp.float16):
        raise NotImplementedError(f"the cuDNN prefix computes in 16 bits, got {qc.dtype}")
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as sdpa
    except ImportError as e:
        raise NotImplementedError(f"cuDNN SDPA unavailable in this jax: {e}") from e
    nc, c, hq, d = qc.shape
    q = qc.reshape(1, nc * c, hq, d)
    end = jnp.full((1, 1), -1, jnp.int32)
    q_off = jnp.concatenate([(jnp.arange(nc, dtype=jnp.int32) * c)[None], end], axis=1)
    kv_off = jnp.concatenate([jnp.zeros((1, nc), jnp.int32), end], axis=1)
    q_len = jnp.full((1, nc), c, jnp.int32)
    kl = jnp.maximum(kv_len.astype(jnp.int32), 1)[None]      # empty chunks are masked by the caller
    out, stats = sdpa(q, k[None].astype(qc.dtype), v[None].astype(qc.dtype), q_seqlen=q_len, kv_seqlen=kl,
                      q_offsets=q_off, kv_offsets=kv_off, scale=float(scale), mask_type=MaskType.PADDING,
                      qkv_layout="BTNH", return_residual=True)
    return out.reshape(nc, c, hq, d), stats_rows(stats, nc, c)


def stats_rows(stats, nc: int, c: int):
    """cuDNN's packed-layout stats [NC (segments), Hq, NC x C] -> [NC, C, Hq]: segment j's row i sits at
    stats[j, :, i] (each segment's stats start at 0; the rest of the row is -inf). Measured on an H200
    (jax 0.11.2) against the twin: natural log, this layout."""
    return jnp.transpose(stats[:, :, :c], (0, 2, 1)).astype(jnp.float32)
