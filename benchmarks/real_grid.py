"""Every KV method on a real model, side by side with kvpress: one command for the whole grid.

    python -m benchmarks.real_grid --model smollm2 --contexts 2048,4096,8192 --seeds 1,2 --num 12 \\
        --jobs 4 --kvpress-jobs 6 --retrieval-head DIR --head-classes FILE --out-dir runs/real_grid
    python -m benchmarks.real_grid --out-dir runs/real_grid --table      # merge what has finished

The grid is a queue of independent processes, each leaving one JSON log in ``--out-dir`` (a finished log
is never run again, so an interrupted grid resumes):

* presses and retrieval policies, ours: `python -m benchmarks.kvpress accuracy --skip-kvpress` per
  (context, seed, method group), at ``--budgets`` (fractions of the prompt; Quest and SpeContext read that
  many tokens per KV head per step and hold the full cache), plus the full cache through the engine;
* the same presses in kvpress (``--kvpress-python``, its own venv), ``--skip-ours``, same prompts and ids;
* the reuse methods on the RAG layout: `python -m benchmarks.eval_reuse --tasks real_rag`.

``--jobs`` of our processes and ``--kvpress-jobs`` of kvpress's run at once (on a GPU they share the card:
each JAX process gets 0.9 / (jobs + kvpress-jobs) of it). ``--table`` merges the logs: per context, the
method x budget table of accuracy (ours / kvpress, mean over tasks and seeds), identical completions of
the two sides, the reuse table, a plot of accuracy against budget (``accuracy_vs_budget.png``) and
``summary.json`` (mean score and count per log, context, seed, side, method cell and task).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

TASKS = ("real_niah_single", "real_niah_multikey", "real_niah_multivalue", "real_niah_multiquery", "real_vt",
         "real_cwe", "real_fwe")
# Methods per process: each group loads the model once and compiles its own programs.
OURS = (("snapkv", "pyramidkv", "adakv"), ("streaming_llm", "h2o"), ("hardkv", "hardkv_nomerge"),
        ("quest",), ("specontext",))
KVPRESS = (("snapkv", "adakv"), ("pyramidkv", "streaming_llm"), ("expected_attention", "knorm"))
REUSE = ("naive", "epic", "cacheblend", "sparsex", "redknot")  # redknot here: its defaults


def jobs(args) -> list[tuple[str, str, list[str]]]:
    """(kind, log name, argv) of every process of the grid, the shorter contexts first, reuse last."""
    out = []
    common = ["--model", args.model, "--tasks", ",".join(args.tasks), "--budgets", args.budgets]
    common += [] if args.dtype == "float32" else ["--dtype", args.dtype]
    tag = "" if args.dtype == "float32" else f"_{args.dtype}"  # other dtypes log beside, never mixed
    for ctx in args.contexts:
        for seed in args.seeds:
            base = common + ["--context", str(ctx), "--num", str(args.num), "--seed", str(seed)]
            for i, group in enumerate(OURS):
                if "specontext" in group and not args.retrieval_head:
                    continue
                argv = [*base, "--skip-kvpress", "--methods", ",".join(group)]
                argv += ["--full"] if i == 0 else []
                argv += ["--retrieval-head", args.retrieval_head] if "specontext" in group else []
                out.append(("ours", f"ours_{ctx}_{seed}_{'-'.join(group)}{tag}.json",
                            ["-m", "benchmarks.kvpress", "accuracy", *argv]))
            if args.kvpress_python:
                for i, group in enumerate(KVPRESS):
                    argv = [*base, "--skip-ours", "--methods", ",".join(group), "--hf-dir", args.hf_dir,
                            "--kvpress-python", args.kvpress_python, "--threads", "2"]
                    argv += ["--full"] if i == 0 else []
                    out.append(("kvpress", f"kvpress_{ctx}_{seed}_{'-'.join(group)}{tag}.json",
                                ["-m", "benchmarks.kvpress", "accuracy", *argv]))
            reuse = ["-m", "benchmarks.eval_reuse", "--model", args.model, "--tasks", "real_rag",
                     "--context", str(ctx), "--num", str(args.num), "--seed", str(seed)]
            reuse += ([] if args.dtype == "float32" else ["--dtype", args.dtype]) + ["--methods"]
            out.append(("ours", f"reuse_{ctx}_{seed}{tag}.json", [*reuse, ",".join(REUSE)]))
            if args.head_classes:  # RedKnot with the model's profiled head classes and its FFN reuse
                out.append(("ours", f"reuse_{ctx}_{seed}_redknot-map{tag}.json",
                            [*reuse, f"redknot:head_classes={args.head_classes};ffn_reuse=true;"
                                     "ffn_select=deviation"]))
    out.sort(key=lambda j: j[1].startswith("reuse_"))  # the reuse passes (instances one at a time) last
    return [j for j in out if not args.only or any(k in j[1] for k in args.only)]


def run_all(args) -> None:
    out_dir = Path(args.out_dir)
    (out_dir / "stderr").mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs(args) if not (out_dir / j[1]).is_file()]
    if args.kvpress_python and any(j[0] == "kvpress" for j in todo):
        from benchmarks.kvpress import hf_checkpoint

        hf_checkpoint(args.model, args.hf_dir)  # written once here, not by concurrent processes
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / max(1, args.jobs + args.kvpress_jobs):.3f}")
    t0 = time.perf_counter()
    done = [0]

    def run(job):
        kind, name, argv = job
        t = time.perf_counter()
        with open(out_dir / "stderr" / (name + ".txt"), "w") as err:
            p = subprocess.run([sys.executable, *argv, "--out", str(out_dir / name)], env=env,
                               stdout=err, stderr=subprocess.STDOUT)
        done[0] += 1
        print(f"[{time.perf_counter() - t0:6.0f} s] {done[0]}/{len(todo)} {name}: "
              f"{'ok' if p.returncode == 0 else f'exit {p.returncode}'} in {time.perf_counter() - t:.0f} s",
              flush=True)

    print(f"{len(todo)} processes to run ({len(jobs(args)) - len(todo)} already logged)", flush=True)
    with ThreadPoolExecutor(args.jobs) as ours, ThreadPoolExecutor(max(1, args.kvpress_jobs)) as theirs:
        for job in todo:
            (ours if job[0] == "ours" else theirs).submit(run, job)


# ---- the table --------------------------------------------------------------------------------------------

def _logs(out_dir: Path, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob(f"{prefix}_*.json"))]


def press_table(out_dir: Path) -> tuple[str, dict]:
    """Per context: mean accuracy over tasks (each task's mean over every instance of every seed), ours /
    kvpress, and identical completions of the two sides on the same prompts."""
    from benchmarks.kvpress import cell_labels

    rows_by_ctx: dict[str, list] = {}  # "2048", or "8192 bfloat16" for a column run in another dtype
    for log in _logs(out_dir, "ours") + _logs(out_dir, "kvpress"):
        dtype = log.get("dtype", "float32")
        ctx = str(log["context"]) + ("" if dtype == "float32" else f" {dtype}")
        for r in log["rows"]:
            rows_by_ctx.setdefault(ctx, []).append(r | {"seed": log["seed"]})
    md, curves = [], {}
    for ctx in sorted(rows_by_ctx, key=lambda c: (int(c.split()[0]), c)):
        rows = rows_by_ctx[ctx]
        labels = cell_labels(rows)
        budgets = sorted({lab.partition("@")[2] for lab in labels if "@" in lab}, key=lambda b: -float(b))
        methods = list(dict.fromkeys(lab.partition("@")[0] for lab in labels))
        tasks = list(dict.fromkeys(r["task"] for r in rows))

        def acc(lab, side, rows=rows, tasks=tasks):
            mine = [r for r in rows if r["cell"] == lab and r["side"] == side]
            per_task = [[r["score"] for r in mine if r["task"] == t] for t in tasks]
            per_task = [np.mean(v) for v in per_task if v]
            n = sum(1 for r in rows if r["cell"] == lab and r["side"] == side)
            return (float(np.mean(per_task)), n) if per_task else (None, 0)

        def same(lab, rows=rows):
            ours = {(r["seed"], r["task"], r["index"]): r["tokens"] for r in rows
                    if r["cell"] == lab and r["side"] == "ours"}
            theirs = {(r["seed"], r["task"], r["index"]): r["tokens"] for r in rows
                      if r["cell"] == lab and r["side"] == "kvpress"}
            both = set(ours) & set(theirs)
            return f"{sum(ours[k] == theirs[k] for k in both)}/{len(both)}" if both else ""

        md += [f"**{ctx} tokens** (mean over {len(tasks)} tasks; n = instances per cell)", "",
               "| method | " + " | ".join(f"{b}: ours / kvpress (n) | same" for b in budgets) + " |",
               "|---|" + "---|---|" * len(budgets)]
        for m in methods:
            if m in ("full", "engine"):
                continue
            cols = []
            for b in budgets:
                lab = f"{m}@{b}"
                (a, n), (k, nk) = acc(lab, "ours"), acc(lab, "kvpress")
                curves.setdefault((ctx, m, "ours"), []).append((float(b), a))
                curves.setdefault((ctx, m, "kvpress"), []).append((float(b), k))
                cols.append(f"{'-' if a is None else f'{a:.3f}'} / {'-' if k is None else f'{k:.3f}'} "
                            f"({max(n, nk)})")
                cols.append(same(lab))
            md.append(f"| {m} | " + " | ".join(cols) + " |")
        (a, n), (k, nk) = acc("full", "ours"), acc("full", "kvpress")
        md.append(f"| full cache | {'-' if a is None else f'{a:.3f}'} / {'-' if k is None else f'{k:.3f}'} "
                  f"({max(n, nk)}) | {same('full')} |" + " |" * (2 * len(budgets) - 2))
        curves[(ctx, "full", "ours")] = [(1.0, a)]
        md.append("")
        mid = budgets[len(budgets) // 2] if budgets else None  # per task at the middle budget, ours
        if mid is not None:
            short = [t.removeprefix("real_") for t in tasks]
            md += [f"Per task, ours at {mid} (full cache first):", "",
                   "| method | " + " | ".join(short) + " |", "|---|" + "---|" * len(tasks)]
            for m in ["full"] + [m for m in methods if m not in ("full", "engine")]:
                lab = "full" if m == "full" else f"{m}@{mid}"
                mine = [r for r in rows if r["cell"] == lab and r["side"] == "ours"]
                vals = [[r["score"] for r in mine if r["task"] == t] for t in tasks]
                if any(vals):
                    cols = [f"{np.mean(v):.3f}" if v else "-" for v in vals]
                    md.append(f"| {m} | " + " | ".join(cols) + " |")
            md.append("")
    return "\n".join(md), curves


def reuse_table(out_dir: Path) -> str:
    by_ctx: dict[str, dict[str, list]] = {}
    for p in sorted(out_dir.glob("reuse_*.json")):
        log = json.loads(p.read_text())
        dtype = log.get("args", {}).get("dtype", "float32")
        ctx = p.stem.split("_")[1] + ("" if dtype == "float32" else f" {dtype}")
        for r in log.get("rows", []):
            if r["method"] == "full" and "redknot-map" in p.name:
                continue  # the same instances' full cache is in the context's main reuse log
            name, _, opts = r["method"].partition(":")
            name += " (profiled head classes, ffn_reuse)" if "head_classes=" in opts else ""
            by_ctx.setdefault(ctx, {}).setdefault(name, []).append(r)
    if not by_ctx:
        return ""
    methods = list(dict.fromkeys(m for d in by_ctx.values() for m in d))
    md = ["| method | " + " | ".join(f"{c}: score (n) | first token = full's" for c in sorted(by_ctx)) + " |",
          "|---|" + "---|---|" * len(by_ctx)]
    for m in methods:
        cols = []
        for c in sorted(by_ctx):
            rs = by_ctx[c].get(m, [])
            sc = [r["score"] for r in rs]
            t1 = [r["top1_agree"] for r in rs if r.get("top1_agree") is not None]
            cols += [f"{np.mean(sc):.3f} ({len(sc)})" if sc else "-", f"{np.mean(t1):.3f}" if t1 else "-"]
        md.append(f"| {m} | " + " | ".join(cols) + " |")
    return "\n".join(md)


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = sorted({c for c, _, _ in curves}, key=lambda c: (int(str(c).split()[0]), str(c)))
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False, sharey=True)
    colors = {}
    for ax, ctx in zip(axes[0], ctxs):
        for (c, m, side), pts in sorted(curves.items()):
            pts = sorted((b, a) for b, a in pts if a is not None)
            if c != ctx or not pts:
                continue
            if m == "full":
                ax.axhline(pts[0][1], color="black", lw=1, label="full cache")
                continue
            color = colors.setdefault(m, plt.get_cmap("tab20")(len(colors) % 20))
            ax.plot(*zip(*pts), marker="o" if side == "ours" else "x", ls="-" if side == "ours" else "--",
                    color=color, label=f"{m} ({'jaxkv' if side == 'ours' else 'kvpress'})")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{ctx} tokens")
        ax.set_xlabel("KV budget (fraction of the prompt)")
    axes[0][0].set_ylabel("accuracy (mean over tasks)")
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)


def summary(out_dir: Path) -> list[dict]:
    """Every log's rows as mean score and instance count per (log, context, seed, side, cell, task)."""
    cells: dict[tuple, list[float]] = {}
    for p in sorted(out_dir.glob("*.json")):
        if p.name == "summary.json":
            continue
        log = json.loads(p.read_text())
        args = log.get("args", {})
        ctx, seed = log.get("context", args.get("context")), log.get("seed", args.get("seed"))
        for r in log.get("rows", []):
            key = (p.name, ctx, seed, r.get("side", "ours"), r.get("cell", r.get("method")), r["task"])
            cells.setdefault(key, []).append(float(r["score"]))
    return [{"log": k[0], "context": k[1], "seed": k[2], "side": k[3], "cell": k[4], "task": k[5],
             "num": len(v), "score": float(np.mean(v))} for k, v in cells.items()]


def table(args) -> None:
    out_dir = Path(args.out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary(out_dir), indent=0))
    md, curves = press_table(out_dir)
    reuse = reuse_table(out_dir)
    text = md + ("\n**Reuse methods on `real_rag`**\n\n" + reuse + "\n" if reuse else "")
    (out_dir / "table.md").write_text(text)
    if curves:
        plot(curves, out_dir / "accuracy_vs_budget.png")
    print(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.real_grid", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--num", type=int, default=12, help="instances per task, context and seed")
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument("--jobs", type=int, default=2, help="our processes at once")
    ap.add_argument("--kvpress-jobs", type=int, default=2, help="kvpress processes at once")
    ap.add_argument("--kvpress-python", default=os.environ.get("KVPRESS_PYTHON"),
                    help="python of a venv with kvpress (benchmarks/setup_kvpress_venv.sh); none: ours only")
    ap.add_argument("--hf-dir", default=None,
                    help="where the kvpress side's transformers copy of a GGUF goes")
    ap.add_argument("--retrieval-head", help="SpeContext's head for this model (tools.distil_retrieval_head "
                    "--export); none: SpeContext is left out")
    ap.add_argument("--head-classes",
                    help="RedKnot's head classes for this model (tools.profile_heads --out)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="both sides' dtype; another than float32 logs beside it (name suffix), own column")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--only", default="", help="comma-separated: run only the processes whose log name "
                    "contains one of these (e.g. specontext,redknot-map)")
    ap.add_argument("--table", action="store_true", help="run nothing: merge the logs in --out-dir")
    args = ap.parse_args(argv)
    args.tasks = args.tasks.split(",")
    args.only = [k for k in args.only.split(",") if k]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.hf_dir = args.hf_dir or str(Path(args.out_dir) / "hf")
    if not args.table:
        run_all(args)
    table(args)


if __name__ == "__main__":
    main()
