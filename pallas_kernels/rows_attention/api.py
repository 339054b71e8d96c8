"""Public `rows_attention(q, k, v, q_pos, *, scale, implementation=None|"split"|"reference")`.

The rows a sparse reuse pass recomputes (SparseX, CacheBlend) sit at scattered, ascending positions of one
prompt and attend causally over all its keys. One paged kernel over the rows does not reach cuDNN's
efficiency on Hopper (H200, 5.2K rows over 33K keys: 8.9 ms a layer against ~2.4 ms for the same key pairs
inside cuDNN's causal prefill), so "split" cuts the work in two (docs/kernels.md, "Scattered rows"):

* the rows, in chunks of `chunk` consecutive rows; chunk j starts at a_j, the position of its first row
  rounded down to `page`;
* **prefix**: every row of chunk j attends to keys [0, a_j), unmasked: cuDNN flash attention with the
  chunks as segments of a ragged batch over the one K/V (prefix.py); the jnp twin elsewhere;
* **diagonal**: each row attends to keys [a_j, its position]: the paged kernel over the K/V viewed as
  head-major pages of `page` keys, one "sequence" per chunk whose page list starts at a_j (ordered: a query
  block reads pages up to its last position only) -- a small share of the pairs when rows are dense
  enough that a chunk spans a short range;
* the two parts merged by their log-sum-exps (lse_merge).

The arithmetic is the twin's up to the order of summation; both parts are exact attention over disjoint
key sets, so the split is exact for any row layout (only its speed depends on how the rows spread).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import dispatch, on_gpu, warn_once
from pallas_kernels.lse_merge.api import lse_merge
from pallas_kernels.paged_attention.api import paged_attention
from pallas_kernels.rows_attention import reference
from pallas_kernels.rows_attention.prefix import cudnn_prefix

# Rows per cuDNN segment, its tile height (H200, the whole split of one 8B layer: 64 rows 5.90 ms,
# 128 rows 3.49 ms, 256 rows 3.62 ms).
CHUNK = 128
PAGE = 16     # keys per page of the diagonal part's head-major view


def rows_attention(q, k, v, q_pos, *, scale: float, implementation: str | None = None,
                   chunk: int | None = None, page: int | None = None, prefix_impl: str | None = None,
                   diagonal_impl: str | None = None):
    """Row i of q [R, Hq, D] sits at position q_pos[i] (ascending; -1 = padding, only at the end) and attends
    to keys 0..q_pos[i] of k / v [T, Hkv, D] (key t at position t; Hq a multiple of Hkv).

    -> (out [R, Hq, D] in q.dtype, lse [R, Hq] float32 natural log); padding rows give 0 / -inf.
    implementation: "split" (above) or "reference" (the jnp twin); None: "split" on a GPU, else the twin.
    prefix_impl: "cudnn" | "reference" (None: cuDNN where it runs: GPU and 16-bit inputs);
    diagonal_impl: the paged kernel's implementation ("pallas" | "reference" | None).
    chunk / page: None reads CHUNK / PAGE at call time.
    """
    chunk = CHUNK if chunk is None else int(chunk)
    page = PAGE if page is None else int(page)
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rows_attention: q [R, Hq, D] and k, v [T, Hkv, D], got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"rows_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                         "KV heads")
    if q_pos.shape != q.shape[:1]:
        raise ValueError(f"rows_attention: q_pos must be [{q.shape[0]}], got {q_pos.shape}")
    q_pos = q_pos.astype(jnp.int32)
    impls = {
        "split": lambda: split_rows_attention(q, k, v, q_pos, scale=scale, chunk=chunk, page=page,
                                              prefix_impl=prefix_impl, diagonal_impl=diagonal_impl),
        "reference": lambda: reference.rows_attention(q, k, v, q_pos, scale=scale),
    }
    if implementation is None:
        implementation = "split" if jax.default_backend() == "gpu" else "reference"
    return dispatch("rows_attention", implementation, impls)


def chunk_starts(q_pos, chunk: int, page: int):
    """a_j [NC]: the first row's position of each chunk of `chunk` rows, rounded down to `page` (0 for an
    all-padding chunk)."""
    r = q_pos.shape[0]
    nc = -(-r // chunk)
    first = jnp.pad(q_pos, (0, nc * chunk - r), constant_values=-1)[::chunk]
    return (jnp.maximum(first, 0) // page) * page


def _prefix(qc, k, v, kv_len, *, scale, impl):
    impls = {"cudnn": lambda: cudnn_prefix(qc, k, v, kv_len, scale=scale),
             "reference": lambda: reference.prefix_attention(qc, k, v, kv_len, scale=scale)}
    if impl is None:
        try:
            return impls["cudnn"]()
        except NotImplementedError as e:  # off a GPU by design; on a GPU a lost fast path, said once
            if on_gpu():
                warn_once(("rows_attention prefix", str(e)), "rows_attention prefix: cuDNN attention cannot "
                          "run (%s); the jnp reference computes it (slower)", e)
            impl = "reference"
    return dispatch("rows_attention prefix", impl, impls)


def _diagonal(q, k, v, q_pos, starts, *, scale, chunk, page, impl):
    """Rows over keys [a_j, position]: the paged kernel on head-major pages, one sequence per chunk."""
    t, hkv, d = k.shape
    npg = -(-t // page)
    tp = npg * page

    def pages(x):   # [T, Hkv, D] -> [Hkv x npg, page, D]: page h * npg + m holds head h's keys m*page..
        return jnp.pad(x, ((0, tp - t), (0, 0), (0, 0))).transpose(1, 0, 2).reshape(hkv * npg, page, d)

    slot_pos = jnp.tile(jnp.arange(tp, dtype=jnp.int32).reshape(npg, page), (hkv, 1))
    first = (starts // page)[:, None, None]                              # [NC, 1, 1]
    m = jnp.arange(npg, dtype=jnp.int32)[None, None, :]
    head = (jnp.arange(hkv, dtype=jnp.int32) * npg)[None, :, None]
    page_table = head + jnp.minimum(first + m, npg - 1)                  # entries past the length: never read
    lengths = jnp.broadcast_to((t - starts)[:, None], (starts.shape[0], hkv)).astype(jnp.int32)
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    q_seq = jnp.where(q_pos >= 0, rows // chunk, -1)
    zeros = jnp.zeros((hkv,), jnp.int32)
    return paged_attention(q, pages(k), pages(v), slot_pos, page_table, lengths, q_seq, jnp.maximum(q_pos, 0),
                           zeros, zeros, scale=scale, implementation=impl, ordered=True, num_splits=1)


@functools.partial(jax.jit, static_argnames=("scale", "chunk", "page", "prefix_impl", "diagonal_impl"))
def split_rows_attention(q, k, v, q_pos, *, scale: float, chunk: int = CHUNK, page: int = PAGE,
                         prefix_impl: str | None = None, diagonal_impl: str | None = None):
    """The "split" implementation (module docstring)."""
    r, hq, d = q.shape
    nc = -(-r // chunk)
    starts = chunk_starts(q_pos, chunk, page)
    qc = jnp.pad(q, ((0, nc * chunk - r), (0, 0), (0, 0))).reshape(nc, chunk, hq, d)
    out_p, lse_p = _prefix(qc, k, v, starts, scale=scale, impl=prefix_impl)
    out_p = out_p.reshape(nc * chunk, hq, d)[:r]
    lse_p = jnp.where((starts > 0)[:, None, None], lse_p, -jnp.inf).reshape(nc * chunk, hq)[:r]
    out_d, lse_d = _diagonal(q, k, v, q_pos, starts, scale=scale, chunk=chunk, page=page, impl=diagonal_impl)
    out, lse = lse_merge(jnp.stack([out_p.astype(out_d.dtype), out_d]), jnp.stack([lse_p, lse_d]),
                         out_dtype=q.dtype)
    ok = q_pos >= 0
    return jnp.where(ok[:, None, None], out, 0).astype(q.dtype), jnp.where(ok[:, None], lse, -jnp.inf)
