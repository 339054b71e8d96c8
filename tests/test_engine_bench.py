"""scripts/bench_e2e.py --small runs on CPU against transformers and writes its section."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_e2e_small_writes_its_table(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = bench  # dataclasses resolve their module by name
    spec.loader.exec_module(bench)
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Kernels\n\nkept\n")
    rows = bench.main(["--small", "--only", "batch,ttft,agree", "--out", str(out)])
    names = [r[1] for r in rows]
    assert any(n.startswith("batch 4x32->8: decode step") for n in names)
    assert any(n.startswith("ttft 1x64->1") for n in names)
    agree = next(r for r in rows if r[1].startswith("fp32 greedy agreement"))
    assert agree[2] == "1.000"  # same weights, fp32: jaxkv and transformers pick the same tokens
    text = out.read_text()
    assert "## Kernels\n\nkept" in text and "## End to end (engine vs transformers)" in text
    assert "python scripts/bench_e2e.py --small" in text
    out.write_text(out.read_text().replace("## Kernels", "### An earlier run\n\nhistory\n\n## Kernels"))
    # a rerun replaces its own section's lead only
    bench.main(["--small", "--only", "ttft", "--out", str(out)])
    text = out.read_text()
    assert text.count("## End to end") == 1 and "kept" in text
    assert "### An earlier run\n\nhistory" in text and text.count("python scripts/bench_e2e.py --small") == 1


def test_bench_policy_warm_run_compiles_what_the_timed_run_needs():
    # A policy's warm-up run is shorter than the timed one (--policy-warm-new) but must build the same
    # engine shape (max_model_len sizes the device page tables): otherwise the timed run compiles.
    spec = importlib.util.spec_from_file_location("bench_policy", ROOT / "scripts" / "bench_policy.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_policy"] = bench
    spec.loader.exec_module(bench)
    rows = bench.main(["--small", "--methods", "full,hardkv@0.25", "--policy-warm-new", "8"])
    assert [r["method"] for r in rows] == ["full", "hardkv@0.25"]
    assert all(r["tokens"] == 4 * 48 for r in rows)
    assert rows[1]["compressions"] > 0
    assert [r["compiled_in_timed_run"] for r in rows] == [0, 0]
