"""Head-class prefill of a fresh prompt: global heads through a dense causal flash kernel, local heads
through the paged kernel's sink + window page ranges.

`head_class_prefill(q, k, v, sink, window, *, scale, global_impl=None, local_impl=None, interpret=None)
-> (out [T, Hq, D] q.dtype, lse [T, Hq] float32)`, same semantics as `reference.head_class_prefill`.

The KV heads are split by class (static: `window[h] == 0` is global) and each class runs on its own head
subset, gathered by static slices and concatenated back in head order; a local head never attends over
the full context.

* global heads, `global_impl`: "mosaic" (Pallas Mosaic GPU FlashAttention-3, dense.py), "cudnn" (cuDNN flash
  attention, dense.py), "pallas" (the paged kernel over the contiguous K/V viewed as pages, identity page
  table), "reference" (the jnp twin on the subset).
* local heads, `local_impl`: "pallas" (the paged kernel with `ordered=True`, one split: each query block
  reads only its sink pages and the pages of its window) or "reference".

`None` picks the first implementation of the order that compiles for these shapes: global mosaic, cudnn,
pallas, reference on a GPU (16-bit inputs; fp32 inputs skip mosaic and cudnn, which compute in 16 bits);
local pallas, reference on a GPU; the twin elsewhere. The choice is made by compiling the candidate
ahead of time on abstract shapes, so it also holds under an outer `jax.jit`, where a lowering failure could
not be caught at trace time. The probe has `PROBE_TOKENS` tokens whatever the prompt's length (every
candidate pads or tiles the length itself; what makes one fail is the device, the head size, the dtype or
the toolchain), so a process compiles one probe per head class, not one per token bucket: a probe of
FlashAttention-3 is ~3.4 s of XLA on the tracing thread (H100), and a start that traced 41 RedKnot passes
and the fresh-prompt steps compiled 41 of them, 141 s, while every compile thread waited for programs.
A candidate that does not compile is skipped with a WARNING on the "pallas_kernels" logger (once per
class, candidate and error type). Naming an implementation pins it (no fallback).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import resolve_interpret, warn_once
from pallas_kernels.head_class_prefill import dense
from pallas_kernels.head_class_prefill.reference import head_class_prefill as _twin

GLOBAL_IMPLS = ("mosaic", "cudnn", "pallas", "reference")
LOCAL_IMPLS = ("cudnn", "pallas", "reference")
PAGE_SIZE = 16          # page size of the contiguous K/V viewed as pages (paged-kernel paths)
LOCAL_TILES = (32, 2)   # local heads' (block_q, pages_per_block); H200 sweep in docs/kernels.md section 6
LOCAL_LAUNCH = (8, 3)   # local heads' (num_warps, num_stages) for those 128-row tiles (same sweep)


# ----------------------------------------------------------------------------------------------- helpers

def _paged(q, k, v, sink, window, *, scale, interpret, num_splits, block_q=None, pages_per_block=None,
           launch=(None, None)):
    """The paged kernel over one sequence's contiguous K/V: head h's pages are [h*npg, (h+1)*npg)."""
    from pallas_kernels.paged_attention.api import paged_attention

    t, _, d = q.shape
    hk = k.shape[1]
    p = PAGE_SIZE
    npg = -(-t // p)
    tp = npg * p

    def pages(x):
        return jnp.pad(x, ((0, tp - t), (0, 0), (0, 0))).transpose(1, 0, 2).reshape(hk * npg, p, d)

    pos = jnp.arange(tp, dtype=jnp.int32)
    slot_pos = jnp.tile(jnp.where(pos < t, pos, -1).reshape(npg, p), (hk, 1))
    page_table = jnp.arange(hk * npg, dtype=jnp.int32).reshape(1, hk, npg)
    lengths = jnp.full((1, hk), t, jnp.int32)
    q_seq = jnp.zeros((t,), jnp.int32)
    q_pos = jnp.arange(t, dtype=jnp.int32)
    return paged_attention(q, pages(k), pages(v), slot_pos, page_table, lengths, q_seq, q_pos,
                           jnp.asarray(sink, jnp.int32), jnp.asarray(window, jnp.int32), scale=scale,
                           implementation="pallas", interpret=interpret, ordered=True, num_splits=num_splits,
                           block_q=block_q, pages_per_block=pages_per_block, num_warps=launch[0],
                           num_stages=launch[1])


def _run_class(kind: str, impl: str, q, k, v, sink, window, *, scale, interpret,
               local_kernel=(None, None, None, None)):
    """One head class on its own head subset -> (out, lse). `local_kernel` = the local heads' paged-kernel
    (block_q, pages_per_block, num_warps, num_stages)."""
    if impl == "reference":
        return _twin(q, k, v, sink, window, scale=scale)
    if impl == "pallas":
        # local heads: sink + window fit one split; global heads: the kernel's split-K default
        bq, ppb, nw, ns = local_kernel if kind == "local" else (None,) * 4
        return _paged(q, k, v, sink, window, scale=scale, interpret=interpret,
                      num_splits=1 if kind == "local" else None, block_q=bq, pages_per_block=ppb,
                      launch=(nw, ns))
    if impl == "mosaic":
        return dense.mosaic_causal(q, k, v, scale=scale)
    if impl == "cudnn" and kind == "local":
        return _by_config(dense.cudnn_local, q, k, v, sink, window, scale=scale)
    if impl == "cudnn":
        return dense.cudnn_causal(q, k, v, scale=scale)
    raise AssertionError(impl)


def _by_config(fn, q, k, v, sink, window, *, scale):
    """Run `fn(q, k, v, sink=, window=)` once per run of heads sharing one (sink, window); concat by head."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for (sk, wd), start, n in _runs(list(zip(sink, window))):
        o, l_ = fn(q[:, start * g:(start + n) * g], k[:, start:start + n], v[:, start:start + n], sink=sk,
                   window=wd, scale=scale)
        outs.append(o)
        lses.append(l_)
    if len(outs) == 1:
        return outs[0], lses[0]
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _runs(flags):
    """Maximal runs of equal values: [(value, start, length)]."""
    out = []
    for i, f in enumerate(flags):
        if out and out[-1][0] == f:
            out[-1][2] += 1
        else:
            out.append([f, i, 1])
    return [tuple(r) for r in out]


