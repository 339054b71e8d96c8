"""Profile every (layer, KV head) of a model on the task suite and write its head-class map.

    python -m tools.profile_heads [--model DIR] [--context 4096] [--num 8] [--global-fraction 0.25] \
        [--sink 64 --window 256] [--out DIR/head_classes.json] [--plot docs/images/head_profile.png]

    python -m tools.profile_heads --model smollm2 --tasks real_niah_multikey,real_vt --context 2048 \
        --out smollm2_head_classes.json                       # a real model, on real-text tasks

Per (layer, KV head), averaged over the G query heads of the group and over the answer-producing queries
(teacher-forced reference completions of the `--tasks` instances: the synthetic MQ-NIAH and VT by default,
or the real-text tasks sized with the model's own tokenizer, docs/eval.md):

* ``local_mass``   attention mass inside sink + window (architecture.md window semantics),
* ``retrieval``    attention mass on the needle tokens (the answers' occurrences in the context),
* ``prefix_delta`` relative change of the head's attention output on the last segment when everything
  before that segment is replaced by another instance's content (same positions).

Head classes: the ``global_fraction`` of heads with the highest ``(1 - local_mass) + retrieval +
prefix_delta`` stay ``global`` (the one with the highest retrieval score among them is marked
``retrieval`` when --retrieval-heads > 0); the others become ``local(sink, window)``. The map is written
with `jaxkv.cache.head_classes.HeadClassMap.save`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the repository: the embedded model


def _find(seq: list[int], sub: list[int], end: int) -> list[int]:
    """Start indices of `sub` in seq[:end]."""
    n = len(sub)
    return [i for i in range(end - n + 1) if seq[i : i + n] == sub]


def profile(model, context: int, num: int, sink: int, window: int, seed: int = 7,
            tasks: tuple[str, ...] = ("mq_niah", "vt")) -> dict[str, np.ndarray]:
    import jax
    import jax.numpy as jnp

    from jaxkv.eval.tasks import make_instances
    from jaxkv.models import llama
    from jaxkv.models.attention import dense_attention, visible

    cfg, params, tok = model.config, model.params, model.tokenizer
    H, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    nq = 32  # query positions profiled per instance

    def attend_stats(qidx, needle, region):
        def attend(layer, q, k, v, state):
            pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
            out = dense_attention(q, k, v, pos, pos, window=cfg.layer_windows[layer])
            qs = q[0, qidx].reshape(nq, H, G, -1)  # instance A only
            s = jnp.einsum("qhgd,khd->hgqk", qs, k[0], preferred_element_type=jnp.float32)
            s = s * cfg.head_dim**-0.5
            vis = visible(qidx, pos[0], 0)  # [nq, T]
            p = jax.nn.softmax(jnp.where(vis, s, -jnp.inf), axis=-1)
            loc = visible(qidx, pos[0], window, sink)
            local_mass = (p * loc).sum(-1).mean((1, 2))
            retr = (p * needle[None, None, None]).sum(-1).mean((1, 2))
            oa = out[0, region].reshape(-1, H, G, cfg.head_dim)
            ob = out[1, region].reshape(-1, H, G, cfg.head_dim)
            delta = jnp.linalg.norm((oa - ob).astype(jnp.float32), axis=(-1, -2)) / (
                jnp.linalg.norm(oa.astype(jnp.float32), axis=(-1, -2)) + 1e-6)
            state = state + [jnp.stack([local_mass, retr, delta.mean(0)])]
            return out, state

        return attend

    @jax.jit
    def run(tokens, qidx, needle, region):
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        _, stats = llama.forward(params, cfg, tokens, pos, attend_stats(qidx, needle, region), [])
        return jnp.stack(stats)  # [L, 3, H]

    acc = []
    for task in tasks:
        insts = make_instances(task, context, num + 1, seed=seed, tokenizer=tok)
        for a, b in zip(insts[:-1], insts[1:], strict=True):
            enc = lambda s: tok.encode(s, add_special_tokens=False)
            ids_a = enc(a.prompt) + enc(a.target)
            n_prompt = len(enc(a.prompt))
            pre, last = len(enc(a.prefix)), len(enc(a.prefix + "".join(a.segments[:-1])))
            seg_b = enc("".join(b.segments))
            mid = (seg_b * (1 + (last - pre) // max(1, len(seg_b))))[: last - pre]
            ids_b = ids_a[:pre] + mid + ids_a[last:]
            tlen = 1 << (len(ids_a) - 1).bit_length()
            tokens = np.zeros((2, tlen), np.int32)
            tokens[0, : len(ids_a)], tokens[1, : len(ids_b)] = ids_a, ids_b
            qpos = np.arange(n_prompt - 1, len(ids_a) - 1)
            qidx = qpos[np.linspace(0, len(qpos) - 1, nq).astype(int)].astype(np.int32)
            needle = np.zeros(tlen, np.float32)
            for ans in a.answers:
                for st in _find(ids_a, enc(ans), n_prompt):
                    needle[st : st + len(enc(ans))] = 1.0
            region = np.linspace(last, n_prompt - len(enc(a.suffix)) - 1, 64).astype(np.int32)
            acc.append(np.asarray(run(jnp.asarray(tokens), jnp.asarray(qidx), jnp.asarray(needle),
                                      jnp.asarray(region))))
    stats = np.mean(acc, axis=0)  # [L, 3, H]
    return {"local_mass": stats[:, 0], "retrieval": stats[:, 1], "prefix_delta": stats[:, 2]}


def classify(stats: dict[str, np.ndarray], global_fraction: float, sink: int, window: int,
             retrieval_heads: int = 0):
    from jaxkv.cache.head_classes import HeadClass, HeadClassMap

    if not 0.0 <= global_fraction <= 1.0:
        raise ValueError(f"--global-fraction must be in [0, 1], got {global_fraction}")
    score = (1 - stats["local_mass"]) + stats["retrieval"] + stats["prefix_delta"]
    L, H = score.shape
    n_global = int(round(global_fraction * L * H))
    order = np.argsort(-score, axis=None)[:n_global]
    kinds = np.full((L, H), "local", dtype=object)
    for flat in order:
        kinds[np.unravel_index(flat, (L, H))] = "global"
    if retrieval_heads and n_global:
        glob = [np.unravel_index(f, (L, H)) for f in order]
        for idx in sorted(glob, key=lambda i: -stats["retrieval"][i])[:retrieval_heads]:
            kinds[idx] = "retrieval"
    rows = []
    for layer in range(L):
        row = []
        for h in range(H):
            kind = kinds[layer, h]
            row.append(HeadClass.local(sink, window) if kind == "local" else HeadClass(kind))
        rows.append(tuple(row))
    return HeadClassMap(L, H, tuple(rows)), score


def plot(stats, score, hmap, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = hmap.kinds()
    code = {"local": 0, "global": 1, "retrieval": 2, "budget": 3}
    panels = [("mass in sink+window", stats["local_mass"]),
              ("needle attention (retrieval)", stats["retrieval"]),
              ("output change on prefix swap", stats["prefix_delta"]),
              ("class (0 local, 1 global, 2 retrieval)", np.vectorize(code.get)(kinds))]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, (name, data) in zip(axes, panels, strict=True):
        im = ax.imshow(data, aspect="auto", cmap="viridis")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.profile_heads", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "jaxkv" / "assets" / "default_model"))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tasks", default="mq_niah,vt",
                    help="comma list: synthetic tasks (mq_niah, vt, ...) or real-text ones "
                         "(real_niah_multikey, real_vt, ...) for any model")
    ap.add_argument("--num", type=int, default=8, help="instances per task")
    ap.add_argument("--global-fraction", type=float, default=0.25)
    ap.add_argument("--retrieval-heads", type=int, default=0)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", help="head_classes.json path (default: <model>/head_classes.json)")
    ap.add_argument("--stats-out", help="write the raw per-head statistics as JSON")
    ap.add_argument("--plot", help="heatmap PNG path")
    args = ap.parse_args(argv)
    if not 0.0 <= args.global_fraction <= 1.0:
        ap.error(f"--global-fraction must be in [0, 1], got {args.global_fraction}")
    if args.window < 1 or args.sink < 0:
        ap.error("--window must be >= 1 and --sink >= 0")
    import jaxkv

    if not args.out and not Path(args.model).is_dir():
        ap.error("--out is needed when --model is not a checkpoint directory")
    model = jaxkv.load(args.model)
    tasks = tuple(t for t in args.tasks.split(",") if t)
    stats = profile(model, args.context, args.num, args.sink, args.window, tasks=tasks)
    hmap, score = classify(stats, args.global_fraction, args.sink, args.window, args.retrieval_heads)
    out = Path(args.out) if args.out else Path(args.model) / "head_classes.json"
    hmap.save(out)
    print(f"wrote {out}: {hmap.counts()}")
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps({k: v.tolist() for k, v in stats.items()}
                                                   | {"score": score.tolist(), "context": args.context}))
    if args.plot:
        plot(stats, score, hmap, Path(args.plot),
             f"{Path(args.model).name}: {args.context} tokens, global fraction {args.global_fraction}")
        print(f"wrote {args.plot}")
    for layer in range(score.shape[0]):
        cells = [f"h{h} loc={stats['local_mass'][layer, h]:.2f} ret={stats['retrieval'][layer, h]:.2f} "
                 f"dlt={stats['prefix_delta'][layer, h]:.2f} {hmap[layer, h].kind[0]}"
                 for h in range(score.shape[1])]
        print(f"layer {layer}: " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
