"""`python -m benchmarks.reuse --small` runs every reuse method against `full` on CPU and writes its
section."""

import json
import math

import pytest

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


def test_bench_reuse_tiers_move_the_bytes_each_method_reads_and_restart_from_the_store(tmp_path):
    out = tmp_path / "benchmarks.md"
    argv = ["--small", "--repeats", "1", "--ckpt-dir", str(tmp_path / "ckpt"),
            "--methods", "full,naive,redknot", "--tiers", "device,host,store", "--restart",
            "--store", str(tmp_path / "store"), "--out", str(out),
            "--layer-groups", "4", "--drop-page-cache", "--no-as-steps"]  # naive's pass, in layer groups
    (result,) = bench.main(argv)
    rows = {(r["method"], r["tier"]): r for r in result["rows"]}
    assert set(rows) == {("full", "device")} | {(m, t) for m in ("naive", "redknot")
                                                 for t in ("device", "host", "store")}
    w = result["workload"]
    segment_bytes = rows["naive", "host"]["promoted_bytes"]
    assert segment_bytes > 0 and rows["naive", "device"]["promoted_bytes"] == 0
    store = rows["naive", "store"]
    assert store["promoted_bytes"] == store["store_read_bytes"] == segment_bytes
    assert 0 < store["store_read_s"] < store["ttft_s"] and "store_read_s" not in rows["naive", "host"]
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert bench.drop_page_cache(str(tmp_path / "store")) == len(files) > 0
    assert rows["naive", "host"]["store_read_bytes"] == 0
    # segments promoted for the request: the pass runs in the layer groups asked for; on the device in one
    assert rows["naive", "host"]["pass_programs"] == rows["naive", "store"]["pass_programs"] > 1
    assert rows["naive", "device"]["pass_programs"] == 1
    promoting = [(m, t) for m in ("naive", "redknot") for t in ("host", "store")]
    assert all(rows[key]["host_before_program_s"] > 0 for key in promoting)
    # RedKnot promotes only its local heads (the small model's head-class map has global heads)
    assert 0 < rows["redknot", "host"]["promoted_bytes"] < segment_bytes
    r = result["restart"]
    assert r["restored"] == w["segments"] and r["first_token_s"] > 0
    text = out.read_text()
    assert "host before the first program (ms)" in text and "store read (GB/s)" in text
    assert "| naive | store |" in text and "Restart: a second engine on the same store" in text
    with pytest.raises(SystemExit):
        bench.main(["--small", "--tiers", "disk"])


def test_bench_reuse_unprefilled_segments_time_the_pinned_host_path(tmp_path):
    argv = ["--small", "--repeats", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--methods", "naive",
            "--tiers", "host", "--layer-groups", "2", "--pinned-host", "--unprefilled-segments",
            "--no-as-steps"]
    (result,) = bench.main(argv)
    (row,) = result["rows"]
    assert row["tier"] == "host" and row["pass_programs"] == 2 and row["promoted_bytes"] > 0
    assert 0 < row["host_before_program_s"] < row["ttft_s"]
    with pytest.raises(SystemExit):
        bench.main(argv + ["--tiers", "store"])


def test_bench_reuse_as_steps_times_both_paths_of_each_method(capsys):
    from benchmarks import reuse_as_steps

    result = reuse_as_steps.main(["--small", "--repeats", "1"])
    assert set(result["rows"]) == {"naive", "epic", "cacheblend", "sparsex"}
    assert all(r["pass_ms"] > 0 and r["steps_ms"] > 0 for r in result["rows"].values())
    out = capsys.readouterr().out
    assert "python -m benchmarks.reuse_as_steps --small --repeats 1" in out and "| sparsex |" in out
