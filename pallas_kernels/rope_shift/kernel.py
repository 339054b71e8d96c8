"""RoPE shift + page copy, Pallas (Triton lowering; interpret on CPU). One program = `block` pairs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(src_ref, dst_ref, delta_ref, freq_ref, k_in, v_in, pos_in, k_ref, v_ref, pos_ref, *, style: str):
    # k_ref is the pool viewed [N, P, 2, D/2] (neox halves) or [N, P, D/2, 2] (gptj pairs); padding
    # entries arrive as a delta-0 self-copy of a source page (exact and race-free), so no masks.
    del k_in, v_in, pos_in                      # aliased to the outputs
    src = src_ref[...]                          # [B]
    dst = dst_ref[...]
    delta = delta_ref[...]
    ang = delta.astype(jnp.float32)[:, None, None] * freq_ref[...].astype(jnp.float32)[None, None, :]
    c, s = jnp.cos(ang), jnp.sin(ang)           # [B, 1, D/2]
    if style == "neox":
        x1 = k_ref[src, :, 0, :].astype(jnp.float32)
        x2 = k_ref[src, :, 1, :].astype(jnp.float32)
        k_ref[dst, :, 0, :] = (x1 * c - x2 * s).astype(k_ref.dtype)
        k_ref[dst, :, 1, :] = (x2 * c + x1 * s).astype(k_ref.dtype)
    else:
        x1 = k_ref[src, :, :, 0].astype(jnp.float32)
        x2 = k_ref[src, :, :, 1].astype(jnp.float32)
        k_ref[dst, :, :, 0] = (x1 * c - x2 * s).astype(k_ref.dtype)
        k_ref[dst, :, :, 1] = (x2 * c + x1 * s).astype(k_ref.dtype)
    v_ref[dst] = v_ref[src]
    pos = pos_ref[src]
    pos_ref[dst] = jnp.where(pos >= 0, pos + delta[:, None], -1)


@functools.partial(jax.jit, static_argnames=("style", "block", "interpret"), donate_argnums=(0, 1, 2))
def rope_shift_pallas(k_pages, v_pages, slot_pos, src_pages, dst_pages, deltas, inv_freq, *,
                      style: str = "neox", block: int = 4, interpret: bool = False):
    """Pallas version of `reference.rope_shift`; pools are donated and updated in place."""
    if style not in ("neox", "gptj"):
        raise ValueError(f"style must be 'neox' or 'gptj', got {style!r}")
    n, page, d = k_pages.shape
    m = src_pages.shape[0]
    mp = pl.cdiv(m, block) * block
    pad = lambda x, val: jnp.pad(x.astype(jnp.int32), (0, mp - m), constant_values=val)
    src, dst, delta = pad(src_pages, -1), pad(dst_pages, 0), pad(deltas, 0)
    ok = src >= 0
    anchor = jnp.where(jnp.any(ok), src[jnp.argmax(ok)], 0)   # a source page: rewriting it is benign
    src, dst, delta = jnp.where(ok, src, anchor), jnp.where(ok, dst, anchor), jnp.where(ok, delta, 0)
    kv = k_pages.reshape((n, page, 2, d // 2) if style == "neox" else (n, page, d // 2, 2))
    vec = pl.BlockSpec((block,), lambda i: (i,))
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)
    k_out, v_out, pos_out = pl.pallas_call(
        functools.partial(_kernel, style=style),
        grid=(mp // block,),
        in_specs=[vec, vec, vec, full(inv_freq), full(kv), full(v_pages), full(slot_pos)],
        out_specs=[full(kv), full(v_pages), full(slot_pos)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (kv, v_pages, slot_pos)],
        input_output_aliases={4: 0, 5: 1, 6: 2},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxkv_rope_shift",
    )(src, dst, delta, inv_freq.astype(jnp.float32), kv, v_pages, slot_pos)
    return k_out.reshape(n, page, d), v_out, pos_out
