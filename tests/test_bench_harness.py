"""`benchmarks.harness`: markdown sections replaced in place, the recorded command, shapes under both naming
schemes, timing and the head-class maps the benchmarks build."""

import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]


def test_write_section_replaces_the_lead_and_keeps_earlier_runs_and_other_sections(tmp_path):
    out = tmp_path / "sub" / "b.md"
    harness.write_section(out, "Kernels", "first")
    assert out.read_text() == "# Benchmarks\n\n## Kernels\n\nfirst\n"
    out.write_text(out.read_text() + "\n### An earlier run\n\nhistory\n\n## Other\n\nkept\n")
    harness.write_section(out, "Kernels", "second")
    text = out.read_text()
    assert "first" not in text and "## Kernels\n\nsecond\n" in text
    assert "### An earlier run\n\nhistory" in text and "## Other\n\nkept" in text
    harness.write_section(out, "Kernels", "third", keep_subsections=False)  # the whole section goes
    text = out.read_text()
    assert "history" not in text and "## Kernels\n\nthird\n\n## Other\n\nkept\n" in text
    harness.write_section(out, "New", "appended")
    assert out.read_text().endswith("## Other\n\nkept\n\n## New\n\nappended\n")


def test_markdown_table_and_command_line():
    assert harness.markdown_table(["a", "b"], [[1, "x y"]]) == "| a | b |\n|---|---|\n| 1 | x y |"
    assert harness.command_line("benchmarks.e2e", ["--only", "batch,ttft", "--engine", '{"a": 1}']) == (
        "python -m benchmarks.e2e --only batch,ttft --engine '{\"a\": 1}'")


def test_shapes_map_to_transformers_names_and_jaxkv_configs():
    hf = harness.hf_fields("8b")
    assert hf["num_hidden_layers"] == 32 and hf["num_key_value_heads"] == 8 and "num_layers" not in hf
    cfg = harness.model_config("small-tp4", 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.max_position_embeddings) == (4, 8, 4, 128)


def test_timers_return_milliseconds_per_call():
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    x = jnp.ones(4)
    assert harness.time_device(f, x, iters=3, warmup=2, rounds=2) > 0 and len(calls) == 2 + 3 * 2
    assert harness.time_host(f, x, iters=3, warmup=1) > 0 and len(calls) == 8 + 1 + 3
    ms, state = harness.time_state(lambda s: s + 1, jnp.zeros(()), iters=3, warmup=2, rounds=2)
    assert ms > 0 and float(state) == 2 + 3 * 2


def test_head_class_maps():
    hc = harness.head_class_map("1of8", 16, 8)
    kinds = hc.kinds()
    assert (kinds[:, 0] == "global").all() and (kinds[:, 1:] != "global").all()
    assert (harness.head_class_map("global", 2, 2).kinds() == "global").all()
    with pytest.raises(ValueError, match="unknown head-class map"):
        harness.head_class_map("half", 2, 2)


def test_every_module_has_a_main_that_answers_help():
    """Each benchmark and tool imports from the repository root and its `main(["--help"])` prints usage."""
    names = [f"benchmarks.{p.stem}" for p in sorted((ROOT / "benchmarks").glob("*.py"))
             if p.stem not in ("__init__", "harness")]
    names += [f"tools.{p.stem}" for p in sorted((ROOT / "tools").glob("*.py")) if p.stem != "__init__"]
    assert "benchmarks.e2e" in names and "tools.train_tiny" in names
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    mod = importlib.import_module(name)\n"
            "    try:\n"
            "        mod.main(['--help'])\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, (name, e.code)\n"
            "    else:\n"
            "        raise AssertionError(name + ': --help did not exit')\n")
    r = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("usage:") == len(names)
