"""Recall of the SpeContext retrieval head's top-B against the model's true top-B attention, and accuracy.

    python scripts/eval_retrieval_head.py --tasks mq_niah,chain --contexts 2048,8192 \
        --budgets 256,512,1024 --num 3 --seed 0 [--accuracy] [--out results.json]

Per instance (prompt + reference answer, teacher forced) the decode queries are the answer positions
(each generated token's query; at most ``--max-queries``). The target runs once
(`jaxkv.policies.retrieve.distil.teacher_attention`); for every layer the selection serves (tap_layer..L-1)
and KV head, the true top-B is the top-B of the layer's attention max-reduced over the GQA group. For each
selector the table reports

* ``recall``: |selected ∩ true top-B| / min(B, visible), mean over layers, KV heads and queries;
* ``mass``: the fraction of each query head's attention (per layer) that falls on the selected slots;
* ``cover@k`` (``--cover-k``, default 32): the fraction of the true top-k (k much smaller than B) that the
  selection holds, mean over layers, KV heads and queries: whether the few keys that dominate a query's
  attention are read, which set recall against the whole top-B cannot tell when attention is diffuse.

Selectors at the same B: ``head`` (the shipped retrieval head; forced tokens only with ``--sink`` /
``--recent``, 0 by default as in the paper),
``oracle`` (top-B of the layer-mean of the true GQA-max attention: the best layer-shared selection by this
ranking) and ``streaming`` (4 sinks + the most recent tokens). ``--accuracy`` also decodes each instance
greedily with full attention and with SpeContext at each B (`jaxkv.policies.retrieve.decode.generate`) and
reports the task score and the adjacent-step selection overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _bucket(n: int) -> int:
    b = 1024
    while b < n:
        b *= 2
    return b


def global_heads(model, tap: int) -> np.ndarray:
    """bool [L - tap, Hkv]: (layer, KV head) pairs the model's head-class file calls global (all when the
    model has no head_classes.json)."""
    path = Path(model.path) / "head_classes.json"
    cfg = model.config
    if not path.is_file():
        return np.ones((cfg.num_layers - tap, cfg.num_kv_heads), bool)
    heads = json.loads(path.read_text())["heads"]
    return np.array([[h["kind"] == "global" for h in layer] for layer in heads[tap:]], bool)


def recall_rows(model, head, ids: list[int], n_prompt: int, budgets, max_queries: int, sink: int = 0,
                recent: int = 0, cover_k: int = 32) -> dict:
    """{selector: {B: (recall, mass, recall over global heads, mass over global heads, cover@k)}} for one
    teacher-forced sequence (global = the head-class file's global (layer, KV head) pairs)."""
    import jax
    import jax.numpy as jnp

    from jaxkv.policies.retrieve import specontext as sc
    from jaxkv.policies.retrieve.base import select
    from jaxkv.policies.retrieve.distil import teacher_attention

    cfg = model.config
    hkv, g = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    tap = head.config.tap_layer
    t = _bucket(len(ids))
    qidx = np.arange(n_prompt, len(ids) - 1)[:max_queries].astype(np.int32)
    toks = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, t - len(ids)))[None])
    x, xq, probs = teacher_attention(model.params, cfg, toks, jnp.asarray(qidx), tap_layer=tap, mean=False,
                                     key_layer=head.config.keys_layer)
    # probs [L', Hq, Q, T] -> true GQA-max [L', Hkv, Q, T]
    lp = probs.shape[0]
    gmax = jnp.max(probs.reshape(lp, hkv, g, len(qidx), t), axis=2)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    prev = x[None, np.maximum(qidx - 1, 0)] if head.config.lagged else None
    q = sc.head_query(head, xq[None], jnp.asarray(qidx)[None], prev)
    k = sc.head_keys(head, x[None], positions)
    vis = jnp.arange(t)[None, None, :] <= jnp.asarray(qidx)[None, :, None]  # [1, Q, T]
    hscore = sc.group_weights(sc.head_logits(head, q, k), vis)[0]  # [Hkv, Q, T]
    oscore = jnp.mean(gmax, axis=0)  # [Hkv, Q, T]
    qpos = jnp.asarray(qidx)
    glob = jnp.asarray(global_heads(model, tap))  # [L', Hkv]
    glob_q = jnp.repeat(glob, g, axis=1)  # [L', Hq]
    kc = min(cover_k, t)
    cover_top = jax.lax.top_k(jnp.where(vis[0][None, None], gmax, -1.0), kc)[1]  # [L', Hkv, Q, kc]
    cover_den = jnp.minimum(kc, qpos + 1)[None, None, :].astype(jnp.float32)
    out = {}
    for b in budgets:
        true_top = jax.lax.top_k(jnp.where(vis[0][None, None], gmax, -1.0), min(b, t))[1]  # [L', Hkv, Q, b]
        true_mask = jnp.zeros(gmax.shape, bool)
        true_mask = jnp.put_along_axis(true_mask, true_top, True, axis=-1, inplace=False)
        true_mask &= vis[0][None, None]
        denom = jnp.minimum(b, qpos + 1)[None, None, :]  # [1, 1, Q]
        stream = jnp.arange(t)[None, :] < 4
        stream = stream | (jnp.arange(t)[None, :] > qpos[:, None] - (b - 4))  # [Q, T]
        sels = {"head": hscore, "oracle": oscore,
                "streaming": jnp.broadcast_to(stream.astype(jnp.float32), hscore.shape)}
        for name, score in sels.items():
            forced = {"sink": sink, "recent": recent} if name == "head" else {}
            sel = select(jnp.swapaxes(score, 0, 1), qpos, budget=b, **forced)  # rows = queries: [Q, Hkv, T]
            mask = jnp.zeros((len(qidx), hkv, t), bool)
            # Padding entries repeat the first selected slot (always real), so they write nothing new.
            idx = jnp.where(sel.mask(), sel.idx, sel.idx[..., :1])
            mask = jnp.put_along_axis(mask, idx, True, axis=-1, inplace=False)
            mask = jnp.swapaxes(mask, 0, 1)  # [Hkv, Q, T]
            rec = jnp.mean(jnp.sum(true_mask & mask[None], axis=-1) / denom, axis=-1)  # [L', Hkv]
            mq = jnp.repeat(mask, g, axis=0)  # [Hq, Q, T]
            mass = jnp.mean(jnp.sum(jnp.where(mq[None], probs, 0.0), axis=-1), axis=-1)  # [L', Hq]
            # cover@k: top-k entries beyond the visible prefix are ranked -1 (slot 0 repeated): only the
            # first min(k, pos + 1) count, and every one of those is visible.
            held = jnp.take_along_axis(jnp.broadcast_to(mask[None], gmax.shape), cover_top, axis=-1)
            held &= jnp.arange(kc)[None, None, None, :] < cover_den[..., None]
            cover = jnp.mean(jnp.sum(held, axis=-1) / cover_den)
            out.setdefault(name, {})[b] = (float(jnp.mean(rec)), float(jnp.mean(mass)),
                                           float(jnp.sum(rec * glob) / jnp.sum(glob)),
                                           float(jnp.sum(mass * glob_q) / jnp.sum(glob_q)), float(cover))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "jaxkv" / "assets" / "default_model"))
    ap.add_argument("--head", default=None, help="retrieval head directory (default: <model>/retrieval_head)")
    ap.add_argument("--tasks", default="mq_niah,chain")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--num", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-queries", type=int, default=256)
    ap.add_argument("--cover-k", type=int, default=32, help="cover@k: share of the true top-k selected")
    ap.add_argument("--sink", type=int, default=0, help="SpeContext forced first positions (paper: 0)")
    ap.add_argument("--recent", type=int, default=0, help="SpeContext forced newest positions (paper: 0)")
    ap.add_argument("--accuracy", action="store_true", help="also decode: full vs SpeContext at each B")
    ap.add_argument("--implementation", default=None, choices=["pallas", "reference"],
                    help="paged attention of the selected slots (default: Pallas on GPU, else the twin)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    import jaxkv
    from jaxkv.eval import metrics, tasks
    from jaxkv.eval.methods import PromptPieces, get_method
    from jaxkv.policies.retrieve import decode
    from jaxkv.policies.retrieve import specontext as sc

    model = jaxkv.load(args.model)
    head = sc.load_head(args.head, model) if args.head else sc.load_for_model(model)
    tok = model.tokenizer
    stop = tuple(model.config.eos_token_ids)
    budgets = [int(b) for b in args.budgets.split(",")]
    results = []
    t0 = time.perf_counter()
    for task in args.tasks.split(","):
        for ctx in [int(c) for c in args.contexts.split(",")]:
            insts = tasks.make_instances(task, ctx, args.num, seed=args.seed)
            for i, inst in enumerate(tqdm(insts, desc=f"{task}@{ctx}", file=sys.stderr)):
                ids = tok.encode(inst.prompt, add_special_tokens=False)
                tgt = tok.encode(inst.target, add_special_tokens=False)
                row = {"task": task, "context": ctx, "index": i, "prompt_tokens": len(ids),
                       "recall": recall_rows(model, head, ids + tgt, len(ids), budgets, args.max_queries,
                                             args.sink, args.recent, args.cover_k)}
                if args.accuracy:
                    max_new = len(tgt) + 8
                    full = get_method("full", model).run(PromptPieces(ids, [], []), max_new, stop)
                    row["full"] = metrics.score(inst.metric, tok.decode(full.token_ids), inst.answers)
                    for b in budgets:
                        pol = sc.SpeContext(budget=b, sink=args.sink, recent=args.recent)
                        out = decode.generate(model, pol, head, ids, max_new, stop,
                                              implementation=args.implementation)
                        pred = tok.decode(out["token_ids"])
                        row[f"spec_{b}"] = metrics.score(inst.metric, pred, inst.answers)
                        row[f"overlap_{b}"] = float(np.mean(out["overlap"] or [np.nan]))
                results.append(row)
    elapsed = time.perf_counter() - t0
    print_tables(results, budgets, args.accuracy, args.cover_k)
    print(f"\n{len(results)} instances, {elapsed:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "head": head.config.__dict__,
                                              "rows": results}, indent=1, default=str))


