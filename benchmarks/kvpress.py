"""kvpress as the peer oracle: our compression policies against kvpress's presses on the same inputs.

    python -m benchmarks.kvpress kept --tasks vt,mq_niah,qa --context 2048 --num 1 \
        --budgets 0.5,0.25,0.125
    python -m benchmarks.kvpress accuracy --tasks vt,mq_niah,qa --context 2048 --num 6 \
        --budgets 0.5,0.25,0.125 --seed 101 --out results/kvpress_accuracy.json
    python -m benchmarks.kvpress accuracy --model smollm2 --tasks real_passkey,real_niah_single,real_vt \
        --context 2048 --num 3 --budgets 0.5,0.25,0.125 --full --hf-dir /tmp/kvpress-hf
    python -m benchmarks.kvpress table ours.json kvpress.json      # merge logs into one table

Two sides, two processes. This side (the project's venv) builds the prompts (`jaxkv.eval.tasks`), tokenizes
them, runs our policies through the serving engine and scores completions with `jaxkv.eval.metrics`. The
kvpress side (`benchmarks/kvpress_side.py`, run with ``--kvpress-python``, a venv with kvpress and its pinned
transformers) gets the token ids as JSON and returns kept indices / scores / generated ids as JSON; it
imports nothing of ours. Both sides run the same weights in fp32 on CPU: the embedded model by default, or
``--model`` (a checkpoint directory, a GGUF file, a catalog name such as ``smollm2``). A GGUF is written once
as a transformers directory for the kvpress side (`hf_checkpoint`: jaxkv's own dequantized tensors). Real-text
tasks (``real_*``) are built with the model's tokenizer and chat template exactly as ``python -m jaxkv.eval``
builds them, and the kvpress side receives those ids.

``kept``: per (layer, KV head), the set of original positions each side keeps after the prefill-end
compression (ours read back from the engine's pages, as tests/test_policies.py does), their Jaccard
overlap, and for the SnapKV family the max abs difference of the scores on the non-window positions
(ours: the policy's `score` hook on the observation the engine builds, recomputed here with a dense
forward; kvpress: its `score`, hooked). Budgets: for SnapKV / StreamingLLM / AdaKV ours gets kvpress's exact
token count (``int(N * (1 - compression_ratio))``, kvpress's `compute_n_kept`), so any difference is the
formula's; PyramidKV gets the fraction (its schedule is what is being compared).

``accuracy``: every (task, method, budget) greedy through our engine (`jaxkv.eval.methods.EngineMethod`,
fraction budgets as ``python -m jaxkv.eval --method M --budget B``) and through kvpress (the whole prompt
prefilled under ``press(model)``, then greedy decoding over the compressed cache: the same question-aware
setting as our engine), scored by the same metric. Also per cell: how many instances the two sides complete
identically (the same generated ids; with ``--full`` the full-cache row is the parity check of the two
implementations), and the share of each side's own full-cache completion a press reproduces before its first
differing token. Methods one side lacks run on the other alone (`METHODS`). Our side runs a cell's instances
through one engine, ``--batch`` rows a step (`EngineMethod.run_many`, the same tokens as one by one;
``--batch 1``: one at a time). ``table`` merges logs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import command_line, describe_device, repo_root, write_json

DEFAULT_MODEL = repo_root() / "jaxkv" / "assets" / "default_model"
KVPRESS_SIDE = Path(__file__).resolve().with_name("kvpress_side.py")  # run by the kvpress venv's python

# method -> (our policy name, our fields, kvpress press, its kwargs, wrapper). The hyperparameters are
# kvpress's defaults, set explicitly on our side. A method one side lacks has None there: `hardkv` runs on
# ours only, `expected_attention` and `knorm` on kvpress's only (listed beside the others at equal memory).
METHODS = {
    "snapkv": ("snapkv", {"window": 64, "kernel": 5, "pooling": "avg", "sink": 0},
               "SnapKVPress", {"window_size": 64, "kernel_size": 5}, None),
    "streaming_llm": ("streaming_llm", {"sink": 4}, "StreamingLLMPress", {"n_sink": 4}, None),
    "pyramidkv": ("pyramidkv", {"window": 64, "kernel": 5, "pooling": "avg", "sink": 0, "beta": 20},
                  "PyramidKVPress", {"window_size": 64, "kernel_size": 5, "beta": 20}, None),
    "adakv": ("adakv", {"window": 64, "kernel": 5, "pooling": "avg", "sink": 0, "alpha": 0.2},
              "SnapKVPress", {"window_size": 64, "kernel_size": 5},
              {"press": "AdaKVPress", "kwargs": {"alpha_safeguard": 0.2}}),
    # H2O: ours votes with the last `window` queries and gives half the budget to the most recent tokens (the
    # paper's split); kvpress's ObservedAttentionPress averages the attention of every prompt query (eager
    # attention) with no recent share. Same family, different formula.
    "h2o": ("h2o", {"window": 64, "sink": 0, "recent_fraction": 0.5}, "ObservedAttentionPress", {}, None),
    "hardkv": ("hardkv", {}, None, {}, None),
    "hardkv_nomerge": ("hardkv", {"merge": False}, None, {}, None),
    # retrieval policies (full cache held, a per-step selection of `budget` x prompt tokens per KV head read)
    "quest": ("quest", {}, None, {}, None),
    "specontext": ("specontext", {}, None, {}, None),
    "expected_attention": (None, {}, "ExpectedAttentionPress", {}, None),
    "knorm": (None, {}, "KnormPress", {}, None),
}
SNAP_FAMILY = ("snapkv", "pyramidkv", "adakv")


def n_kept(n: int, budget: float) -> int:
    """kvpress's compute_n_kept for compression_ratio = 1 - budget."""
    return max(1, int(n * (1 - (1 - budget))))


