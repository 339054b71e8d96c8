"""scripts/bench_reuse.py --small runs every reuse method against `full` on CPU and writes its section;
scripts/sweep_reuse_attention.py --small runs its sweep."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_reuse", ROOT / "scripts" / "bench_reuse.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_reuse"] = bench  # dataclasses resolve their module by name
    spec.loader.exec_module(bench)
    return bench


def test_bench_reuse_small_times_every_method_and_writes_its_section(tmp_path, capsys):
    bench = load_bench()
    out, log = tmp_path / "benchmarks.md", tmp_path / "reuse.json"
    other = "### Embedded model\n\nNot yet measured on a GPU.\n"
    out.write_text(f"# Benchmarks\n\n## {bench.SECTION}\n\nold intro\n\n{other}\n## Kernels\n\nkept\n")
    argv = ["--small", "--repeats", "2", "--ckpt-dir", str(tmp_path / "ckpt"), "--out", str(out), "--log",
            str(log)]
    (result,) = bench.main(argv)
    methods = bench.DEFAULT_METHODS.split(",")
    assert [r["method"] for r in result["rows"]] == methods
    for r in result["rows"]:
        assert math.isfinite(r["ttft_s"]) and r["ttft_s"] > 0 and len(r["runs_s"]) == 2
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["naive"]["recompute_kv"] == 0 and rows["reuse_full"]["recompute_kv"] == 1
    assert 0 < rows["cacheblend"]["recompute_kv"] < 1
    text = out.read_text()
    assert "python scripts/bench_reuse.py --small --repeats 2" in text
    assert "old intro" not in text and other in text and "## Kernels\n\nkept" in text  # other shape kept
    section = text[text.index(f"## {bench.SECTION}"):text.index("## Kernels")]
    for m in methods:
        assert f"\n| {m} | " in section
    assert json.loads(log.read_text())["shapes"][0]["rows"] == json.loads(json.dumps(result["rows"]))
    capsys.readouterr()
    again = bench.main(argv[:-4] + ["--methods", "full,naive"])
    assert "checkpoint reused" in capsys.readouterr().out
    assert [r["method"] for r in again[0]["rows"]] == ["full", "naive"]


def test_segments_shrink_to_fit_the_embedded_models_positions():
    bench = load_bench()
    w = bench.Workload(segments=8, segment_len=4096, prefix_len=16, suffix_len=256, page_size=16)
    assert w.prompt_tokens == 33040 and bench.fit_workload(w, 131072) == w
    fit = bench.fit_workload(w, 32768)
    assert fit.segment_len == 4048 and fit.max_model_len <= 32768 and fit.prompt_tokens < 32768


def test_sweep_reuse_attention_small_runs_and_reports_every_config():
    """Smoke test of the script's plumbing: on CPU every config dispatches to the jnp twin, so the per-config
    error check only has teeth on a GPU; the row picker's positions are checked exactly."""
    spec = importlib.util.spec_from_file_location("sweep_reuse_attention",
                                                  ROOT / "scripts" / "sweep_reuse_attention.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = sweep.main(["--small"])
    assert out["rows"] == int(0.15 * (256 - 16)) + 16 and out["default_ms"] > 0 and out["cudnn_full_ms"] > 0
    assert len(out["configs"]) >= 4 and out["best"] in out["configs"]
    for ms, err in out["configs"].values():
        assert ms > 0 and err < 1e-2
    # the split runs its twin prefix + twin diagonal here: bf16 output vs the paged twin's
    assert list(out["splits"]) == [16] and 0 < out["splits"][16][0] and out["splits"][16][1] < 1e-2
    pos = sweep.rows_at(1000, 0.2, 50, 0)
    assert pos.size == 190 + 50 and np.all(np.diff(pos) > 0) and pos[-1] == 999
