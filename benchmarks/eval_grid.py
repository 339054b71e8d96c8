"""Run ``python -m jaxkv.eval`` over a grid of tasks x contexts x methods and print one markdown table.

    python -m benchmarks.eval_grid --tasks mq_niah,vt,cwe,fwe,qa,chat,chain --contexts 2048,8192 \
        --methods full --num 12 --seed 101 --jobs 4 --out-dir /tmp/grid
    python -m benchmarks.eval_grid --tasks mq_niah,vt --contexts 8192 --methods full,snapkv,hardkv \
        --budgets 0.5,0.25,0.125,0.0625 --out-dir /tmp/grid    # KV policies at each budget + a plot

A method written ``name@budget`` runs ``--method name --budget budget``; ``--budgets`` expands every KV
policy method in ``--methods`` into one cell per budget and draws accuracy vs budget per task.

Each cell is its own ``jaxkv.eval`` process (so a cell's failure is contained and every cell leaves its
JSON in ``--out-dir``); ``--jobs`` run at once. ``--shared-workers`` instead runs the cells in ``--jobs``
long-lived worker processes (cells of one worker share the loaded model and every compiled step, which is
most of a short cell's time on a GPU); a failing cell is still recorded and the worker goes on. On a GPU
the processes share the card: preallocation is off and each is capped at 0.9 / --jobs of its memory
(unless XLA_PYTHON_CLIENT_MEM_FRACTION is set). ``--seeds`` runs every cell once per draw and adds a
per-draw table with the mean; a method spec ``name[@budget][:field=value...]`` passes policy fields
(``hardkv@0.125:window=64``, ``specontext:sink=4:recent=256``). The table is printed last and written to
``--out-dir/table.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.harness import command_line, markdown_table, subprocess_env, write_json


def cell_env(args) -> dict:
    """Processes share the GPU: no preallocation, and each capped at its share of the card (uncapped, the
    allocators of 8 workers kept what they had freed and starved each other: OOM in an 8K prefill)."""
    env = subprocess_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / max(1, args.jobs):.3f}")
    return env


def run_cell(task: str, context: int, method: str, seed: int, args) -> dict:
    argv, out = cell_argv(task, context, method, seed, args)
    cmd = [sys.executable, "-m", "jaxkv.eval", *argv]
    env = cell_env(args)
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr[-4000:])
    cell = {"task": task, "context": context, "method": method, "seed": seed, "wall_s": time.time() - t0,
            "rc": proc.returncode}
    if proc.returncode == 0 and out.is_file():
        cell |= json.loads(out.read_text())["summary"] | {"accuracy": json.loads(out.read_text())["accuracy"]}
    status = f"accuracy={cell['accuracy']:.3f}" if "accuracy" in cell else f"FAILED rc={proc.returncode:d}"
    print(f"[{cell['wall_s']:6.1f}s] {task:8s} {method:8s} {context:6d} s{seed} {status}", flush=True)
    if proc.returncode != 0:
        print("    " + "\n    ".join(proc.stderr.strip().splitlines()[-6:]), flush=True)
    return cell


def split_method(method: str) -> tuple[str, str, list[str]]:
    """``name[@budget][:key=value...]`` -> (name, budget or "", ["key=value", ...] policy args)."""
    head, *pargs = method.split(":")
    name, _, budget = head.partition("@")
    for a in pargs:
        if "=" not in a:
            raise SystemExit(f"method {method!r}: policy args are key=value, got {a!r}")
    return name, budget, pargs


def line_and_budget(method: str) -> tuple[str, float | None]:
    """A method spec's plot line (name plus policy args, budget dropped) and its budget (None: no budget)."""
    name, budget, pargs = split_method(method)
    return ":".join([name, *pargs]), (float(budget) if budget else None)


def cell_argv(task: str, context: int, method: str, seed: int, args) -> tuple[list[str], Path]:
    safe = method.replace(":", "+").replace("=", "-").replace("/", "_")
    out = Path(args.out_dir) / f"{task}_{safe}_{context}_s{seed}.json"
    name, budget, pargs = split_method(method)
    argv = ["--task", task, "--method", name, "--context", str(context), "--num", str(args.num),
            "--seed", str(seed), "--out", str(out), "--dtype", args.dtype]
    argv += ["--budget", budget] if budget else []
    argv += [x for a in pargs for x in ("--policy-arg", a)]
    argv += ["--model", args.model] if args.model else []
    return argv, out


def worker(cells_file: str) -> int:
    """Runs the cells listed in `cells_file` in this process (shared model load and compilations)."""
    import contextlib
    import io
    import traceback

    from jaxkv.eval import __main__ as ev

    for spec in json.loads(Path(cells_file).read_text()):
        t0 = time.time()
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                rc = ev.main(spec["argv"])
        except Exception:  # recorded; the other cells still run
            buf.write(traceback.format_exc())
            rc = 1
        Path(spec["log"]).write_text(buf.getvalue())
        print(f"[{time.time() - t0:6.1f}s] {' '.join(spec['argv'][:8])} rc={rc}", flush=True)
    return 0