def press_spec(method: str, budget: float, label: str) -> dict:
    _, _, press, kwargs, wrap = METHODS[method]
    return {"label": label, "press": press, "kwargs": kwargs | {"compression_ratio": 1 - budget},
            "wrap": wrap}


def run_kvpress(python: str, request: dict, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    p = subprocess.run([python, str(KVPRESS_SIDE)], input=json.dumps(request | {"threads": threads}),
                       capture_output=True, text=True, env=env)
    if p.returncode:
        sys.stderr.write(p.stderr[-4000:])
        raise SystemExit(f"kvpress side failed (exit {p.returncode})")
    return json.loads(p.stdout)


# ---- the kvpress side's weights ------------------------------------------------------------------------
def hf_checkpoint(model: str, cache_root: str | None = None) -> Path:
    """A transformers-loadable directory holding `model`'s weights, for the kvpress side.

    A checkpoint directory is used as it is. A GGUF file (or a catalog name such as ``smollm2``) is written
    once as ``config.json`` + float32 ``model.safetensors`` from `jaxkv.gguf.read_gguf`, the reader behind
    `jaxkv.load`: the dequantized tensors our side runs, in Hugging Face names and layout (nothing is
    downloaded). Cached under `cache_root` (default: the system temp directory), keyed by file name, size and
    modification time.
    """
    import tempfile

    from jaxkv.models.catalog import resolve

    path = resolve(model)
    if path.is_dir():
        return path
    if path.suffix.lower() != ".gguf":
        raise SystemExit(f"--model {model}: expected a checkpoint directory, a .gguf file or a catalog name")
    st = path.stat()
    root = Path(cache_root) if cache_root else Path(tempfile.gettempdir()) / "jaxkv-kvpress-hf"
    out = root / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}-fp32"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    from safetensors.numpy import save_file

    from jaxkv.gguf import read_gguf

    ck = read_gguf(path)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))  # renamed when complete
    tensors = {name: np.ascontiguousarray(ck.tensors[name], dtype=np.float32) for name in ck.tensors}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(ck.hf_config | {"torch_dtype": "float32"}, indent=1))
    (tmp / "generation_config.json").write_text(json.dumps(ck.generation_config, indent=1))
    tmp.rename(out)
    return out


