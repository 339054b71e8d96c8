"""Head-class prefill: every implementation against the jnp twin and against the paged-attention twin.

Pallas paths run in interpret mode on CPU; Mosaic GPU and cuDNN only run where a GPU backend is present.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.head_class_prefill import api, dense
from pallas_kernels.head_class_prefill.api import head_class_prefill
from pallas_kernels.head_class_prefill.reference import head_class_prefill as twin
from pallas_kernels.paged_attention.reference import paged_attention as paged_reference

TOL = {np.float32: 2e-5, jnp.bfloat16: 2e-2}
SCALE = 0.3

CASES = [  # (T, Hkv, G, sink, window, global_impl, local_impl, dtype)
    (1, 2, 2, (0, 4), (0, 32), "pallas", "pallas", jnp.bfloat16),                  # one token
    (37, 4, 1, (0, 4, 0, 2), (0, 32, 0, 8), "pallas", "pallas", np.float32),       # interleaved classes
    (300, 2, 4, (4, 4), (32, 16), "pallas", "pallas", jnp.bfloat16),               # all local, windows cut
    (300, 4, 2, (0, 0, 0, 0), (0, 0, 0, 0), "pallas", "pallas", np.float32),       # all global
    (700, 4, 2, (0, 0, 4, 4), (0, 0, 32, 64), "reference", "pallas", jnp.bfloat16),  # ragged, GQA 2
    (130, 2, 2, (0, 4), (0, 16), "pallas", "reference", np.float32),               # ragged, twin locals
]


def _inputs(seed, t, hkv, g, d, dtype):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, hkv * g, d))
    k = rng.standard_normal((t, hkv, d))
    v = rng.standard_normal((t, hkv, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _paged_twin(q, k, v, sink, window, scale, p=16):
    """The paged-attention twin over the same K/V as pages of `p` slots (identity page table, ragged tail)."""
    t, hkv, d = k.shape
    n = -(-t // p)
    pad = ((0, n * p - t), (0, 0), (0, 0))
    kp = jnp.pad(k, pad).transpose(1, 0, 2).reshape(hkv * n, p, d)
    vp = jnp.pad(v, pad).transpose(1, 0, 2).reshape(hkv * n, p, d)
    pos = jnp.arange(n * p, dtype=jnp.int32)
    slot_pos = jnp.tile(jnp.where(pos < t, pos, -1), hkv).reshape(hkv * n, p)
    page_table = jnp.arange(hkv * n, dtype=jnp.int32).reshape(1, hkv, n)
    lengths = jnp.full((1, hkv), t, jnp.int32)
    return paged_reference(q, kp, vp, slot_pos, page_table, lengths, jnp.zeros((t,), jnp.int32),
                           jnp.arange(t, dtype=jnp.int32), jnp.asarray(sink, jnp.int32),
                           jnp.asarray(window, jnp.int32), scale=scale)


def _jit(fn, **static):
    return jax.jit(functools.partial(fn, **static))


def _close(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref_out = np.asarray(jnp.asarray(ref_out, jnp.float32))
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == np.float32
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(out))
    np.testing.assert_allclose(lse, ref_lse, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(out, ref_out, atol=TOL[dtype] * 2, rtol=TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-H{c[1]}-G{c[2]}-{c[5]}-{c[6]}-{np.dtype(c[7]).name}"
                                             for c in CASES])
def test_matches_twin_and_paged_twin(case):
    t, hkv, g, sink, window, gimpl, limpl, dtype = case
    q, k, v = _inputs(100 + CASES.index(case), t, hkv, g, 16, dtype)
    # jitted whole: one compile per program instead of one per eager op (halves the CPU test time)
    ref_out, ref_lse = _jit(twin, sink=sink, window=window, scale=SCALE)(q, k, v)
    p_out, p_lse = _jit(_paged_twin, sink=sink, window=window, scale=SCALE)(q, k, v)
    # the two twins agree (fp32 math on the same rounded inputs)
    _close(ref_out, ref_lse, p_out, p_lse, np.float32 if dtype == np.float32 else dtype)
    out, lse = _jit(head_class_prefill, sink=sink, window=window, scale=SCALE, global_impl=gimpl,
                    local_impl=limpl)(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    _close(out, lse, ref_out, ref_lse, dtype)
    _close(out, lse, p_out, p_lse, dtype)


def test_windows_cut():
    """The small windows of the cases really change the result (a local head differs from global)."""
    q, k, v = _inputs(1, 300, 2, 2, 16, np.float32)
    loc, _ = twin(q, k, v, (4, 4), (32, 32), scale=SCALE)
    glo, _ = twin(q, k, v, (0, 0), (0, 0), scale=SCALE)
    assert float(jnp.max(jnp.abs(loc[40:] - glo[40:]))) > 0.1
    np.testing.assert_allclose(np.asarray(loc[:32]), np.asarray(glo[:32]), atol=1e-6)   # inside the window


def test_reference_impls_and_default_are_the_twin():
    q, k, v = _inputs(2, 50, 2, 2, 8, np.float32)
    sink, window = (0, 2), (0, 8)
    ref = twin(q, k, v, sink, window, scale=SCALE)
    for kw in (dict(global_impl="reference", local_impl="reference"), {}):   # None -> twin off the GPU
        out, lse = head_class_prefill(q, k, v, sink, window, scale=SCALE, **kw)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref[0]), atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref[1]), atol=1e-6)


def test_jit_static_args():
    q, k, v = _inputs(3, 40, 4, 2, 8, jnp.bfloat16)
    sink, window = (0, 4, 4, 0), (0, 16, 16, 0)
    fn = jax.jit(head_class_prefill, static_argnames=("sink", "window", "scale", "global_impl", "local_impl",
                                                      "interpret"))
    out, lse = fn(q, k, v, sink, window, scale=SCALE, global_impl="reference", local_impl="reference")
    ref_out, ref_lse = twin(q, k, v, sink, window, scale=SCALE)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)


@pytest.mark.parametrize("t", [100, 256])
def test_mosaic_conversions_with_upstream_reference(t):
    """The scale / float16 / padding / log2-LSE conversions around attention_mgpu, checked on CPU with its
    own jnp reference (`attention_reference`, whose conventions its GPU test asserts the kernel matches)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as mg

    calls = []

    def fake_attention(q, k, v, cfg, save_residuals):
        assert q.dtype == k.dtype == v.dtype == jnp.float16 and save_residuals and cfg.causal
        assert q.shape[1] % (2 * cfg.block_q) == 0 and q.shape[1] % cfg.block_kv == 0
        calls.append(q.shape)
        out, (lse2,) = mg.attention_reference(q, k, v, causal=True, save_residuals=True)
        return out.astype(jnp.float16), (lse2,)

    q, k, v = _inputs(t, t, 2, 2, 64, jnp.bfloat16)
    cfg = mg.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    out, lse = dense.mosaic_call(fake_attention, cfg, q, k, v, scale=SCALE)
    assert calls == [(1, -(-t // 128) * 128, 4, 64)]
    ref_out, ref_lse = twin(q, k, v, (0, 0), (0, 0), scale=SCALE)
    _close(out, lse, ref_out, ref_lse, jnp.bfloat16)


def test_causal_lse_matches_twin():
    q, k, v = _inputs(6, 70, 2, 2, 16, jnp.bfloat16)
    _, ref_lse = twin(q, k, v, (0, 0), (0, 0), scale=SCALE)
    lse = dense.causal_lse(q, k, scale=SCALE, block=32)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-4)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks that mosaic/cudnn refuse off the GPU")
def test_the_global_implementation_named_first_leads_the_order(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv(api.GLOBAL_FIRST_ENV, raising=False)
    assert api._order("global", jnp.bfloat16) == api.GLOBAL_IMPLS
    monkeypatch.setenv(api.GLOBAL_FIRST_ENV, "cudnn")
    assert api._order("global", jnp.bfloat16) == ("cudnn", "mosaic", "pallas", "reference")
    assert api._order("global", jnp.float32) == ("pallas", "reference")  # fp32: no 16-bit kernels either way
    assert api._order("local", jnp.bfloat16) == ("pallas", "reference")
    monkeypatch.setenv(api.GLOBAL_FIRST_ENV, "flash")
    with pytest.raises(ValueError, match="JAXKV_PREFILL_GLOBAL_IMPL='flash'"):
        api._order("global", jnp.bfloat16)


def test_the_implementation_each_class_ran_with_is_reported():
    q = jnp.ones((8, 4, 16), jnp.float32)
    kv = jnp.ones((8, 2, 16), jnp.float32)
    head_class_prefill(q, kv, kv, (0, 2), (0, 4), scale=0.25)
    assert api.chosen() == {"global": "reference", "local": "reference"}  # the CPU's only choice
    head_class_prefill(q, kv, kv, (0, 0), (0, 0), scale=0.25, global_impl="pallas", interpret=True)
    assert api.chosen()["global"] == "pallas"  # a pinned implementation is what ran
    chosen = api.chosen()
    chosen["global"] = "x"
    assert api.chosen()["global"] == "pallas"  # a copy


def test_the_step_cache_keys_programs_by_the_global_implementation(monkeypatch):
    from jaxkv.engine.step_cache import environment

    monkeypatch.delenv(api.GLOBAL_FIRST_ENV, raising=False)
    unset = environment()
    monkeypatch.setenv(api.GLOBAL_FIRST_ENV, "cudnn")
    assert environment() != unset


def test_fallback_skips_what_does_not_compile(monkeypatch):
    """With the GPU order forced on CPU, mosaic and cudnn refuse (no GPU) and the Pallas kernel runs --
    also under an outer jit, where the choice is made by compiling ahead on abstract shapes."""
    monkeypatch.setattr(api, "_order", lambda kind, dtype: api.GLOBAL_IMPLS if kind == "global"
                        else api.LOCAL_IMPLS)
    seen, probe = {}, api._compiles

    def record(kind, impl, *rest):
        seen[(kind, impl)] = probe(kind, impl, *rest)
        return seen[(kind, impl)]

    monkeypatch.setattr(api, "_compiles", record)
    q, k, v = _inputs(4, 20, 2, 2, 16, np.float32)
    sink, window = (0, 2), (0, 8)
    out, lse = jax.jit(functools.partial(head_class_prefill, sink=sink, window=window, scale=SCALE))(q, k, v)
    ref_out, ref_lse = twin(q, k, v, sink, window, scale=SCALE)
    _close(out, lse, ref_out, ref_lse, np.float32)
    assert "NotImplementedError" in seen[("global", "mosaic")]
    assert "NotImplementedError" in seen[("global", "cudnn")]
    assert seen[("global", "pallas")] is None and seen[("local", "pallas")] is None
    assert "NotImplementedError" in seen[("local", "cudnn")]
    assert set(seen) == {("global", "mosaic"), ("global", "cudnn"), ("global", "pallas"), ("local", "cudnn"),
                         ("local", "pallas")}


@pytest.mark.parametrize("bad, match", [
    (dict(sink=(0,)), "one entry per KV head"),
    (dict(window=(0, 4, 8)), "one entry per KV head"),
    (dict(q_heads=3), "not a multiple"),
    (dict(k_len=9), "must be"),
    (dict(v_dim=4), "shapes differ"),
    (dict(window=(0, -1)), ">= 0"),
    (dict(global_impl="flash"), "global_impl"),
    (dict(local_impl="mosaic"), "local_impl"),
    (dict(q_ndim=2), "3-D"),
    (dict(k_dtype=jnp.bfloat16), "dtypes differ"),
])
def test_bad_input_raises(bad, match):
    q, k, v = _inputs(5, 10, 2, 2, 8, np.float32)
    if "q_heads" in bad:
        q = q[:, :bad["q_heads"]]
    if "k_len" in bad:
        k = k[:bad["k_len"]]
        v = v[:bad["k_len"]]
    if "v_dim" in bad:
        v = v[..., :bad["v_dim"]]
    if "q_ndim" in bad:
        q = q[0]
    if "k_dtype" in bad:
        k = k.astype(bad["k_dtype"])
    kw = dict(sink=bad.get("sink", (0, 2)), window=bad.get("window", (0, 4)))
    kw.update({n: bad[n] for n in ("global_impl", "local_impl") if n in bad})
    with pytest.raises(ValueError, match=match):
        head_class_prefill(q, k, v, scale=SCALE, **kw)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU / cuDNN need a GPU backend")
@pytest.mark.parametrize("t", [1000, 2048])
def test_gpu_global_impls(t):
    """Every global implementation against the twin at the benchmark's head classes (ragged and aligned T)."""
    res = api.check_gpu(t=t)
    failed = {impl: r for impl, r in res.items() if not r[2]}
    assert not failed, failed


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="Mosaic GPU / cuDNN need a GPU backend")
@pytest.mark.parametrize("impl", ["mosaic", "cudnn", "pallas"])
@pytest.mark.parametrize("t", [1, 37, 130, 640])
def test_gpu_global_impls_ragged(impl, t):
    """Ragged T (padding inside mosaic), interleaved classes, GQA 2, bf16, D = 128."""
    q, k, v = _inputs(t, t, 4, 2, 128, jnp.bfloat16)
    sink, window = (0, 4, 0, 8), (0, 32, 0, 64)
    ref_out, ref_lse = twin(q, k, v, sink, window, scale=128 ** -0.5)
    out, lse = head_class_prefill(q, k, v, sink, window, scale=128 ** -0.5, global_impl=impl)
    out, ref_out = np.asarray(out, np.float32), np.asarray(ref_out, np.float32)
    assert np.linalg.norm(out - ref_out) <= 2e-2 * np.linalg.norm(ref_out)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-2)


@pytest.mark.parametrize("t, sink, window", [(300, 4, 32), (50, 8, 64), (200, 0, 16)])
def test_window_plus_sink_decomposition(t, sink, window):
    """local_impl='cudnn' = sliding window (keys (p - window, p]) + sink keys before the window, merged by
    LSE; the window part comes from cuDNN on the GPU, here from the twin with sink 0 -- the sink part and
    the merge are the code under test."""
    from pallas_kernels.head_class_prefill import dense
    from pallas_kernels.lse_merge.api import lse_merge

    q, k, v = _inputs(7, t, 2, 2, 16, np.float32)
    o_w, l_w = twin(q, k, v, (0, 0), (window, window), scale=SCALE)
    o_s, l_s = dense.sink_part(q, k, v, sink=sink, window=window, scale=SCALE)
    out, lse = lse_merge(jnp.stack([o_w, o_s]), jnp.stack([l_w, l_s]), implementation="reference")
    ref_out, ref_lse = twin(q, k, v, (sink, sink), (window, window), scale=SCALE)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
    if sink and t > window + sink:   # the sink really contributes for queries past the window
        assert float(jnp.max(jnp.abs(o_w[window + sink:] - ref_out[window + sink:]))) > 1e-3
