"""CPU smoke runs of the retrieval benchmarks (scripts/bench_retrieval.py --points,
scripts/bench_select.py)."""

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_estimate_interpolates_step_time():
    est = _script("bench_retrieval").estimate
    pts = [{"context": 1000, "ms_per_token_step": 1.0}, {"context": 3000, "ms_per_token_step": 3.0}]
    # contexts 1000..2999 in steps of 64: mean step time ~2 ms -> ~500 steps/s; flat outside the points
    assert est(pts, 1000, 3000) == pytest.approx(500, rel=0.02)
    assert est(pts, 3000, 4000) == pytest.approx(1e3 / 3.0)


def test_points_mode_times_both_methods(capsys):
    mod = _script("bench_retrieval")
    assert mod.main(["--shape", "small", "--batch", "2", "--budget", "16", "--page-size", "4",
                     "--points", "64", "--prompt", "64", "--new", "64", "--methods", "full,specontext",
                     "--point-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert '"preemptions": 0' in out  # the pool is sized for every row's whole context
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"full", "specontext"} <= set(rows)
    for m in ("full", "specontext"):
        ms = float(rows[m].split("|")[2])
        assert math.isfinite(ms) and ms > 0


def test_bench_select_small(capsys):
    assert _script("bench_select").main(["--small"]) == 0
    out = capsys.readouterr().out
    assert "select: radix, 2-bit digits" in out and "scores: in place (score_rows)" in out


def test_run_mode_stops_a_method_at_its_wall_limit(capsys):
    """`--max-wall-s`: a method that would run long (a thrashing pool) is stopped and reported unfinished,
    with what it did, instead of the whole bench hitting an outer timeout."""
    mod = _script("bench_retrieval")
    assert mod.main(["--shape", "small", "--batch", "2", "--budget", "16", "--page-size", "4",
                     "--prompt", "64", "--new", "64", "--methods", "full", "--max-wall-s", "0.001",
                     "--progress-s", "0"]) == 0
    out = capsys.readouterr()
    assert '"finished": false' in out.out and "(stopped)" in out.out
    assert "[full]" in out.err   # progress lines on stderr