# ---- our side ------------------------------------------------------------------------------------------
def prompts(model, tasks, context, num, seed):
    """Every instance tokenized as `python -m jaxkv.eval` does (pieces one by one, no special tokens added);
    a real-text task (`real_*`) is built with the model's tokenizer and chat template."""
    from jaxkv.eval.tasks import make_instances

    tok = model.tokenizer
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    out = []
    for task in tasks:
        for i, inst in enumerate(make_instances(task, context, num, seed=seed, tokenizer=tok)):
            ids = enc(inst.prefix) + [t for s in inst.segments for t in enc(s)] + enc(inst.suffix)
            out.append({"task": task, "index": i, "inst": inst, "ids": ids,
                        "max_new": len(enc(inst.target)) + 8})
    return out


def our_policy(method: str, budget: float, n: int | None):
    from jaxkv.policies import get_policy

    name, fields, *_ = METHODS[method]
    b = n_kept(n, budget) if (n is not None and method != "pyramidkv") else budget
    return get_policy(name, budget=b, **fields)


def our_kept(model, policy, ids):
    """[L][H] sorted original positions each head keeps after the prefill-end compression (engine path)."""
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.buckets import pow2_bucket as _bucket
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    cfg = model.config
    eng = Engine(model, max_num_seqs=1, max_model_len=_bucket(len(ids) + 8), enable_prefix_caching=False,
                 head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), kv_policy=policy)
    rid = eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        req = eng._requests.get(rid)
        if req is not None and req.kv_compressed_at is not None:
            break
    pos = np.asarray(eng.runner.pool.pos)
    lengths = eng.tables.lengths(rid)
    kept = []
    for layer, row in enumerate(eng.tables.page_lists(rid)):
        heads = []
        for h, pages in enumerate(row):
            p = pos[pages].reshape(-1)[:lengths[layer, h]]
            heads.append(np.sort(p[p >= 0]).tolist())
        kept.append(heads)
    return kept


def our_scores(model, policy, ids):
    """[L] arrays [Hkv, N]: `policy.score` on the observation the engine builds at prefill end (window =
    the last `policy.window` prompt tokens, every key visible causally), from a dense fp32 forward."""
    import jax.numpy as jnp

    from jaxkv.models import llama
    from jaxkv.models.attention import dense_attention
    from jaxkv.policies.base import NEG, Observation

    cfg, params = model.config, model.params
    n, w = len(ids), policy.window
    H, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    out = []

    def attend(layer, q, k, v, st):
        qw = q[0, n - w:].astype(jnp.float32)  # [W, Hq, D]
        kh, vh = jnp.swapaxes(k[0], 0, 1), jnp.swapaxes(v[0], 0, 1)  # [H, N, D]
        logits = jnp.einsum("whgd,hnd->hgwn", qw.reshape(w, H, G, -1), kh.astype(jnp.float32),
                            precision="highest") * cfg.head_dim ** -0.5
        qpos = jnp.arange(n - w, n, dtype=jnp.int32)
        kpos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (H, n))
        logits = jnp.where(kpos[:, None, None, :] <= qpos[None, None, :, None], logits, NEG)
        obs = Observation(q=qw[None], q_pos=qpos[None], k=kh[None], v=vh[None], k_pos=kpos[None],
                          logits=logits[None], layer=layer)
        out.append(np.asarray(policy.score(obs)[0]))
        return dense_attention(q, k, v, pos, pos, window=cfg.layer_windows[layer]), st

    llama.forward(params, cfg, jnp.asarray([ids]), pos, attend, None)
    return out


# ---- kept sets -----------------------------------------------------------------------------------------
def jaccard(a, b) -> float:
    a, b = set(a), set(b)
    return len(a & b) / max(len(a | b), 1)


