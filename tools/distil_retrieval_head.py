"""Distil the SpeContext retrieval head from a model (default: the embedded one) and ship it beside it.

    python -m tools.distil_retrieval_head --tap-layer 1 --context 2048,4096,8192 --num-seqs 168 \
        --steps 1500 --ckpt-dir runs/spec_head --export jaxkv/assets/default_model/retrieval_head

1. Teacher pass (once, cached in ``--cache``): ``--num-seqs`` instances of the task mixture (seeds
   disjoint from the eval seeds) at the ``--context`` lengths (a comma list is used in turn; all padded to
   the longest), prompt + reference answer (teacher forcing). For each, the residual stream after
   ``--key-layer`` layers (default ``--tap-layer``; the keys' input), the stream after ``--tap-layer``
   layers at the query positions (the query's input) and, at ``--queries`` query positions (the answer
   tokens first, i.e. the decode steps, then random prompt positions), the target's attention averaged
   over layers ``tap-layer..L-1`` (`jaxkv.policies.retrieve.distil`).
2. Training: the head (RMSNorm + Q/K projections, GQA shapes of the target) fits those distributions by
   cross-entropy (= KL + the teacher entropy, logged as KL), AdamW with warmup + cosine, a tqdm bar,
   orbax checkpoints (params, optimiser state, step; resumes from the newest), a JSONL log
   (``--log``) and a loss plot (``--plot``). ``--export`` writes the head with `save_head`.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the repository: the embedded model and the default outputs

TASK_MIX = ("mq_niah", "vt", "chain", "qa", "chat", "cwe", "fwe")
SEED_BASE = 1_000_000  # training instances use seeds >= this; evaluations use small seeds


def query_positions(n_prompt: int, n_total: int, q: int, rng: np.random.Generator) -> np.ndarray:
    """Decode-like positions first (last prompt token .. last answer token), then random prompt positions
    from the second half of the prompt; `q` distinct positions in ascending order."""
    ans = np.arange(n_prompt - 1, n_total - 1)[:q]
    rest = np.setdiff1d(np.arange(n_prompt // 2, n_prompt - 1), ans)
    extra = rng.choice(rest, size=q - len(ans), replace=False) if q > len(ans) else np.array([], int)
    return np.sort(np.concatenate([ans, extra])).astype(np.int32)


def build_teacher_data(model, args) -> dict:
    import jax.numpy as jnp
    from tqdm import tqdm

    from jaxkv.eval import tasks
    from jaxkv.policies.retrieve.distil import teacher_attention

    tok = model.tokenizer
    rng = np.random.default_rng(args.seed)
    xs, xqs, qs, ts, names = [], [], [], [], []
    contexts = [int(c) for c in str(args.context).split(",")]
    t = max(contexts)  # every sequence padded to the longest (causal: padding is never seen)
    mix = args.tasks.split(",") if args.tasks else TASK_MIX
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    for i in tqdm(range(args.num_seqs), desc="teacher", file=sys.stderr):
        task, ctx = mix[i % len(mix)], contexts[i % len(contexts)]
        if task.startswith("real_"):  # built with the model's tokenizer and chat frame, as jaxkv.eval does
            (inst,) = tasks.make_instances(task, ctx, 1, seed=SEED_BASE + args.seed + i, tokenizer=tok)
            ids = enc(inst.prefix) + [t for s in inst.segments for t in enc(s)] + enc(inst.suffix)
        else:
            inst = tasks.make_instance(task, ctx, SEED_BASE + args.seed, i)
            ids = enc(inst.prompt)
        full = ids + enc(inst.target)
        full = full[:t]
        qidx = query_positions(len(ids), len(full), args.queries, rng)
        toks = np.pad(np.asarray(full, np.int32), (0, t - len(full)))[None]
        x, xq, target = teacher_attention(model.params, model.config, jnp.asarray(toks), jnp.asarray(qidx),
                                          tap_layer=args.tap_layer, mean=True, key_layer=args.key_layer)
        xs.append(np.asarray(x, np.float32))
        xqs.append(np.asarray(xq, np.float32))
        qs.append(qidx)
        ts.append(np.asarray(target, np.float16))
        names.append(task)
    return {"x": np.stack(xs), "xq": np.stack(xqs), "qidx": np.stack(qs), "target": np.stack(ts),
            "task": np.array(names)}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, frac))))


def train(args) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    import jaxkv
    from jaxkv.policies.retrieve import specontext as sc
    from jaxkv.policies.retrieve.distil import distil_loss

    model = jaxkv.load(args.model)
    cache = Path(args.cache) if args.cache else None
    if cache and cache.exists():
        data = dict(np.load(cache))
        print(f"teacher data from {cache}", flush=True)
    else:
        t0 = time.perf_counter()
        data = build_teacher_data(model, args)
        print(f"teacher pass: {time.perf_counter() - t0:.0f} s", flush=True)
        if cache:
            cache.parent.mkdir(parents=True, exist_ok=True)
            np.savez(cache, **data)
    n = len(data["x"])
    n_val = max(1, n // 8)
    # Teacher entropy per row, to log KL = CE - H.
    t32 = data["target"].astype(np.float32)
    ent = -np.sum(np.where(t32 > 0, t32 * np.log(np.maximum(t32, 1e-30)), 0.0), axis=-1).mean(axis=(1, 2))
    if args.target_power != 1.0 or args.top_weight > 0:
        ent = np.zeros_like(ent)  # another loss: "kl" below logs the loss itself

    cfg = sc.HeadConfig.for_model(model.config, tap_layer=args.tap_layer, head_dim=args.head_dim,
                                  model_id=model.model_id, key_layer=args.key_layer)
    if "xq" not in data:  # a cache from before the two-stream teacher: x is the one (tap) stream
        if cfg.lagged:
            raise SystemExit(f"{cache} holds one stream; a lagged head needs a new teacher pass (--cache)")
        data["xq"] = np.take_along_axis(data["x"], data["qidx"][:, :, None], axis=1)
    head = sc.init_head(cfg, jax.random.PRNGKey(args.seed))
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr, weight_decay=0.01))
    params, opt_state = head.params, opt.init(head.params)

    loss_kw = {"power": args.target_power, "top_k": args.top_k, "top_weight": args.top_weight}

    @jax.jit
    def step_fn(params, opt_state, x, xq, qidx, target, lr):
        def loss_fn(p):
            return distil_loss(sc.RetrievalHead(p, cfg), x, qidx, target.astype(jnp.float32), xq=xq,
                               **loss_kw)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        opt_state[1].hyperparams["learning_rate"] = lr
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def eval_fn(params, x, xq, qidx, target):
        return distil_loss(sc.RetrievalHead(params, cfg), x, qidx, target.astype(jnp.float32), xq=xq,
                           **loss_kw)

    ckpt_dir = Path(args.ckpt_dir).resolve()
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    start = 0
    if mngr.latest_step() is not None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
        params, opt_state, start = restored["params"], restored["opt_state"], mngr.latest_step()
        print(f"resumed from orbax step {start}", flush=True)

    log = Path(args.log)
    log.parent.mkdir(parents=True, exist_ok=True)
    mode = "a" if start else "w"
    rng = random.Random(args.seed + start)
    vx, vxq, vq, vt = data["x"][:n_val], data["xq"][:n_val], data["qidx"][:n_val], data["target"][:n_val]
    val_ent = float(ent[:n_val].mean())
    loss = float("nan")
    with log.open(mode) as f, tqdm(range(start, args.steps), desc="distil", file=sys.stderr) as bar:
        for step in bar:
            b = rng.sample(range(n_val, n), min(args.batch, n - n_val))
            lr = lr_at(step, args.steps, args.lr, args.warmup)
            params, opt_state, loss = step_fn(params, opt_state, data["x"][b], data["xq"][b], data["qidx"][b],
                                              data["target"][b], jnp.float32(lr))
            row = {"step": step, "loss": float(loss), "kl": float(loss) - float(ent[b].mean()), "lr": lr}
            if step % args.eval_every == 0 or step == args.steps - 1:
                vl = float(eval_fn(params, vx, vxq, vq, vt))
                row |= {"val_loss": vl, "val_kl": vl - val_ent}
                bar.set_postfix(kl=f"{row['kl']:.3f}", val_kl=f"{row['val_kl']:.3f}")
            f.write(json.dumps(row) + "\n")
            if (step + 1) % args.checkpoint_every == 0:
                mngr.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    if mngr.latest_step() != args.steps:  # the loop saved it when steps is a multiple of the cadence
        state = {"params": params, "opt_state": opt_state}
        mngr.save(args.steps, args=ocp.args.StandardSave(state), force=True)
    mngr.wait_until_finished()
    if args.plot:
        plot_loss(log, Path(args.plot))
    if args.export:
        meta = {"teacher": model.model_id, "steps": args.steps, "context": args.context,
                "num_seqs": args.num_seqs, "queries": args.queries, "lr": args.lr, "batch": args.batch,
                "seed": args.seed, "final_train_loss": float(loss), "loss": loss_kw,
                "command": args.command}
        out = sc.save_head(args.export, sc.RetrievalHead(params, cfg), meta)
        size = sum(p.stat().st_size for p in out.iterdir())
        print(f"exported {out} ({size / 1024:.0f} KiB)", flush=True)


def plot_loss(log: Path, png: Path) -> None:
    """Train and held-out KL (head attention vs the target's layer-averaged attention) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    step = np.array([r["step"] for r in rows])
    kl = np.array([r["kl"] for r in rows])
    k = max(1, len(rows) // 100)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(step, kl, alpha=0.3, label="train KL (batch)")
    ax.plot(step, np.convolve(kl, np.ones(k) / k, mode="same"), label=f"train KL (mean of {k})")
    val = [(r["step"], r["val_kl"]) for r in rows if "val_kl" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="held-out KL")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(target attention || head attention), nats")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("SpeContext retrieval head distillation")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tools.distil_retrieval_head", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "jaxkv" / "assets" / "default_model"))
    ap.add_argument("--tap-layer", type=int, default=1, help="the head reads the stream after N layers")
    ap.add_argument("--key-layer", type=int, default=None,
                    help="keys read the stream after N layers (> --tap-layer: a lagged head whose query adds "
                         "the previous token's key stream; default: the tap layer)")
    ap.add_argument("--head-dim", type=int, default=None, help="head dimension (default: the model's)")
    ap.add_argument("--tasks", default=None,
                    help="comma-separated task mixture of the teacher sequences (default: the embedded "
                         "model's synthetic tasks; real-text tasks such as real_niah_multikey,real_vt "
                         "for any model)")
    ap.add_argument("--context", default="2048", help="context(s) of the teacher sequences, e.g. 2048,8192")
    ap.add_argument("--num-seqs", type=int, default=96)
    ap.add_argument("--queries", type=int, default=64, help="query positions per sequence")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-power", type=float, default=1.0,
                    help="teacher rows raised to this power and renormalised (> 1: fit its peaks)")
    ap.add_argument("--top-k", type=int, default=32, help="teacher keys of the top-set term")
    ap.add_argument("--top-weight", type=float, default=0.0,
                    help="weight of -log p_head(teacher's top-k keys) (0: plain KL)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--checkpoint-every", type=int, default=200)
    ap.add_argument("--ckpt-dir", default=str(ROOT / "runs" / "spec_head"))
    ap.add_argument("--cache", default=None, help="npz of the teacher pass (reused when it exists)")
    ap.add_argument("--log", default=str(ROOT / "docs" / "logs" / "retrieval_head_loss.jsonl"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "images" / "retrieval_head_loss.png"))
    ap.add_argument("--export", default=None, help="directory to write the head to (save_head)")
    args = ap.parse_args(argv)
    args.command = shlex.join(["python", "-m", "tools.distil_retrieval_head",
                               *(sys.argv[1:] if argv is None else argv)])
    if args.queries < 1 or args.num_seqs < 2 or args.steps < 1:
        ap.error("--queries >= 1, --num-seqs >= 2 and --steps >= 1 are required")
    train(args)


if __name__ == "__main__":
    main()