def run_shared(grid, args) -> dict:
    """Splits the grid over `--jobs` worker processes; returns cell dicts like run_cell's."""
    env = cell_env(args)
    shards = [grid[i::max(1, args.jobs)] for i in range(max(1, args.jobs))]
    procs = []
    for i, shard in enumerate(shards):
        specs = []
        for g in shard:
            argv, out = cell_argv(*g, args)
            specs.append({"argv": argv, "log": str(out.with_suffix(".log"))})
        f = Path(args.out_dir) / f"worker{i}.json"
        f.write_text(json.dumps(specs))
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.eval_grid", "--worker", str(f)],
                                      env=env))
    for p in procs:
        p.wait()
    cells = {}
    for g in grid:
        _, out = cell_argv(*g, args)
        cell = {"task": g[0], "context": g[1], "method": g[2], "seed": g[3], "wall_s": float("nan"), "rc": 1}
        if out.is_file():
            res = json.loads(out.read_text())
            cell |= res["summary"] | {"accuracy": res["accuracy"], "rc": 0, "wall_s": res.get("wall_s", 0.0)}
        cells[g] = cell
    return cells


def table(cells: list[dict], args) -> str:
    header = ["task", "context", "method", "seed", "accuracy", "F1", "EM", "top-1 vs full", "KV MB held",
              "TTFT median s"]
    rows = []
    for c in cells:
        cell = [c["task"], c["context"], c["method"], c["seed"]]
        if "accuracy" not in c:
            rows.append(cell + [f"failed (rc {c['rc']})"] + [""] * 5)
            continue
        rows.append(cell + [f"**{c['accuracy']:.3f}**", f"{c['f1']:.3f}", f"{c['exact_match']:.3f}",
                            f"{c['top1_agree']:.3f}", f"{c['kv_bytes_held'] / 2**20:.1f}",
                            f"{c['ttft_s_median']:.3f}"])
    lead = f"seeds {args.seeds}, {args.num} instances per cell, {args.dtype}"
    return f"{lead}\n\n{markdown_table(header, rows)}"


def draws_table(cells: list[dict]) -> str:
    """One row per (task, context, method), one column per seed (draw), and the mean over the draws."""
    seeds = sorted({c["seed"] for c in cells})
    rows = []
    for key in dict.fromkeys((c["task"], c["context"], c["method"]) for c in cells):
        acc = {c["seed"]: c.get("accuracy") for c in cells if (c["task"], c["context"], c["method"]) == key}
        vals = [acc.get(s) for s in seeds]
        ok = [v for v in vals if v is not None]
        mean = f"**{np.mean(ok):.3f}**" if len(ok) == len(vals) else "—"
        rows.append([*key, *("—" if v is None else f"{v:.3f}" for v in vals), mean])
    return markdown_table(["task", "context", "method", *(f"s{s}" for s in seeds), "mean"], rows)


def plot(cells: list[dict], path: Path) -> None:
    """Accuracy vs KV budget, one panel per (task, context), one line per method; full as a flat line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["task"], c["context"]) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (task, ctx) in zip(axes[0], panels):
        mine = [c for c in cells if c["task"] == task and c["context"] == ctx and "accuracy" in c]
        for name in sorted({line_and_budget(c["method"])[0] for c in mine if "@" in c["method"]}):
            pts = sorted((line_and_budget(c["method"])[1], c["accuracy"]) for c in mine
                         if "@" in c["method"] and line_and_budget(c["method"])[0] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for c in mine:
            if "@" not in c["method"]:
                ax.axhline(c["accuracy"], ls="--", lw=1, color="k", label=c["method"])
        ax.set_xscale("log", base=2)
        ax.set_title(f"{task} @ {ctx}")
        ax.set_xlabel("KV budget (fraction of prompt)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def memory_curves(cells: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Per method (budget stripped): [(mean KV MB held, mean accuracy)] over the tasks every cell of the
    grid ran, one point per budget, ascending in memory; methods without a budget give one point."""
    cells_per_method = len({(c["task"], c.get("seed")) for c in cells})
    ok = [c for c in cells if "accuracy" in c]
    curves: dict[str, list[tuple[float, float]]] = {}
    for m in sorted({c["method"] for c in ok}):
        mine = [c for c in ok if c["method"] == m]
        if len(mine) != cells_per_method:
            continue
        mb = float(np.mean([c["kv_bytes_held"] for c in mine])) / 1e6
        acc = float(np.mean([c["accuracy"] for c in mine]))
        curves.setdefault(line_and_budget(m)[0], []).append((mb, acc))
    return {k: sorted(v) for k, v in curves.items()}