def print_tables(results, budgets, accuracy: bool, cover_k: int = 32) -> None:
    groups = sorted({(r["task"], r["context"]) for r in results}, key=lambda k: (k[0], k[1]))
    sels = ["head", "oracle", "streaming"]
    cols = " | ".join(f"{s} recall@{b} / mass" for s in sels for b in budgets)
    print(f"| task | context | n | {cols} |")
    print("|" + "---|" * (3 + len(sels) * len(budgets)))
    for task, ctx in groups:
        rows = [r for r in results if (r["task"], r["context"]) == (task, ctx)]
        cells = []
        for s in sels:
            for b in budgets:
                rec = np.mean([r["recall"][s][b][0] for r in rows])
                mass = np.mean([r["recall"][s][b][1] for r in rows])
                cells.append(f"{rec:.3f} / {mass:.3f}")
        print(f"| {task} | {ctx} | {len(rows)} | " + " | ".join(cells) + " |")
    print(f"\nglobal heads only (head_classes.json):\n| task | context | n | {cols} |")
    print("|" + "---|" * (3 + len(sels) * len(budgets)))
    for task, ctx in groups:
        rows = [r for r in results if (r["task"], r["context"]) == (task, ctx)]
        cells = [f"{np.mean([r['recall'][s][b][2] for r in rows]):.3f} / "
                 f"{np.mean([r['recall'][s][b][3] for r in rows]):.3f}" for s in sels for b in budgets]
        print(f"| {task} | {ctx} | {len(rows)} | " + " | ".join(cells) + " |")
    print(f"\ncover@{cover_k} (share of the true top-{cover_k} the selection holds):\n| task | context | n | "
          + " | ".join(f"{s} @{b}" for s in sels for b in budgets) + " |")
    print("|" + "---|" * (3 + len(sels) * len(budgets)))
    for task, ctx in groups:
        rows = [r for r in results if (r["task"], r["context"]) == (task, ctx)]
        cells = [f"{np.mean([r['recall'][s][b][4] for r in rows]):.3f}" for s in sels for b in budgets]
        print(f"| {task} | {ctx} | {len(rows)} | " + " | ".join(cells) + " |")
    if not accuracy:
        return
    print("\n| task | context | n | full | " + " | ".join(f"B={b} (overlap)" for b in budgets) + " |")
    print("|" + "---|" * (4 + len(budgets)))
    for task, ctx in groups:
        rows = [r for r in results if (r["task"], r["context"]) == (task, ctx)]
        acc = {b: np.mean([r[f"spec_{b}"] for r in rows]) for b in budgets}
        ovl = {b: np.nanmean([r[f"overlap_{b}"] for r in rows]) for b in budgets}
        cells = [f"{acc[b]:.3f} ({ovl[b]:.2f})" for b in budgets]
        full = np.mean([r["full"] for r in rows])
        print(f"| {task} | {ctx} | {len(rows)} | {full:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
