"""python -m jaxkv.eval --task T --method M --context N --num K --seed S --out results.json [--model M]

Runs K deterministic instances of a task at N tokens through a method (default model: the embedded one;
--model takes a Hugging Face directory, a GGUF file or a catalog name such as ``smollm2``), prints a
per-instance table and the summary, writes everything to --out, and ends with ``accuracy=<value>``. For
methods other than ``full`` the full-recompute run is made too, for the first-token logit agreement.
``real_*`` tasks are built over real prose with the model's tokenizer and chat template;
``--task real_fidelity`` instead compares next-token distributions with ``full`` on real continuations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default_model"


def parse_args(argv=None) -> argparse.Namespace:
    from jaxkv.eval import realtext
    from jaxkv.eval.registry import all_methods
    from jaxkv.eval.tasks import MIN_CONTEXT, TASKS

    METHODS = all_methods()
    TASKS = {**TASKS, **realtext.TASKS, realtext.FIDELITY_TASK: None}

    ap = argparse.ArgumentParser(prog="python -m jaxkv.eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True, help=f"one of {sorted(TASKS)}, or ruler:FILE / longbench:FILE")
    ap.add_argument("--method", default="full", help=f"one of {sorted(METHODS)}")
    ap.add_argument("--context", type=int, default=2048, help="tokens of prompt + reference answer")
    ap.add_argument("--num", type=int, default=12, help="number of instances")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="results JSON path")
    ap.add_argument("--model", help="Hugging Face model directory, GGUF file or catalog name (smollm2, "
                    "synthetic; default: the embedded model)")
    ap.add_argument("--continuation", type=int, default=32,
                    help=f"{realtext.FIDELITY_TASK}: teacher-forced positions compared per instance")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = from the reference answers")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--budget", type=float, help="KV policy methods: fraction of the prompt (<= 1) or tokens "
                    "per head (> 1)")
    ap.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="KV policy methods: another policy field, e.g. --policy-arg window=32")
    ap.add_argument("--method-opts", default="",
                    help="method fields, e.g. ratio=0.3,full_layers=2 (reuse methods)")
    args = ap.parse_args(argv)
    loader = args.task.split(":", 1)[0] if ":" in args.task else None
    if loader is None and args.task not in TASKS:
        ap.error(f"unknown task {args.task!r}; choose from {sorted(TASKS)} or ruler:FILE / longbench:FILE")
    if loader is not None and loader not in ("ruler", "longbench"):
        ap.error(f"unknown loader {loader!r} in --task; use ruler:FILE or longbench:FILE")
    if loader is not None and not Path(args.task.split(":", 1)[1]).is_file():
        ap.error(f"--task file {args.task.split(':', 1)[1]!r} does not exist")
    if args.method not in METHODS:
        ap.error(f"unknown method {args.method!r}; choose from {sorted(METHODS)}")
    if loader is None and args.context < MIN_CONTEXT:
        ap.error(f"--context must be >= {MIN_CONTEXT}, got {args.context}")
    if args.num < 1:
        ap.error(f"--num must be >= 1, got {args.num}")
    if args.max_new_tokens < 0:
        ap.error("--max-new-tokens must be >= 0")
    from jaxkv.policies import POLICIES

    args.policy_fields = {}
    if (args.budget is not None or args.policy_arg) and args.method not in POLICIES:
        ap.error(f"--budget / --policy-arg apply to the KV policy methods {sorted(POLICIES)}, "
                 f"not {args.method!r}")
    for item in args.policy_arg:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--policy-arg {item!r} is not KEY=VALUE")
        try:
            args.policy_fields[key] = json.loads(value)
        except json.JSONDecodeError:
            args.policy_fields[key] = value  # a bare string such as pooling=max
    if args.budget is not None:
        if not args.budget > 0:
            ap.error(f"--budget must be > 0, got {args.budget}")
        args.policy_fields["budget"] = args.budget
    if args.continuation < 1:
        ap.error(f"--continuation must be >= 1, got {args.continuation}")
    if args.task == realtext.FIDELITY_TASK and args.method not in _fidelity_methods(METHODS):
        ap.error(f"{realtext.FIDELITY_TASK} compares teacher-forced distributions, which only 'full' and "
                 f"the engine methods give: choose from {sorted(_fidelity_methods(METHODS))}")
    from jaxkv.models.catalog import resolve

    try:
        model_dir = resolve(args.model) if args.model else DEFAULT_MODEL
    except FileNotFoundError as e:
        ap.error(f"--model: {e}")
    is_gguf = model_dir.is_file() and model_dir.suffix.lower() == ".gguf"
    if not is_gguf and not (model_dir / "config.json").is_file():
        ap.error(f"--model {str(model_dir)!r} is not a model directory (no config.json), a .gguf file "
                 f"or a catalog name")
    args.model_dir = model_dir
    try:
        args.method_opts = _parse_opts(args.method_opts)
    except ValueError as e:
        ap.error(f"--method-opts: {e}")
    args.loader = loader
    return args


def _parse_opts(text: str) -> dict:
    """``a=1,b=0.5,c=true`` -> {"a": 1, "b": 0.5, "c": True}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if "=" not in item:
            raise ValueError(f"expected key=value, got {item!r}")
        key, val = (t.strip() for t in item.split("=", 1))
        low = val.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(val)
            except ValueError:
                try:
                    out[key] = float(val)
                except ValueError:
                    out[key] = val
    return out


