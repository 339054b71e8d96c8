"""Implementation fallback is never silent: a WARNING off the GPU, an error on the GPU unless allowed."""

import logging

import jax
import pytest

from pallas_kernels import _dispatch
from pallas_kernels.head_class_prefill import api as hcp_api


def _refused():
    raise NotImplementedError("no lowering for this shape")


def _impls(calls=None):
    calls = [] if calls is None else calls

    def pallas():
        calls.append("pallas")
        _refused()

    def reference():
        calls.append("reference")
        return "reference-result"

    return {"pallas": pallas, "reference": reference}


@pytest.fixture
def fresh(monkeypatch):
    """Empty the once-only memory of warnings; no fallback override from the environment."""
    monkeypatch.setattr(_dispatch, "_warned", set())
    monkeypatch.delenv(_dispatch.FALLBACK_ENV, raising=False)


@pytest.fixture
def cpu_with_pallas_first(monkeypatch, fresh):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: False)
    monkeypatch.setattr(_dispatch, "default_order", lambda: ("pallas", "reference"))


def _fallback_records(caplog):
    return [r for r in caplog.records if r.name == "pallas_kernels" and r.levelno == logging.WARNING]


def test_fallback_logs_a_warning_once(cpu_with_pallas_first, caplog):
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    calls = []
    for _ in range(3):
        assert _dispatch.dispatch("fake_kernel", None, _impls(calls)) == "reference-result"
    assert calls == ["pallas", "reference"] * 3
    records = _fallback_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    msg = records[0].getMessage()
    assert "fake_kernel" in msg and "NotImplementedError" in msg and "'pallas'" in msg
    assert "'reference'" in msg


def test_fallback_warning_per_kernel_and_error_type(cpu_with_pallas_first, caplog):
    caplog.set_level(logging.WARNING, logger="pallas_kernels")

    def runtime_error():
        raise jax.errors.JaxRuntimeError("lowering failed")

    _dispatch.dispatch("kernel_a", None, _impls())
    _dispatch.dispatch("kernel_b", None, _impls())
    _dispatch.dispatch("kernel_a", None, {"pallas": runtime_error, "reference": lambda: 0})
    _dispatch.dispatch("kernel_a", None, {"pallas": runtime_error, "reference": lambda: 0})
    msgs = [r.getMessage() for r in _fallback_records(caplog)]
    assert len(msgs) == 3, msgs
    assert sum("kernel_a" in m for m in msgs) == 2 and sum("kernel_b" in m for m in msgs) == 1
    assert any("kernel_a" in m and "JaxRuntimeError" in m for m in msgs)


def test_no_warning_when_the_first_implementation_runs(cpu_with_pallas_first, caplog):
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    impls = {"pallas": lambda: "pallas-result", "reference": lambda: "reference-result"}
    assert _dispatch.dispatch("fake_kernel", None, impls) == "pallas-result"
    assert _fallback_records(caplog) == []


def test_pinned_implementation_does_not_fall_back(cpu_with_pallas_first):
    with pytest.raises(NotImplementedError):
        _dispatch.dispatch("fake_kernel", "pallas", _impls())


def test_cpu_default_order_is_the_twin_only(monkeypatch, fresh, caplog):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: False)
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    calls = []
    assert _dispatch.dispatch("fake_kernel", None, _impls(calls)) == "reference-result"
    assert calls == ["reference"] and _fallback_records(caplog) == []


def test_gpu_pallas_failure_raises(monkeypatch, fresh):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    assert _dispatch.default_order() == ("pallas", "reference")
    calls = []
    with pytest.raises(RuntimeError, match=r"fake_kernel.*JAXKV_ALLOW_KERNEL_FALLBACK") as info:
        _dispatch.dispatch("fake_kernel", None, _impls(calls))
    assert isinstance(info.value.__cause__, NotImplementedError)
    assert calls == ["pallas"]            # the twin never ran