def cmd_kept(args, model):
    ps = prompts(model, args.tasks, args.context, args.num, args.seed)
    report = {"context": args.context, "seed": args.seed, "num": args.num, "rows": []}
    one_sided = [m for m in args.methods if None in (METHODS[m][0], METHODS[m][2])]
    if one_sided:
        raise SystemExit(f"kept compares both sides; {one_sided} run on one side only (use accuracy)")
    for method in args.methods:
        for budget in args.budgets:
            req = {"model": str(hf_checkpoint(args.model, args.hf_dir)), "mode": "kept", "dtype": args.dtype,
                   "presses": [press_spec(method, budget, f"{method}@{budget}")],
                   "prompts": [{"ids": p["ids"], "max_new": 1} for p in ps], "stop_ids": []}
            theirs = run_kvpress(args.kvpress_python, req, args.threads)["results"][0]["rows"]
            for p, th in zip(ps, theirs):
                n = len(p["ids"])
                pol = our_policy(method, budget, n)
                ours = our_kept(model, pol, p["ids"])
                J = np.array([[jaccard(o, t) for o, t in zip(ol, tl)] for ol, tl in zip(ours, th["kept"])])
                sizes_o = np.array([[len(o) for o in ol] for ol in ours])
                sizes_t = np.array([[len(t) for t in tl] for tl in th["kept"]])
                row = {"method": method, "budget": budget, "task": p["task"], "index": p["index"], "n": n,
                       "jaccard_mean": float(J.mean()), "jaccard_min": float(J.min()),
                       "heads_identical": int((J == 1).sum()), "heads": int(J.size),
                       "kept_ours_mean": float(sizes_o.mean()), "kept_kvpress_mean": float(sizes_t.mean()),
                       "kept_ours_per_layer": sizes_o.mean(1).tolist(),
                       "kept_kvpress_per_layer": sizes_t.mean(1).tolist()}
                if method in SNAP_FAMILY:
                    w = pol.window
                    mine = our_scores(model, pol, p["ids"])
                    diff, top = 0.0, 0.0
                    for layer, s in enumerate(th["scores"]):
                        t = np.asarray(s)[:, : n - w]
                        diff = max(diff, float(np.abs(mine[layer][:, : n - w] - t).max()))
                        top = max(top, float(np.abs(t).max()))
                    # Heads whose sets differ: kvpress's score gap between what only ours keeps and what only
                    # kvpress keeps (~1e-8 = a numerical tie, not a formula difference).
                    gap = 0.0
                    for layer, (ol, tl) in enumerate(zip(ours, th["kept"])):
                        t = np.asarray(th["scores"][layer])
                        for h, (o, tk) in enumerate(zip(ol, tl)):
                            a, b = sorted(set(o) - set(tk)), sorted(set(tk) - set(o))
                            if a and b:
                                gap = max(gap, float(np.abs(t[h, b].min() - t[h, a].max())))
                    row |= {"score_max_abs_diff": diff, "score_max": top, "boundary_gap": gap}
                report["rows"].append(row)
                print(f"{method:>13} b={budget:<6} {p['task']:>8}#{p['index']} n={n} "
                      f"jaccard mean={row['jaccard_mean']:.4f} min={row['jaccard_min']:.4f} "
                      f"identical={row['heads_identical']}/{row['heads']} "
                      f"kept ours/kvpress={row['kept_ours_mean']:.1f}/{row['kept_kvpress_mean']:.1f}"
                      + (f" score_max_abs_diff={row['score_max_abs_diff']:.2e} (max {row['score_max']:.2e})"
                         f" boundary_gap={row['boundary_gap']:.1e}"
                         if "score_max_abs_diff" in row else ""), flush=True)
    print("\nsummary (mean over prompts)")
    print(f"{'method':>13} {'budget':>7} {'jaccard':>8} {'min':>7} {'identical heads':>16} "
          f"{'score diff':>11}")
    for method in args.methods:
        for budget in args.budgets:
            rs = [r for r in report["rows"] if r["method"] == method and r["budget"] == budget]
            ident = sum(r["heads_identical"] for r in rs), sum(r["heads"] for r in rs)
            sd = max((r.get("score_max_abs_diff", float("nan")) for r in rs), default=float("nan"))
            print(f"{method:>13} {budget:>7} {np.mean([r['jaccard_mean'] for r in rs]):>8.4f} "
                  f"{min(r['jaccard_min'] for r in rs):>7.4f} {f'{ident[0]}/{ident[1]}':>16} {sd:>11.2e}")
    return report


