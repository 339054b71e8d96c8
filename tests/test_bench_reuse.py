"""`python -m benchmarks.reuse --small` runs every reuse method against `full` on CPU and writes its
section."""

import json
import math

from benchmarks import reuse as bench


def test_bench_reuse_small_times_every_method_and_writes_its_section(tmp_path, capsys):
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
    assert "Command: `python -m benchmarks.reuse --small --repeats 2" in text
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
    w = bench.Workload(segments=8, segment_len=4096, prefix_len=16, suffix_len=256, page_size=16)
    assert w.prompt_tokens == 33040 and bench.fit_workload(w, 131072) == w
    fit = bench.fit_workload(w, 32768)
    assert fit.segment_len == 4048 and fit.max_model_len <= 32768 and fit.prompt_tokens < 32768