def test_gpu_pallas_failure_falls_back_when_allowed(monkeypatch, fresh, caplog):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setenv(_dispatch.FALLBACK_ENV, "1")
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    assert _dispatch.dispatch("fake_kernel", None, _impls()) == "reference-result"
    msgs = [r.getMessage() for r in _fallback_records(caplog)]
    assert len(msgs) == 1 and "fake_kernel" in msgs[0]


@pytest.mark.parametrize("value", ["0", "", "yes"])
def test_only_the_value_1_allows_the_gpu_fallback(monkeypatch, fresh, value):
    monkeypatch.setattr(_dispatch, "on_gpu", lambda: True)
    monkeypatch.setenv(_dispatch.FALLBACK_ENV, value)
    with pytest.raises(RuntimeError):
        _dispatch.dispatch("fake_kernel", None, _impls())


def test_head_class_prefill_choice_logs_skipped_candidates(monkeypatch, fresh, caplog):
    """A candidate that does not compile is logged once; the choice itself is unchanged."""
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    monkeypatch.setattr(hcp_api, "_order", lambda kind, dtype: ("mosaic", "cudnn", "pallas", "reference"))
    errs = {"mosaic": "NotImplementedError: wgmma\nneeds sm_90", "cudnn": "JaxRuntimeError: no cuDNN",
            "pallas": None}
    monkeypatch.setattr(hcp_api, "_compiles", lambda kind, cand, *a: errs[cand])
    q = k = type("A", (), {"shape": (4, 2, 8), "dtype": "float32"})()
    for _ in range(2):
        assert hcp_api._choose("global", None, q, k, (0, 0), (0, 0), 1.0, True) == "pallas"
    msgs = [r.getMessage() for r in _fallback_records(caplog)]
    assert len(msgs) == 2, msgs
    assert all("head_class_prefill" in m and "'pallas'" in m for m in msgs)
    assert any("'mosaic'" in m and "NotImplementedError" in m and "\n" not in m for m in msgs)
    assert any("'cudnn'" in m and "JaxRuntimeError" in m for m in msgs)
    assert hcp_api._choose("global", "cudnn", q, k, (0, 0), (0, 0), 1.0, True) == "cudnn"  # pinned


def test_head_class_prefill_no_warning_when_the_first_candidate_compiles(monkeypatch, fresh, caplog):
    caplog.set_level(logging.WARNING, logger="pallas_kernels")
    monkeypatch.setattr(hcp_api, "_order", lambda kind, dtype: ("pallas", "reference"))
    monkeypatch.setattr(hcp_api, "_compiles", lambda kind, cand, *a: None)
    q = k = type("A", (), {"shape": (4, 2, 8), "dtype": "float32"})()
    assert hcp_api._choose("local", None, q, k, (0, 0), (1, 1), 1.0, True) == "pallas"
    assert _fallback_records(caplog) == []


def test_head_class_prefill_decides_once_whatever_the_prompt_length(monkeypatch, fresh):
    """The implementation is decided on a probe of `PROBE_TOKENS` tokens: prompts of every length share one
    probe per head class (compiling a probe per token bucket stalled the tracing of every fresh step)."""
    monkeypatch.setattr(hcp_api, "_order", lambda kind, dtype: ("mosaic", "reference"))
    probes = []

    def compiles(kind, cand, shapes, *rest):
        probes.append((kind, cand, shapes))
        return None

    monkeypatch.setattr(hcp_api, "_compiles", compiles)
    for t in (8, 300, 4096, 32768):
        q = type("A", (), {"shape": (t, 4, 64), "dtype": "bfloat16"})()
        k = type("A", (), {"shape": (t, 2, 64), "dtype": "bfloat16"})()
        assert hcp_api._choose("global", None, q, k, (0, 0), (0, 0), 1.0, False) == "mosaic"
    n = hcp_api.PROBE_TOKENS
    assert {p[2] for p in probes} == {((n, 4, 64), (n, 2, 64), (n, 2, 64))}