# ---- accuracy ------------------------------------------------------------------------------------------
def cmd_accuracy(args, model):
    from jaxkv.eval import metrics
    from jaxkv.eval.methods import PromptPieces, get_method

    ps = prompts(model, args.tasks, args.context, args.num, args.seed)
    tok = model.tokenizer
    stop = tuple(model.config.eos_token_ids) or tuple(tok.eos_token_ids)
    report = {"context": args.context, "seed": args.seed, "num": args.num, "model": str(args.model),
              "tasks": args.tasks, "dtype": args.dtype, "rows": []}

    def generated(token_ids):  # the completion without its stop token, as both sides report it
        return list(token_ids[:-1] if token_ids and token_ids[-1] in stop else token_ids)

    def score(p, token_ids):
        return metrics.score(p["inst"].metric, tok.decode(generated(token_ids)), p["inst"].answers)

    cells = [(m, b) for m in args.methods for b in args.budgets]
    if not args.skip_kvpress:
        presses = [press_spec(m, b, f"{m}@{b}") for m, b in cells if METHODS[m][2] is not None]
        presses += [None] if args.full else []
        req = {"model": str(hf_checkpoint(args.model, args.hf_dir)), "mode": "generate", "presses": presses,
               "dtype": args.dtype,
               "device": args.device,
               "prompts": [{"ids": p["ids"], "max_new": p["max_new"]} for p in ps], "stop_ids": list(stop)}
        t0 = time.perf_counter()
        res = run_kvpress(args.kvpress_python, req, args.threads) if presses else {"results": []}
        print(f"kvpress side: {time.perf_counter() - t0:.0f} s (transformers {res.get('transformers')}, "
              f"torch {res.get('torch')})", flush=True)
        report["kvpress_side"] = {k: res.get(k) for k in ("kvpress_version", "transformers", "torch")}
        for r in res["results"]:
            for p, row in zip(ps, r["rows"]):
                report["rows"].append({"side": "kvpress", "cell": r["label"], "task": p["task"],
                                       "index": p["index"], "score": score(p, row["tokens"]),
                                       "tokens": generated(row["tokens"]),
                                       "cache_len_mean": float(np.mean(row["cache_lengths"]))})
    if not args.skip_ours:
        ours = [(m, b) for m, b in cells if METHODS[m][0] is not None]
        ours += [("engine", None)] if args.full else []
        for m, b in ours:
            fields = {} if b is None else {"budget": b} | METHODS[m][1]
            name = METHODS[m][0] if m in METHODS else m  # "engine": the full cache through the engine
            if name == "hardkv" and args.hardkv_calibration:
                fields["calibration"] = args.hardkv_calibration
            if m == "specontext" and args.retrieval_head:
                fields["head_dir"] = args.retrieval_head
            meth = get_method(name, model, **fields)
            t0 = time.perf_counter()
            enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
            pieces = []
            for p in ps:
                inst = p["inst"]
                segments = [enc(s) for s in inst.segments]
                pieces.append(PromptPieces(enc(inst.prefix), segments, enc(inst.suffix)))
                assert pieces[-1].ids == p["ids"]
            if args.batch > 1:  # every instance through one engine, `--batch` rows a step
                outs = meth.run_many([(p["ids"], p["max_new"]) for p in ps], stop, max_num_seqs=args.batch,
                                     max_step_tokens=args.max_step_tokens)
            else:
                outs = [meth.run(pc, p["max_new"], stop).token_ids for pc, p in zip(pieces, ps)]
            for p, token_ids in zip(ps, outs):
                report["rows"].append({"side": "ours", "cell": f"{m}@{b}" if b is not None else "full",
                                       "task": p["task"], "index": p["index"],
                                       "score": score(p, token_ids), "tokens": generated(token_ids)})
            print(f"ours {m}@{b}: {time.perf_counter() - t0:.0f} s", flush=True)
    labels = [f"{m}@{b}" for m, b in cells] + (["full"] if args.full else [])
    report["table"] = summarize(report["rows"], labels, args.tasks)
    print_accuracy(report["table"], labels, args.tasks)
    return report


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(rows, labels, tasks):
    """Per (cell, task, side): mean score, instance count and (with a full-cache run on that side) the mean
    share of the full-cache completion reproduced token for token before the first difference; per (cell,
    task): how many instances both sides completed identically (the same generated ids)."""
    table = []
    full = {(r["side"], r["task"], r["index"]): r["tokens"] for r in rows if r["cell"] == "full"}
    for lab in labels:
        for t in tasks:
            mine = [r for r in rows if r["cell"] == lab and r["task"] == t]
            by = {side: {r["index"]: r for r in mine if r["side"] == side} for side in ("ours", "kvpress")}
            for side, rs in by.items():
                if not rs:
                    continue
                entry = {"cell": lab, "task": t, "side": side, "num": len(rs),
                         "accuracy": float(np.mean([r["score"] for r in rs.values()]))}
                refs = [(full[(side, t, i)], r["tokens"]) for i, r in rs.items() if (side, t, i) in full]
                if refs:
                    share = [common_prefix(f, o) / max(len(f), 1) for f, o in refs]
                    entry["agree_full"] = float(np.mean(share))
                table.append(entry)
            both = sorted(set(by["ours"]) & set(by["kvpress"]))
            if both:
                same = sum(by["ours"][i]["tokens"] == by["kvpress"][i]["tokens"] for i in both)
                table.append({"cell": lab, "task": t, "side": "identical_outputs", "num": len(both),
                              "accuracy": same / len(both), "identical": same})
    return table


