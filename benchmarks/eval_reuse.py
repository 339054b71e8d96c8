"""Every reuse method side by side on the RAG-layout tasks, in one process (compilations and the `full`
reference shared): python -m benchmarks.eval_reuse --tasks qa,mq_niah,vt --context 2048 --num 24 --seed 1000

Methods run through the serving engine (`jaxkv.eval.reuse_methods`); `full` is the dense oracle, run once per
instance and used for every method's first-token agreement. A method spec is ``name`` or
``name:field=value;field=value`` (reuse-policy fields, for ablations). Prints one markdown table (mean over
instances) and writes all rows to --out. The progress line of each instance says how many programs it compiled
(`jaxkv.engine.compilations`): after the first instance of a context, close to none.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from benchmarks.harness import command_line, describe_device, write_json

DEFAULT_METHODS = ("reuse_full,naive,epic,cacheblend,sparsex,sparsex:per_head=true,sparsex:full_layers=0,"
                   "redknot,redknot:edge_thresh=1,redknot:dense_until=8")


def main(argv=None) -> int:
    import jaxkv
    from jaxkv.engine import compilations
    from jaxkv.eval import metrics, tasks
    from jaxkv.eval.__main__ import DEFAULT_MODEL, _parse_opts
    from jaxkv.eval.methods import PromptPieces, get_method

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.eval_reuse", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="qa,mq_niah,vt")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--out", default="eval_reuse.json")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args(argv)
    record = {"command": command_line("benchmarks.eval_reuse", argv), "device": describe_device(),
              "args": vars(args)}

    compilations.install()
    model = jaxkv.load(args.model, dtype=args.dtype)
    tok = model.tokenizer
    stop = tuple(model.config.eos_token_ids) or tuple(tok.eos_token_ids)
    full = get_method("full", model)
    specs = [m for m in args.methods.split(",") if m]
    methods = {}
    for spec in specs:
        name, _, opts = spec.partition(":")
        methods[spec] = get_method(name, model, **_parse_opts(opts.replace(";", ",")))
    rows, compiled = [], []
    t_start = time.time()
    for task in args.tasks.split(","):
        instances = tasks.make_instances(task, args.context, args.num, seed=args.seed, tokenizer=tok)
        for i, inst in enumerate(instances):
            enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
            pieces = PromptPieces(enc(inst.prefix), [enc(s) for s in inst.segments], enc(inst.suffix))
            max_new = len(enc(inst.target)) + 8
            before = compilations.xla_programs()["compiled"]
            ref = full.run(pieces, max_new, stop)
            for spec, meth in [("full", full)] + list(methods.items()):
                out = ref if spec == "full" else meth.run(pieces, max_new, stop)
                pred = tok.decode(out.token_ids)
                row = {"task": task, "method": spec, "index": i, "prompt_tokens": len(pieces.ids),
                       "score": metrics.score(inst.metric, pred, inst.answers),
                       "em": metrics.exact_match(pred, inst.target),
                       "f1": metrics.token_f1(pred, inst.target),
                       "ttft_s": out.ttft_s,
                       "flops": out.prefill_flops["attention"] + out.prefill_flops["ffn"],
                       "recompute": out.prefill_flops.get("recompute_fraction", 1.0), "prediction": pred}
                row |= metrics.logit_agreement(out.first_logits, ref.first_logits)
                rows.append(row)
            compiled.append({"task": task, "index": i,
                             "programs": compilations.xla_programs()["compiled"] - before})
            print(f"[{time.time() - t_start:7.1f}s] {task} #{i} done, compiled {compiled[-1]['programs']} "
                  "programs", file=sys.stderr, flush=True)
        write_json(args.out, record | {"rows": rows, "compiled": compiled})  # partial
        print(table(rows, args), flush=True)
    write_json(args.out, record | {"rows": rows, "compiled": compiled})
    print(table(rows, args))
    return 0


def table(rows, args) -> str:
    out = [f"context={args.context} num={args.num} seed={args.seed}", "",
           "| task | method | score | EM | F1 | top-1 | top-10 | cos | recompute | FLOPs vs full | "
           "TTFT ms (median) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    tasks_ = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for t in tasks_:
        full_flops = np.mean([r["flops"] for r in rows if r["task"] == t and r["method"] == "full"])
        for m in methods:
            rs = [r for r in rows if r["task"] == t and r["method"] == m]
            # B023: `mean` is only called within this iteration, so it always sees this `rs`
            mean = lambda k: float(np.mean([r[k] for r in rs]))  # noqa: E731, B023
            out.append(f"| {t} | {m} | {mean('score'):.3f} | {mean('em'):.3f} | {mean('f1'):.3f} | "
                       f"{mean('top1_agree'):.3f} | {mean('top10_overlap'):.2f} | "
                       f"{mean('logit_cosine'):.4f} | "
                       f"{mean('recompute'):.2f} | {mean('flops') / full_flops:.2f} | "
                       f"{1e3 * float(np.median([r['ttft_s'] for r in rs])):.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
