"""Static block-table rewrite, Pallas (Triton lowering; interpret on CPU).

One program per (seq, layer, head) unit compacts in place, `chunk` slots at a time: selected indices are
ascending and unique, so sel[m] >= m and a chunk's sources are never earlier chunks' destinations; inside
a chunk a barrier orders every read before any write. Lanes past the kept pages repeat the last kept
slot's work (identical writes), so no masked stores are needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _kernel(cnt_ref, sel_ref, pt_ref, k_in, v_in, p_in, k_ref, v_ref, pos_ref, *,
            page_size: int, max_pages: int, chunk: int, barrier: bool):
    del k_in, v_in, p_in
    u = pl.program_id(0)
    cnt = cnt_ref[0]
    maxsel = sel_ref.shape[0]
    hi = (cnt + page_size - 1) // page_size * page_size
    lane = lax.broadcasted_iota(jnp.int32, (chunk,), 0)

    def body(c, carry):
        m = jnp.minimum(c * chunk + lane, hi - 1)
        valid = m < cnt
        sel = sel_ref[jnp.minimum(m, maxsel - 1)]
        src_idx = jnp.where(valid, sel, m)
        src = pt_ref[u * max_pages + src_idx // page_size] * page_size + src_idx % page_size
        dst = pt_ref[u * max_pages + m // page_size] * page_size + m % page_size
        k = k_ref[src]
        v = v_ref[src]
        pos = jnp.where(valid, pos_ref[src], -1)
        if barrier:
            plt.debug_barrier()
        k_ref[dst] = k
        v_ref[dst] = v
        pos_ref[dst] = pos
        if barrier:
            plt.debug_barrier()
        return carry

    lax.fori_loop(0, pl.cdiv(hi, chunk), body, 0)


@functools.partial(jax.jit, static_argnames=("chunk", "interpret"), donate_argnums=(0, 1, 2))
def rewrite_pallas(k_pages, v_pages, slot_pos, page_table, lengths, sel_idx, sel_count, *,
                   chunk: int = 64, interpret: bool = False):
    """Pallas version of `reference.rewrite` (same contract); the pools are donated and updated in place."""
    from pallas_kernels.rewrite.reference import release_and_tables

    n, p, d = k_pages.shape
    mp = page_table.shape[-1]
    maxsel = sel_idx.shape[-1]
    u = sel_count.size
    kf, vf, pf = k_pages.reshape(n * p, d), v_pages.reshape(n * p, d), slot_pos.reshape(n * p)
    cnt = sel_count.reshape(u, 1).astype(jnp.int32)
    sel = sel_idx.reshape(u, maxsel).astype(jnp.int32)
    pt = jnp.maximum(page_table, 0).reshape(-1).astype(jnp.int32)
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)
    kf, vf, pf = pl.pallas_call(
        functools.partial(_kernel, page_size=p, max_pages=mp, chunk=chunk, barrier=not interpret),
        grid=(u,),
        in_specs=[pl.BlockSpec((None, 1), lambda i: (i, 0)), pl.BlockSpec((None, maxsel), lambda i: (i, 0)),
                  full(pt), full(kf), full(vf), full(pf)],
        out_specs=[full(kf), full(vf), full(pf)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (kf, vf, pf)],
        input_output_aliases={3: 0, 4: 1, 5: 2},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jaxkv_rewrite",
    )(cnt, sel, pt, kf, vf, pf)
    new_table, release, new_len = release_and_tables(page_table, lengths, sel_count, p)
    return kf.reshape(n, p, d), vf.reshape(n, p, d), pf.reshape(n, p), new_table, new_len, release