def print_accuracy(table, labels, tasks):
    get = {(r["cell"], r["task"], r["side"]): r for r in table}
    print(f"\n{'cell':>26} " + " ".join(f"{t[:14]:>14} ours/kvp/same" for t in tasks) + "   mean ours/kvp")
    for lab in labels:
        line, means = f"{lab:>26} ", {"ours": [], "kvpress": []}
        for t in tasks:
            parts = []
            for side in ("ours", "kvpress"):
                r = get.get((lab, t, side))
                parts.append(f"{r['accuracy']:.3f}" if r else "  -  ")
                if r:
                    means[side].append(r["accuracy"])
            same = get.get((lab, t, "identical_outputs"))
            parts.append(f"{same['identical']}/{same['num']}" if same else "-")
            line += f"{' / '.join(parts):>28} "
        line += "   " + " / ".join(f"{np.mean(v):.3f}" if v else "-" for v in means.values())
        print(line)


def cell_labels(rows) -> list[str]:
    """The cells of `rows` in METHODS order, budgets descending, the full cache last."""
    cells = {r["cell"] for r in rows}
    order = {m: i for i, m in enumerate(METHODS)}

    def key(c):
        m, _, b = c.partition("@")
        return (m == "full", order.get(m, len(order)), -float(b) if b else 0.0)

    return sorted(cells, key=key)


def markdown(table, labels, tasks) -> str:
    """Three method x budget tables, means over tasks: accuracy ours / kvpress; the share of each side's own
    full-cache completion reproduced before the first differing token, ours / kvpress; identical completions
    of the two sides (count / instances)."""
    get = {(r["cell"], r["task"], r["side"]): r for r in table}
    methods = list(dict.fromkeys(lab.partition("@")[0] for lab in labels))
    budgets = sorted({lab.partition("@")[2] for lab in labels if "@" in lab}, key=lambda b: -float(b))

    def mean(lab, side, key):
        v = [get[(lab, t, side)][key] for t in tasks if key in get.get((lab, t, side), {})]
        return f"{np.mean(v):.3f}" if v else "-"

    def ident(lab):
        same = [get[(lab, t, "identical_outputs")] for t in tasks if (lab, t, "identical_outputs") in get]
        return f"{sum(r['identical'] for r in same)}/{sum(r['num'] for r in same)}" if same else "-"

    def pair(key):
        return lambda lab: f"{mean(lab, 'ours', key)} / {mean(lab, 'kvpress', key)}"

    out = []
    for title, cell in (("accuracy, ours / kvpress", pair("accuracy")),
                        ("agreement with the full cache, ours / kvpress", pair("agree_full")),
                        ("identical completions", ident)):
        out += [f"| {title} | " + " | ".join(budgets) + " |", "|---|" + "---|" * len(budgets)]
        for m in methods:
            labs = [m] if m == "full" else [f"{m}@{b}" for b in budgets]
            cols = [cell(lab) for lab in labs] + [""] * (len(budgets) - len(labs))
            out.append(f"| {m} | " + " | ".join(cols) + " |")
        out.append("")
    return "\n".join(out)


LOCAL_OPTIONS = ("--out", "--hf-dir", "--kvpress-python")  # where files went on one machine, not the result