def _heads(x, kv_heads, group: int):
    """Static gather of the query (group > 1) or KV heads of `kv_heads` along axis 1, by slices."""
    idx = list(kv_heads)
    if idx == list(range(x.shape[1] // group)):
        return x
    parts, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(x[:, idx[i] * group:(idx[j] + 1) * group])
        i = j + 1
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


# ------------------------------------------------------------------------------------ implementation choice

# Names the global heads' implementation tried first (else the `GLOBAL_IMPLS` order): "cudnn" compiles a
# program with a prefill in less time than "mosaic", whose kernels are lowered in Python and compiled to LLVM
# with the program; the two kernels tie at 32K (docs/kernels.md).
GLOBAL_FIRST_ENV = "JAXKV_PREFILL_GLOBAL_IMPL"


def global_first() -> str | None:
    """The implementation `GLOBAL_FIRST_ENV` names first (None: unset); an unknown name raises ValueError."""
    name = os.environ.get(GLOBAL_FIRST_ENV, "").strip()
    if not name:
        return None
    if name not in GLOBAL_IMPLS:
        raise ValueError(f"{GLOBAL_FIRST_ENV}={name!r}: must be one of {GLOBAL_IMPLS}")
    return name


def _order(kind: str, dtype) -> tuple[str, ...]:
    if jax.default_backend() != "gpu":
        return ("reference",)
    if kind == "local":
        return ("pallas", "reference")
    if jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        first = global_first()
        return (first,) + tuple(i for i in GLOBAL_IMPLS if i != first) if first else GLOBAL_IMPLS
    return ("pallas", "reference")


@functools.lru_cache(maxsize=256)
def _compiles(kind, impl, shapes, dtype, sink, window, scale, interpret) -> str | None:
    """None if `impl` compiles for this class and these shapes, else the error (cached per shape: the probe's
    shapes, `PROBE_TOKENS` tokens)."""
    sds = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    fn = functools.partial(_run_class, kind, impl, sink=sink, window=window, scale=scale, interpret=interpret)
    try:
        jax.jit(fn).lower(*sds).compile()
    except Exception as e:  # noqa: BLE001 -- any failure to lower or compile means: next in order
        return f"{type(e).__name__}: {e}"
    return None


# Tokens of the probe that decides an implementation (module docstring).
PROBE_TOKENS = 512


# The implementation each head class ran with last in this process ("global" / "local" -> name): what a
# server reports once its prefill programs are traced (`chosen`).
_CHOSEN: dict[str, str] = {}


def chosen() -> dict[str, str]:
    """{"global" / "local": the implementation that class's prefill last traced with}, for the classes
    traced so far in this process."""
    return dict(_CHOSEN)


def _choose(kind, impl, q, k, sink, window, scale, interpret) -> str:
    _CHOSEN[kind] = impl = impl if impl is not None else _first_that_compiles(kind, q, k, sink, window, scale,
                                                                              interpret)
    return impl


def _first_that_compiles(kind, q, k, sink, window, scale, interpret) -> str:
    errors = []
    shapes = ((PROBE_TOKENS, *q.shape[1:]), (PROBE_TOKENS, *k.shape[1:]), (PROBE_TOKENS, *k.shape[1:]))
    for cand in _order(kind, q.dtype):
        err = None if cand == "reference" else _compiles(kind, cand, shapes, jnp.dtype(q.dtype), sink,
                                                          window, scale, interpret)
        if err is None:
            for failed, failed_err in errors:
                warn_once(("head_class_prefill", kind, failed, failed_err.split(":", 1)[0]),
                          "head_class_prefill: %s-head implementation %r did not compile (%s); using %r",
                          kind, failed, " ".join(failed_err.split())[:300], cand)
            return cand
        errors.append((cand, err))
    raise RuntimeError(f"head_class_prefill: no {kind} implementation compiled: "
                       f"{[f'{c}: {e[:300]}' for c, e in errors]}")


# --------------------------------------------------------------------------------------------- public API

def _validate(q, k, v, sink, window, global_impl, local_impl):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"head_class_prefill: {name} must be 3-D [T, H, D], got shape "
                             f"{getattr(x, 'shape', None)}")
    t, hq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"head_class_prefill: k and v shapes differ: {k.shape} vs {v.shape}")
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"head_class_prefill: k/v {k.shape} must be [T={t}, Hkv, D={d}] to match "
                         f"q {q.shape}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"head_class_prefill: num query heads {hq} is not a multiple of num KV heads {hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"head_class_prefill: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    try:
        sink = tuple(int(s) for s in sink)
        window = tuple(int(w) for w in window)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError("head_class_prefill: sink and window must be static sequences of Python ints "
                         "(head classes are static per layer)") from e
    if len(sink) != hkv or len(window) != hkv:
        raise ValueError(f"head_class_prefill: sink and window need one entry per KV head ({hkv}), "
                         f"got {len(sink)} and {len(window)}")
    if min(sink + window) < 0:
        raise ValueError(f"head_class_prefill: sink and window must be >= 0, got {sink}, {window}")
    if global_impl is not None and global_impl not in GLOBAL_IMPLS:
        raise ValueError(f"head_class_prefill: global_impl must be None or one of {GLOBAL_IMPLS}, "
                         f"got {global_impl!r}")
    if local_impl is not None and local_impl not in LOCAL_IMPLS:
        raise ValueError(f"head_class_prefill: local_impl must be None or one of {LOCAL_IMPLS}, "
                         f"got {local_impl!r}")
    return sink, window


def head_class_prefill(q, k, v, sink, window, *, scale, global_impl=None, local_impl=None, interpret=None,
                       local_block_q=None, local_pages_per_block=None, local_launch=None):
    """Causal prefill of one fresh sequence with per-KV-head classes -> (out [T, Hq, D], lse [T, Hq] f32).

    q [T, Hq, D], k/v [T, Hkv, D] at positions 0..T-1. sink, window: static tuples of Python ints, one per
    KV head; window 0 = global head (full causal attention), else query p sees key k iff k <= p and
    (k > p - window or k < sink). lse is the natural-log log-sum-exp of the scaled scores. Jit with
    `static_argnames=("sink", "window", "scale", "global_impl", "local_impl", "interpret")`.
    `local_block_q` / `local_pages_per_block` (static) tile the local heads' paged kernel (queries per block,
    pages of PAGE_SIZE keys per inner step); None = LOCAL_TILES. `local_launch` = (num_warps, num_stages) of
    that kernel (None = the paged kernel's prefill default).
    """
    sink, window = _validate(q, k, v, sink, window, global_impl, local_impl)
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = float(scale)
    interp = resolve_interpret(interpret)
    if t == 0:
        return jnp.zeros((0, hq, d), q.dtype), jnp.zeros((0, hq), jnp.float32)
    is_global = [w == 0 for w in window]
    local_kernel = (local_block_q or LOCAL_TILES[0], local_pages_per_block or LOCAL_TILES[1],
                    *(local_launch or LOCAL_LAUNCH))
    results = {}
    for kind, impl in (("global", global_impl), ("local", local_impl)):
        heads = [h for h in range(hkv) if is_global[h] == (kind == "global")]
        if not heads:
            continue
        qs, ks, vs = _heads(q, heads, g), _heads(k, heads, 1), _heads(v, heads, 1)
        sk, wd = tuple(sink[h] for h in heads), tuple(window[h] for h in heads)
        chosen = _choose(kind, impl, qs, ks, sk, wd, scale, interp)
        results[kind] = _run_class(kind, chosen, qs, ks, vs, sk, wd, scale=scale, interpret=interp,
                                   local_kernel=local_kernel)
    if len(results) == 1:
        return next(iter(results.values()))
    outs, lses, seen = [], [], {"global": 0, "local": 0}
    for glob, _, n in _runs(is_global):
        kind = "global" if glob else "local"
        a, b = seen[kind] * g, (seen[kind] + n) * g
        outs.append(results[kind][0][:, a:b])
        lses.append(results[kind][1][:, a:b])
        seen[kind] += n
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def check_gpu(t: int = 4096, *, seed: int = 0, verbose: bool = True):
    """Every global_impl available on this backend against the twin at the benchmark's head classes.

    Fresh random bf16 inputs, Hq=32, Hkv=8, D=128, head 0 global, heads 1..7 sink 64 + window 256.
    Returns {impl: (max_abs_err_out, max_abs_err_lse, passed)}; passed = out relative L2 error <= 2e-2 and
    lse max abs error <= 1e-2. An implementation that raises gets (nan, nan, False) and its error printed.
    """
    hq, hkv, d = 32, 8, 128
    sink, window = (0,) + (64,) * 7, (0,) + (256,) * 7
    scale = d ** -0.5
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (t, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (t, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (t, hkv, d), jnp.float32).astype(jnp.bfloat16)
    ref_out, ref_lse = jax.jit(functools.partial(_twin, sink=sink, window=window, scale=scale))(q, k, v)
    ref_out = ref_out.astype(jnp.float32)
    impls = (GLOBAL_IMPLS + ("cudnn+cudnn", "mosaic+cudnn") if jax.default_backend() == "gpu"
             else ("pallas", "reference"))
    fn = jax.jit(head_class_prefill, static_argnames=("sink", "window", "scale", "global_impl", "local_impl",
                                                      "interpret"))
    res = {}
    for impl in impls:
        try:
            gi, li = (impl.split("+") + [None])[:2]
            out, lse = fn(q, k, v, sink, window, scale=scale, global_impl=gi, local_impl=li)
            out = out.astype(jnp.float32)
            e_out = float(jnp.max(jnp.abs(out - ref_out)))
            rel = float(jnp.linalg.norm(out - ref_out) / jnp.linalg.norm(ref_out))
            e_lse = float(jnp.max(jnp.abs(lse - ref_lse)))
            ok = bool(rel <= 2e-2 and e_lse <= 1e-2 and out.shape == ref_out.shape)
            res[impl] = (e_out, e_lse, ok)
            if verbose:
                print(f"check_gpu T={t} {impl}: max|out err| {e_out:.3e} rel {rel:.3e} "
                      f"max|lse err| {e_lse:.3e} {'PASS' if ok else 'FAIL'}")
        except Exception as e:  # noqa: BLE001 -- report, do not stop the other implementations
            res[impl] = (float("nan"), float("nan"), False)
            if verbose:
                print(f"check_gpu T={t} {impl}: ERROR {type(e).__name__}: {str(e)[:500]}")
    return res
