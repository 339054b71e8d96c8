"""`benchmarks.eval_grid`'s equal-memory comparison: curves per method, interpolation in log memory, table."""

import numpy as np
import pytest

from benchmarks import eval_grid


@pytest.fixture(scope="module")
def grid():
    return eval_grid


def cell(task, method, acc, mb):
    return {"task": task, "context": 8192, "method": method, "rc": 0, "accuracy": acc,
            "kv_bytes_held": mb * 1e6}


def test_equal_memory_interpolates_in_log_memory(grid, tmp_path):
    cells = [cell("a", "full", 1.0, 64), cell("b", "full", 0.8, 64),
             cell("a", "snapkv@0.125", 0.6, 8), cell("b", "snapkv@0.125", 0.4, 8),
             cell("a", "snapkv@0.25", 0.8, 16), cell("b", "snapkv@0.25", 0.6, 16),
             # a method holding less than its nominal budget: 4 and 16 MB
             cell("a", "hardkv@0.125", 0.2, 4), cell("b", "hardkv@0.125", 0.2, 4),
             cell("a", "hardkv@0.25", 0.8, 16), cell("b", "hardkv@0.25", 0.8, 16),
             cell("a", "h2o@0.125", 0.5, 8)]                   # b failed: h2o is left out, not half-averaged
    curves = grid.memory_curves(cells)
    assert curves["full"] == [(64.0, 0.9)]
    assert curves["snapkv"] == [(8.0, pytest.approx(0.5)), (16.0, pytest.approx(0.7))]
    assert "h2o" not in curves
    # 8 MB lies halfway between 4 and 16 in log memory: (0.2 + 0.8) / 2
    assert grid.at_memory(curves["hardkv"], 8.0) == pytest.approx(0.5)
    assert grid.at_memory(curves["hardkv"], 2.0) is None and grid.at_memory(curves["full"], 64.0) is None
    table = grid.equal_memory_table(cells)
    rows = [r.split("|")[1:-1] for r in table.splitlines()[2:]]
    assert [float(r[0]) for r in rows] == [8.0, 16.0]
    names = [c.strip() for c in table.splitlines()[0].split("|")[2:-1]]
    col = 1 + names.index("hardkv")
    assert [float(rows[0][col]), float(rows[1][col])] == [0.5, 0.8]
    grid.write_budget_outputs(cells, tmp_path)
    assert (tmp_path / "accuracy_vs_memory.png").stat().st_size > 0
    assert (tmp_path / "equal_memory.md").read_text().startswith("| KV MB held")
    np.testing.assert_allclose(grid.at_memory(curves["snapkv"], 11.3137), 0.6, atol=1e-3)


def test_method_specs_with_policy_fields(grid):
    assert grid.split_method("hardkv@0.125:window=64:p=0.95") == ("hardkv", "0.125", ["window=64", "p=0.95"])
    assert grid.split_method("specontext:sink=4") == ("specontext", "", ["sink=4"])
    assert grid.line_and_budget("hardkv@0.125:window=64") == ("hardkv:window=64", 0.125)
    assert grid.line_and_budget("full") == ("full", None)
    with pytest.raises(SystemExit, match="key=value"):
        grid.split_method("snapkv:window")

    class A:
        out_dir, num, dtype, model = "/tmp/x", 4, "float32", None

    argv, out = grid.cell_argv("vt", 8192, "hardkv@0.125:window=64", 7, A)
    assert argv[argv.index("--budget") + 1] == "0.125" and argv[argv.index("--seed") + 1] == "7"
    assert argv[argv.index("--policy-arg") + 1] == "window=64"
    assert out.name == "vt_hardkv@0.125+window-64_8192_s7.json"


def test_draws_table_and_curves_over_seeds(grid):
    cells = []
    for seed, (acc_s, acc_h) in {1: (0.5, 0.7), 2: (0.7, 0.9)}.items():
        for task in ("a", "b"):
            cells += [dict(cell(task, "snapkv@0.125", acc_s, 8), seed=seed),
                      dict(cell(task, "snapkv@0.25", acc_s + 0.1, 16), seed=seed),
                      dict(cell(task, "hardkv@0.125:window=64", acc_h, 8), seed=seed),
                      dict(cell(task, "hardkv@0.25:window=64", acc_h + 0.1, 16), seed=seed)]
    table = grid.draws_table(cells)
    assert "| a | 8192 | snapkv@0.125 | 0.500 | 0.700 | **0.600** |" in table
    curves = grid.memory_curves(cells)  # every (task, seed) cell present: one point per budget
    assert curves["hardkv:window=64"] == [(8.0, pytest.approx(0.8)), (16.0, pytest.approx(0.9))]
    assert grid.at_memory(curves["snapkv"], 8.0) == pytest.approx(0.6)
    missing = [c for c in cells if not (c["seed"] == 2 and c["method"] == "snapkv@0.25" and c["task"] == "b")]
    assert len(grid.memory_curves(missing)["snapkv"]) == 1  # an incomplete budget is left out
