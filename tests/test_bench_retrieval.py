"""CPU smoke runs of the retrieval benchmark (`python -m benchmarks.retrieval`: --points, a run stopped at
its wall limit)."""

import math

import pytest

from benchmarks import retrieval


def test_estimate_interpolates_step_time():
    est = retrieval.estimate
    pts = [{"context": 1000, "ms_per_token_step": 1.0}, {"context": 3000, "ms_per_token_step": 3.0}]
    # contexts 1000..2999 in steps of 64: mean step time ~2 ms -> ~500 steps/s; flat outside the points
    assert est(pts, 1000, 3000) == pytest.approx(500, rel=0.02)
    assert est(pts, 3000, 4000) == pytest.approx(1e3 / 3.0)


def test_points_mode_times_both_methods(capsys):
    assert retrieval.main(["--shape", "small", "--batch", "2", "--budget", "16", "--page-size", "4",
                           "--points", "64", "--prompt", "64", "--new", "64", "--methods", "full,specontext",
                           "--point-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert '"preemptions": 0' in out  # the pool is sized for every row's whole context
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"full", "specontext"} <= set(rows)
    for m in ("full", "specontext"):
        ms = float(rows[m].split("|")[2])
        assert math.isfinite(ms) and ms > 0


def test_run_mode_stops_a_method_at_its_wall_limit(capsys):
    """`--max-wall-s`: a method that would run long (a thrashing pool) is stopped and reported unfinished,
    with what it did, instead of the whole bench hitting an outer timeout."""
    assert retrieval.main(["--shape", "small", "--batch", "2", "--budget", "16", "--page-size", "4",
                           "--prompt", "64", "--new", "64", "--methods", "full", "--max-wall-s", "0.001",
                           "--progress-s", "0"]) == 0
    out = capsys.readouterr()
    assert '"finished": false' in out.out and "(stopped)" in out.out
    assert "[full]" in out.err   # progress lines on stderr
