"""Dense causal flash attention for the *global* heads of a fresh prompt, with natural-log LSE.

Both wrappers take q [T, H, D], k/v [T, Hk, D] (H a multiple of Hk, query head j reads KV head j // (H/Hk))
at positions 0..T-1 and return (out [T, H, D] q.dtype, lse [T, H] float32, natural log of the scaled
scores' sum-exp). They raise NotImplementedError where they cannot run (no GPU, wrong GPU, head_dim), so
api.py's fallback moves on.

* `mosaic_causal`: `jax.experimental.pallas.ops.gpu.attention_mgpu.attention` (Pallas Mosaic GPU,
  FlashAttention-3 style: 2 compute warpgroups x `block_q` rows each, wgmma, TMA-fed K/V ring of
  `max_concurrent_steps` stages, a memory warpgroup). Conventions read from its source (jax 0.10.2, same
  forward in jax main): it applies *no* softmax scale (q is pre-scaled here, in fp32, then rounded once);
  its SMEM scratch is declared float16 and the TMA copies check dtypes, so bf16 operands do not lower --
  q, k, v are cast to float16 (exact for bf16 values inside float16's range, |x| < 65504) and the output is
  cast back; the residual LSE is in log2 units (`m * log2(e) + log2(l)`) and laid out [B, H, T], so
  lse = lse2 * ln(2), transposed; it needs T % (2 * block_q) == 0 and T % block_kv == 0 (T is padded at
  the end with zeros: under top-left causal masking a padded key k >= T is invisible to every real query
  p < T; padded query rows are sliced off), head_dim % 64 == 0, and wgmma (sm_90 only).
* `cudnn_causal`: cuDNN flash attention through jax's cuDNN SDPA wrapper with `return_residual=True`
  (the softmax stats, fp32 [B, H, T], natural log). The public `jax.nn.dot_product_attention` casts that
  residual to the output dtype (bf16: ~3e-2 absolute error on an LSE of ~10), so the private
  `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` is called for the fp32 stats; if that
  private API is gone, the public call gives the output and `causal_lse` recomputes the LSE (exact, slower).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LN2 = math.log(2.0)
MOSAIC_BLOCK_Q = 64           # rows per compute warpgroup (two per program: 128 query rows)
MOSAIC_MAX_CONCURRENT = 2     # K/V pipeline stages


def mosaic_block_kv(head_dim: int) -> int:
    # SMEM: 2 x block_q x D (q/o) + 2 stages x 2 (k, v) x block_kv x D, f16. 256 overflows at D=128.
    return 128 if head_dim <= 128 else 64


def _require_gpu(what: str):
    if jax.default_backend() != "gpu":
        raise NotImplementedError(f"{what} needs a GPU backend (got {jax.default_backend()!r})")


def mosaic_causal(q, k, v, *, scale: float, block_q: int = MOSAIC_BLOCK_Q, block_kv: int | None = None,
                  max_concurrent_steps: int = MOSAIC_MAX_CONCURRENT):
    """Causal attention through Pallas Mosaic GPU (Hopper). See the module docstring for conventions."""
    _require_gpu("global_impl='mosaic'")
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc != "9.0":
        raise NotImplementedError(f"global_impl='mosaic' uses wgmma (sm_90 / Hopper only), device has {cc!r}")
    t, h, d = q.shape
    if d % 64:
        raise NotImplementedError(f"global_impl='mosaic' needs head_dim % 64 == 0, got {d}")
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mg
    except Exception as e:  # noqa: BLE001 -- any import failure means "not available here"
        raise NotImplementedError(f"attention_mgpu unavailable: {e}") from e
    cfg = mg.TuningConfig(block_q=block_q, block_kv=mosaic_block_kv(d) if block_kv is None else block_kv,
                          max_concurrent_steps=max_concurrent_steps, causal=True)
    try:
        return mosaic_call(mg.attention, cfg, q, k, v, scale=scale)
    except ValueError as e:   # e.g. its CUDA 12.8.0-12.9.0 causal guard (ptxas miscompilation)
        raise NotImplementedError(f"attention_mgpu refused: {e}") from e


def mosaic_call(attention, cfg, q, k, v, *, scale: float):
    """The conversions around `attention_mgpu.attention(q, k, v, cfg, save_residuals=True)` (any function
    with its conventions: [B, T, H, D] float16, no scale, log2 LSE [B, H, T]); see the module docstring."""
    t = q.shape[0]
    mult = math.lcm(2 * cfg.block_q, cfg.block_kv)
    tp = -(-t // mult) * mult
    pad = ((0, tp - t), (0, 0), (0, 0))
    qs = jnp.pad((q.astype(jnp.float32) * scale).astype(jnp.float16), pad)
    ks = jnp.pad(k.astype(jnp.float16), pad)
    vs = jnp.pad(v.astype(jnp.float16), pad)
    out, (lse2,) = attention(qs[None], ks[None], vs[None], cfg, True)    # save_residuals=True
    out = out[0, :t].astype(q.dtype)
    lse = (lse2[0, :, :t] * LN2).T.astype(jnp.float32)               # log2 [H, T] -> natural [T, H]
    return out, lse


def causal_lse(q, k, *, scale: float, block: int = 512):
    """Natural-log LSE of causal scaled scores, blocked over queries (fp32 logits, bf16/f16 MMA inputs)."""
    t, h, d = q.shape
    hk = k.shape[1]
    g = h // hk
    c = min(block, t)
    n = -(-t // c)
    qb = jnp.pad(q, ((0, n * c - t), (0, 0), (0, 0))).reshape(n, c, hk, g, d)
    kpos = jnp.arange(t, dtype=jnp.int32)

    def one(args):
        qq, i = args
        s = jnp.einsum("chgd,jhd->chgj", qq, k, preferred_element_type=jnp.float32) * scale
        pos = i * c + jnp.arange(c, dtype=jnp.int32)
        s = jnp.where((kpos[None, :] <= pos[:, None])[:, None, None, :], s, -jnp.inf)
        return jax.nn.logsumexp(s, axis=-1).reshape(c, h)

    lse = jax.lax.map(one, (qb, jnp.arange(n, dtype=jnp.int32)))
    return lse.reshape(n * c, h)[:t]


def cudnn_causal(q, k, v, *, scale: float):
    """Causal attention through cuDNN flash attention; fp32 natural-log LSE from its softmax stats."""
    _require_gpu("global_impl='cudnn'")
    dt = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16   # cuDNN: 16-bit only
    qs, ks, vs = (x.astype(dt)[None] for x in (q, k, v))
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as _cudnn_sdpa
    except ImportError:
        _cudnn_sdpa = None
    if _cudnn_sdpa is not None:
        try:
            out, stats = _cudnn_sdpa(qs, ks, vs, scale=float(scale), mask_type=MaskType.CAUSAL,
                                     qkv_layout="BTNH", return_residual=True)
        except TypeError:      # private signature changed: public path below
            _cudnn_sdpa = None
        else:
            return out[0].astype(q.dtype), stats[0].T.astype(jnp.float32)   # [1, H, T] -> [T, H]
    out = jax.nn.dot_product_attention(qs, ks, vs, scale=float(scale), is_causal=True, implementation="cudnn")
    return out[0].astype(q.dtype), causal_lse(qs[0], ks[0], scale=float(scale))


def sink_part(q, k, v, *, sink: int, window: int, scale: float):
    """Attention of every query to the sink keys [0, sink) that lie *before* its window (k <= p - window):
    the part of a local head that a sliding-window kernel does not see -> (out [T, H, D] f32, lse [T, H]).
    Queries with no such key get out 0, lse -inf. Dense over `sink` keys: T x H x sink scores."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    ns = min(sink, t)
    ks, vs = k[:ns], v[:ns]
    qg = q.reshape(t, hkv, g, d)
    s = jnp.einsum("thgd,khd->thgk", qg, ks, preferred_element_type=jnp.float32) * scale
    p = jnp.arange(t, dtype=jnp.int32)[:, None, None, None]
    kk = jnp.arange(ns, dtype=jnp.int32)[None, None, None, :]
    s = jnp.where(kk <= p - window, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)                                   # -inf where nothing is visible
    w = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("thgk,khd->thgd", w.astype(v.dtype), vs, preferred_element_type=jnp.float32)
    return out.reshape(t, hq, d), lse.reshape(t, hq)


def cudnn_local(q, k, v, *, sink: int, window: int, scale: float):
    """Local heads (one shared sink + window) through cuDNN's causal sliding window (keys (p - window, p]:
    `sliding_window_length = window`, jax's `local_window_size=(window - 1, 0)`) with its fp32 softmax
    stats, plus the sink keys before the window by `sink_part`, merged exactly by `lse_merge`."""
    _require_gpu("local_impl='cudnn'")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as _cudnn_sdpa

    dt = q.dtype if q.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    qs, ks, vs = (x.astype(dt)[None] for x in (q, k, v))
    out, stats = _cudnn_sdpa(qs, ks, vs, scale=float(scale), mask_type=MaskType.CAUSAL, qkv_layout="BTNH",
                             sliding_window_length=int(window), return_residual=True)
    o_w, l_w = out[0].astype(jnp.float32), stats[0].T.astype(jnp.float32)
    if sink == 0:
        return o_w.astype(q.dtype), l_w
    from pallas_kernels.lse_merge.api import lse_merge

    o_s, l_s = sink_part(qs[0], ks[0], vs[0], sink=sink, window=window, scale=scale)
    return lse_merge(jnp.stack([o_w, o_s]), jnp.stack([l_w, l_s]), out_dtype=q.dtype)