def portable(command: str) -> str:
    """`command` without its machine-local paths (LOCAL_OPTIONS and their values)."""
    import shlex

    words, out = shlex.split(command), []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w in LOCAL_OPTIONS:
            skip = True
        elif not w.startswith(tuple(o + "=" for o in LOCAL_OPTIONS)):
            out.append(w)
    return shlex.join(out)


def cmd_table(args):
    """Merge accuracy logs (one per side or per method) into one table."""
    rows, meta = [], {}
    for path in args.logs:
        log = json.loads(Path(path).read_text())
        rows += log["rows"]
        meta.setdefault("commands", []).append(portable(log["command"]) if log.get("command") else None)
        for k in ("context", "seed", "num", "model", "device", "kvpress_side"):
            if log.get(k) is not None:
                meta.setdefault(k, log[k])
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    labels = cell_labels(rows)
    table = summarize(rows, labels, tasks)
    print_accuracy(table, labels, tasks)
    md = markdown(table, labels, tasks)
    print("\n" + md)
    return meta | {"tasks": tasks, "rows": rows, "table": table, "markdown": md}


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kvpress", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["kept", "accuracy", "table"])
    ap.add_argument("logs", nargs="*", help="table: accuracy logs to merge")
    ap.add_argument("--tasks", default="vt,mq_niah,qa")
    ap.add_argument("--methods", default="snapkv,streaming_llm,pyramidkv,adakv")
    ap.add_argument("--budgets", default="0.5,0.25,0.125")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--num", type=int, default=2)
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--kvpress-python", default=os.environ.get("KVPRESS_PYTHON", "kvvenv/bin/python"),
                    help="python of a venv with kvpress installed (bash benchmarks/setup_kvpress_venv.sh "
                         "DIR; default $KVPRESS_PYTHON, else kvvenv/bin/python)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the kvpress side")
    ap.add_argument("--full", action="store_true", help="accuracy: also the uncompressed cache on both sides")
    ap.add_argument("--skip-kvpress", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--adakv-alpha", type=float, default=0.2,
                    help="AdaKV safeguard on both sides (ours `alpha`, kvpress `alpha_safeguard`)")
    ap.add_argument("--hf-dir", help="where a GGUF model is written once as a transformers directory for the "
                    "kvpress side (default: the system temp directory)")
    ap.add_argument("--hardkv-calibration", help="HARD-KV temperatures file (tools.calibrate_hardkv); "
                    "default: solved online per request, as `hardkv` does with no file beside the model")
    ap.add_argument("--retrieval-head",
                    help="SpeContext's retrieval head directory (tools.distil_retrieval_head "
                    "--export); default: the one shipped beside the model")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the kvpress side runs (auto: a GPU when torch sees one)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the weights' and activations' dtype on both sides (float32: comparable token for "
                         "token; bfloat16: ~16x faster prefill on a GPU, docs/eval.md)")
    ap.add_argument("--max-step-tokens", type=int, default=None,
                    help="accuracy, --batch > 1: prompt tokens per engine step (default: the engine's)")
    ap.add_argument("--batch", type=int, default=32,
                    help="accuracy: our side's instances per engine step (1: one at a time through `run`)")
    ap.add_argument("--out", help="JSON report path")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch must be a positive integer (got {args.batch})")
    args.tasks = args.tasks.split(",")
    args.methods = [m for m in args.methods.split(",") if m]  # "" with --full: the full cache alone
    args.budgets = [float(b) for b in args.budgets.split(",")]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; kvpress has {sorted(METHODS)}")
    if args.mode == "table":
        report = cmd_table(args)
        if args.out:
            write_json(args.out, report)
        return
    import jax

    if jax.default_backend() != "cpu" and args.dtype == "float32":  # float32 as float32 (not TF32), as on
        jax.config.update("jax_default_matmul_precision", "highest")    # the kvpress side
    METHODS["adakv"][1]["alpha"] = args.adakv_alpha
    METHODS["adakv"][4]["kwargs"]["alpha_safeguard"] = args.adakv_alpha
    import jaxkv

    model = jaxkv.load(args.model, dtype=args.dtype)
    report = (cmd_kept if args.mode == "kept" else cmd_accuracy)(args, model)
    report["command"] = command_line("benchmarks.kvpress", argv)
    report["device"] = describe_device()
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
