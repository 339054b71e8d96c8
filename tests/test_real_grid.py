"""`python -m benchmarks.real_grid`: the process queue leaves one log per process, resumes without rerunning
finished ones, and merges the logs into the tables, the summary and the plot."""

import json

from benchmarks import real_grid


def test_real_grid_runs_resumes_and_merges(tmp_path, capsys):
    out = tmp_path / "grid"
    argv = ["--model", "synthetic", "--tasks", "real_niah_single", "--contexts", "512", "--seeds", "3",
            "--num", "2", "--budgets", "0.5", "--jobs", "1", "--only", "quest", "--out-dir", str(out)]
    real_grid.main(argv)
    logs = sorted(p.name for p in out.glob("*.json") if p.name != "summary.json")
    assert logs == ["ours_512_3_quest.json"]
    log = json.loads((out / logs[0]).read_text())
    assert {r["cell"] for r in log["rows"]} == {"quest@0.5"} and len(log["rows"]) == 2
    table = (out / "table.md").read_text()
    assert "**512 tokens**" in table and "| quest | " in table and "(2)" in table
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["cell"], r["num"], r["seed"], r["context"]) for r in summary] == [("quest@0.5", 2, 3, 512)]
    assert (out / "accuracy_vs_budget.png").stat().st_size > 0
    capsys.readouterr()
    real_grid.main(argv)  # a finished log is not run again
    assert "0 processes to run (1 already logged)" in capsys.readouterr().out


def test_real_grid_jobs_cover_the_grid_and_leave_out_what_lacks_its_artefact():
    import argparse

    args = argparse.Namespace(model="m", tasks=["real_vt"], budgets="0.5", contexts=[2048, 4096],
                              seeds=[1, 2], num=1, retrieval_head=None, kvpress_python="py",
                              head_classes=None, hf_dir="hf", only=[], dtype="float32")
    names = [name for _, name, _ in real_grid.jobs(args)]
    assert len(names) == len(set(names))
    assert not any("specontext" in n or "redknot-map" in n for n in names)  # no head, no head classes
    per = len(real_grid.OURS) - 1 + len(real_grid.KVPRESS) + 1
    assert len(names) == 2 * 2 * per
    assert names[-4:] == [f"reuse_{c}_{s}.json" for c in (2048, 4096) for s in (1, 2)]  # reuse last
    args.retrieval_head, args.head_classes = "head", "hc.json"
    assert sum("specontext" in n or "redknot-map" in n for _, n, _ in real_grid.jobs(args)) == 8


def test_real_grid_keeps_another_dtype_in_its_own_logs_and_column(tmp_path):
    """A bfloat16 column (fast on a GPU) logs under its own names, passes --dtype to every process and is
    tabled apart from the float32 cells of the same context, never averaged with them."""
    import argparse

    args = argparse.Namespace(model="m", tasks=["real_vt"], budgets="0.5", contexts=[8192], seeds=[1], num=1,
                              retrieval_head=None, kvpress_python="py", head_classes=None, hf_dir="hf",
                              only=[], dtype="bfloat16")
    jobs = real_grid.jobs(args)
    assert all(name.endswith("_bfloat16.json") for _, name, _ in jobs)
    assert all(argv[argv.index("--dtype") + 1] == "bfloat16" for _, _, argv in jobs)
    row = {"side": "ours", "cell": "snapkv@0.5", "task": "real_vt", "index": 0, "tokens": [1]}
    for dtype, score in (("float32", 1.0), ("bfloat16", 0.0)):
        log = {"context": 8192, "seed": 1, "dtype": dtype, "rows": [row | {"score": score}]}
        (tmp_path / f"ours_8192_1_snapkv_{dtype}.json").write_text(json.dumps(log))
    md, _ = real_grid.press_table(tmp_path)
    assert "**8192 tokens**" in md and "**8192 bfloat16 tokens**" in md
    f32, bf16 = md.split("**8192 bfloat16 tokens**")  # float32 first, then the other dtype
    assert "1.000 / -" in f32 and "0.000 / -" in bf16
