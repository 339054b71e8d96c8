"""`python -m benchmarks.e2e --small` runs on CPU against transformers and writes its section; the policy
benchmark's warm-up run compiles what its timed run needs."""

from benchmarks import e2e, policy


def test_bench_e2e_small_writes_its_table(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\n## Kernels\n\nkept\n")
    rows = e2e.main(["--small", "--only", "batch,ttft,agree", "--out", str(out)])
    names = [r[1] for r in rows]
    assert any(n.startswith("batch 4x32->8: decode step") for n in names)
    assert any(n.startswith("ttft 1x64->1") for n in names)
    agree = next(r for r in rows if r[1].startswith("fp32 greedy agreement"))
    assert agree[2] == "1.000"  # same weights, fp32: jaxkv and transformers pick the same tokens
    text = out.read_text()
    assert "## Kernels\n\nkept" in text and "## End to end (engine vs transformers)" in text
    assert "Command: `python -m benchmarks.e2e --small --only batch,ttft,agree --out" in text
    out.write_text(out.read_text().replace("## Kernels", "### An earlier run\n\nhistory\n\n## Kernels"))
    # a rerun replaces its own section's lead only
    e2e.main(["--small", "--only", "ttft", "--out", str(out)])
    text = out.read_text()
    assert text.count("## End to end") == 1 and "kept" in text
    assert "### An earlier run\n\nhistory" in text and text.count("python -m benchmarks.e2e --small") == 1


def test_bench_policy_warm_run_compiles_what_the_timed_run_needs():
    # A policy's warm-up run is shorter than the timed one (--policy-warm-new) but must build the same
    # engine shape (max_model_len sizes the device page tables): otherwise the timed run compiles.
    rows = policy.main(["--small", "--methods", "full,hardkv@0.25", "--policy-warm-new", "8"])
    assert [r["method"] for r in rows] == ["full", "hardkv@0.25"]
    assert all(r["tokens"] == 4 * 48 for r in rows)
    assert rows[1]["compressions"] > 0
    assert [r["compiled_in_timed_run"] for r in rows] == [0, 0]