def _fidelity_methods(methods) -> set[str]:
    """`full` and the engine methods whose requests take top logprobs (not the retrieval policies)."""
    from jaxkv.eval.methods import EngineMethod
    from jaxkv.eval.retrieval_eval import RetrievalEngineMethod

    return {"full"} | {n for n, cls in methods.items()
                       if isinstance(cls, type) and issubclass(cls, EngineMethod)
                       and not issubclass(cls, RetrievalEngineMethod)}


def load_instances(args, tokenizer=None):
    """The run's instances; `tokenizer` (the model's) builds the real-text tasks and frames loaded data in
    its chat template."""
    from jaxkv.eval import loaders, realtext, tasks

    if args.loader == "ruler":
        return loaders.load_ruler_jsonl(args.task.split(":", 1)[1], limit=args.num, tokenizer=tokenizer)
    if args.loader == "longbench":
        return loaders.load_longbench_jsonl(args.task.split(":", 1)[1], limit=args.num, tokenizer=tokenizer)
    if args.task in realtext.TASKS:
        return realtext.make_instances(args.task, tokenizer, args.context, args.num, seed=args.seed)
    return tasks.make_instances(args.task, args.context, args.num, seed=args.seed)


def run_fidelity(args, model) -> dict:
    """Teacher-forced next-token fidelity of a method against full attention on real prose continuations
    (`jaxkv.eval.realtext.forced_agreement`)."""
    import numpy as np
    from tqdm import tqdm

    from jaxkv.eval import realtext
    from jaxkv.eval.methods import get_method

    fields = {**getattr(args, "method_opts", {}), **getattr(args, "policy_fields", {})}
    method = get_method(args.method, model, **fields)
    hc = None
    if args.method != "full":
        from jaxkv.cache.head_classes import all_global

        cfg = model.config
        hc = all_global(cfg.num_layers, cfg.num_kv_heads) if method.head_classes == "global" else None
    rows = []
    for i in tqdm(range(args.num), desc=f"{args.task}/{args.method}", file=sys.stderr):
        prompt, cont = realtext.fidelity_sample(model.tokenizer, args.context, args.continuation + 1,
                                                args.seed, i)
        ref = realtext.reference_logprobs(model, prompt, cont)
        if args.method == "full":
            k = 20
            tops = [[(int(t), float(r[t])) for t in np.argsort(-r)[:k]] for r in ref]
        else:
            tops = realtext.engine_forced_top(model, method.policy, hc, prompt, cont)
        rows.append({"index": i, "prompt_tokens": len(prompt), "positions": len(tops),
                     **realtext.forced_agreement(ref, tops)})
    summary = {k: float(np.mean([r[k] for r in rows])) for k in ("top1_agree", "kl")}
    return {"task": args.task, "method": args.method, "context": args.context, "num": args.num,
            "continuation": args.continuation, "seed": args.seed, "model": str(args.model_dir),
            "model_id": model.model_id,
            "policy": dataclasses.asdict(method.policy) if getattr(method, "policy", None) else None,
            "accuracy": summary["top1_agree"], "summary": summary, "instances": rows}