def at_memory(curve: list[tuple[float, float]], mb: float) -> float | None:
    """The curve's accuracy at `mb` (linear in log memory between its points; None outside them)."""
    xs = [np.log(p[0]) for p in curve]
    if len(curve) < 2 or not xs[0] <= np.log(mb) <= xs[-1]:
        return None
    return float(np.interp(np.log(mb), xs, [p[1] for p in curve]))


def equal_memory_table(cells: list[dict], ref: str = "snapkv") -> str:
    """Every method's mean accuracy interpolated at the memory `ref` holds at each of its budgets: the
    comparison at equal memory (a head-adaptive method such as HARD-KV holds less than its nominal budget)."""
    curves = memory_curves(cells)
    if ref not in curves:
        return ""
    names = [n for n in curves if len(curves[n]) > 1]
    rows = []
    for mb, _ in curves[ref]:
        vals = [at_memory(curves[n], mb) for n in names]
        rows.append([f"{mb:.1f}", *("—" if v is None else f"{v:.3f}" for v in vals)])
    return markdown_table([f"KV MB held ({ref}'s budgets)", *names], rows)


def plot_memory(cells: list[dict], path: Path) -> None:
    """Mean accuracy over the tasks vs mean KV MB held, one line per method (budgets as points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in memory_curves(cells).items():
        if len(pts) == 1:  # no budget (full, engine, duo): one point
            ax.scatter([pts[0][0]], [pts[0][1]], marker="x", color="k")
            ax.annotate(name, pts[0], textcoords="offset points", xytext=(4, 4 if name != "engine" else -10),
                        fontsize=7)
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV MB held per request (mean over tasks)")
    ax.set_ylabel("accuracy (mean over tasks)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.eval_grid", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="mq_niah,vt,cwe,fwe,qa,chat,chain")
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--methods", default="full")
    ap.add_argument("--num", type=int, default=12)
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--seeds", help="comma-separated seeds (draws); every cell runs once per seed "
                    "(default: --seed) and a per-draw table with the mean is printed")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out-dir", default="eval_grid")
    ap.add_argument("--shared-workers", action="store_true",
                    help="run cells in --jobs long-lived workers (shared model and compilations)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--budgets", help="comma-separated budgets of the KV policy methods (fractions, tokens)")
    ap.add_argument("--from-json", metavar="CELLS_JSON",
                    help="run nothing: redraw the plots and tables of an earlier grid's cells.json "
                         "in --out-dir")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    if args.from_json:
        cells = json.loads(Path(args.from_json).read_text())
        write_budget_outputs(cells, Path(args.out_dir))
        return 0
    methods = args.methods.split(",")
    if args.budgets:
        from jaxkv.policies import POLICIES

        def with_budget(m: str, b: str) -> str:
            name, _, pargs = split_method(m)
            return ":".join([f"{name}@{b}", *pargs])

        methods = [with_budget(m, b) if split_method(m)[0] in POLICIES else m for m in methods
                   for b in (args.budgets.split(",") if split_method(m)[0] in POLICIES else [None])]
    args.seeds = args.seeds or str(args.seed)
    for m in methods:
        split_method(m)  # bad policy-arg syntax fails before anything runs
    grid = list(itertools.product(args.tasks.split(","), [int(c) for c in args.contexts.split(",")], methods,
                                  [int(s) for s in args.seeds.split(",")]))
    # Longest cells first so the pool does not end on one straggler.
    order = sorted(grid, key=lambda g: -g[1])
    if args.shared_workers:
        done = run_shared(order, args)
    else:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            done = dict(zip(order, pool.map(lambda g: run_cell(*g, args), order)))
    cells = [done[g] for g in grid]
    md = table(cells, args)
    if len(args.seeds.split(",")) > 1:
        md += "\n\n" + draws_table(cells)
    (Path(args.out_dir) / "table.md").write_text(md + "\n")
    (Path(args.out_dir) / "cells.json").write_text(json.dumps(cells, indent=1))
    # The command only: this process leaves the device to the cells (no JAX here).
    write_json(Path(args.out_dir) / "run.json", {"command": command_line("benchmarks.eval_grid", argv)})
    if any("@" in m for m in methods):
        write_budget_outputs(cells, Path(args.out_dir))
    print(md)
    return 0 if all(c["rc"] == 0 for c in cells) else 1


def write_budget_outputs(cells: list[dict], out: Path) -> None:
    """accuracy_vs_budget.png, accuracy_vs_memory.png and equal_memory.md (printed too)."""
    plot(cells, out / "accuracy_vs_budget.png")
    plot_memory(cells, out / "accuracy_vs_memory.png")
    eq = equal_memory_table(cells)
    if eq:
        (out / "equal_memory.md").write_text(eq + "\n")
        print(eq + "\n")


if __name__ == "__main__":
    sys.exit(main())