def run(args) -> dict:
    import numpy as np
    from tqdm import tqdm

    import jaxkv
    from jaxkv.eval import metrics
    from jaxkv.eval.methods import PromptPieces, get_method

    model = jaxkv.load(args.model_dir, dtype=args.dtype)
    tok = model.tokenizer
    if args.task == "real_fidelity":
        return run_fidelity(args, model)
    instances = load_instances(args, tok)
    fields = {**getattr(args, "method_opts", {}), **getattr(args, "policy_fields", {})}
    method = get_method(args.method, model, **fields)
    reference = get_method("full", model) if method.compare_to_full and args.method != "full" else None
    stop = tuple(model.config.eos_token_ids) or tuple(tok.eos_token_ids)
    rows = []
    for i, inst in enumerate(tqdm(instances, desc=f"{args.task}/{args.method}", file=sys.stderr)):
        enc = lambda s: tok.encode(s, add_special_tokens=False)
        pieces = PromptPieces(enc(inst.prefix), [enc(s) for s in inst.segments], enc(inst.suffix))
        max_new = args.max_new_tokens or len(enc(inst.target)) + 8
        out = method.run(pieces, max_new, stop)
        pred = tok.decode(out.token_ids)
        row = {"index": i, "prompt_tokens": len(pieces.ids), "output_tokens": len(out.token_ids),
               "score": metrics.score(inst.metric, pred, inst.answers),
               "exact_match": metrics.exact_match(pred, inst.target),
               "f1": metrics.token_f1(pred, inst.target), "ttft_s": out.ttft_s,
               "kv_bytes_held": out.kv_bytes_held, "kv_bytes_loaded": out.kv_bytes_loaded,
               "prefill_flops_attention": out.prefill_flops["attention"],
               "prefill_flops_ffn": out.prefill_flops["ffn"], "prediction": pred, "target": inst.target,
               "recompute_fraction": out.prefill_flops.get("recompute_fraction", 1.0)}
        if reference is None and args.method != "full":   # a baseline with no model: no agreement to report
            row |= {"logit_cosine": float("nan"), "top1_agree": float("nan"), "top10_overlap": float("nan")}
        else:
            ref = reference.run(pieces, 1, stop).first_logits if reference else out.first_logits
            row |= metrics.logit_agreement(out.first_logits, ref)
        rows.append(row)
    keys = ["score", "exact_match", "f1", "logit_cosine", "top1_agree", "top10_overlap", "ttft_s",
            "kv_bytes_held", "kv_bytes_loaded", "prefill_flops_attention", "prefill_flops_ffn",
            "prompt_tokens", "recompute_fraction"]
    summary = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    # TTFT of the first instance includes compilation; the median is the steady-state figure.
    summary["ttft_s_median"] = float(np.median([r["ttft_s"] for r in rows]))
    return {"task": args.task, "method": args.method, "context": args.context, "num": args.num,
            "policy": dataclasses.asdict(method.policy) if getattr(method, "policy", None) else None,
            "seed": args.seed, "model": str(args.model_dir), "model_id": model.model_id,
            "accuracy": summary["score"], "summary": summary, "instances": rows}


def print_table(res: dict) -> None:
    if "continuation" in res:  # real_fidelity
        print(f"{'#':>3} {'tokens':>7} {'top1':>6} {'kl':>8}")
        for r in res["instances"]:
            print(f"{r['index']:>3} {r['prompt_tokens']:>7} {r['top1_agree']:>6.3f} {r['kl']:>8.4f}")
        s = res["summary"]
        print(f"task={res['task']} method={res['method']} context={res['context']} num={res['num']} "
              f"continuation={res['continuation']} top1={s['top1_agree']:.3f} kl={s['kl']:.4f}")
        return
    print(f"{'#':>3} {'tokens':>7} {'score':>6} {'f1':>5} {'cos':>6} {'ttft_s':>7}  prediction | target")
    for r in res["instances"]:
        pred, tgt = r["prediction"][:40], r["target"][:40]
        print(f"{r['index']:>3} {r['prompt_tokens']:>7} {r['score']:>6.3f} {r['f1']:>5.2f} "
              f"{r['logit_cosine']:>6.3f} {r['ttft_s']:>7.3f}  {pred} | {tgt}")
    s = res["summary"]
    print(f"task={res['task']} method={res['method']} context={res['context']} num={res['num']} "
          f"f1={s['f1']:.3f} em={s['exact_match']:.3f} top1={s['top1_agree']:.3f} "
          f"kv_held_MB={s['kv_bytes_held'] / 2**20:.2f} "
          f"prefill_GFLOP_attn={s['prefill_flops_attention'] / 1e9:.2f} "
          f"prefill_GFLOP_ffn={s['prefill_flops_ffn'] / 1e9:.2f} ttft_median_s={s['ttft_s_median']:.4f} "
          f"recompute={s['recompute_fraction']:.3f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    res = run(args)
    res["wall_s"] = time.time() - t0
    print_table(res)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"accuracy={res['accuracy']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
