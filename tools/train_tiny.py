"""Train the embedded default model (a tiny Llama-style GQA model) on the jaxkv task mixture.

    python -m tools.train_tiny --config configs/tiny_default.json --ckpt-dir runs/tiny \
        --export jaxkv/assets/default_model [--time-budget 540] [--init-from DIR] [--steps N]
    python -m tools.train_tiny --export-untrained jaxkv/assets/default_model

Parameters are kept under their Hugging Face names (``model.layers.0.self_attn.q_proj.weight`` with HF
``[out, in]`` shapes) so the export is a plain safetensors dump that `jaxkv.load` reads like any Llama
checkpoint. The forward follows HF Llama exactly (rotate-half RoPE, RMSNorm in fp32, SwiGLU) and runs
attention through `jax.nn.dot_product_attention` (cuDNN on GPU in bf16).

Training is jitted with a donated train state, logs a tqdm bar, saves orbax checkpoints (params, optimiser
state, step) every ``checkpoint_every`` steps and resumes from the newest one. ``--time-budget`` stops
cleanly (checkpoint + export) before an external wall-clock limit; ``--init-from`` starts from an
exported HF directory (params only; fresh optimiser state with a short warmup) so a run can continue on a
fresh machine from weights alone.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np

from jaxkv.eval import tasks as task_lib
from jaxkv.eval.vocab import (
    BOS,
    END_OF_TURN,
    EOS,
    PAD,
    build_tokenizer,
    tokenizer_config,
    vocabulary,
)

ROOT = Path(__file__).resolve().parents[1]  # the repository: configs/ and the default run directory
SHARD_BYTES = 15 * 2**20


# ----------------------------------------------------------------------------------------- model


def hf_config(model_cfg: dict) -> dict:
    tok = build_tokenizer()
    cfg = dict(model_cfg)
    cfg["vocab_size"] = len(vocabulary())
    cfg["bos_token_id"] = tok.token_to_id(BOS)
    cfg["eos_token_id"] = [tok.token_to_id(END_OF_TURN), tok.token_to_id(EOS)]
    cfg["pad_token_id"] = tok.token_to_id(PAD)
    cfg["torch_dtype"] = "float32"
    return cfg


def param_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    d, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h),
            p + "self_attn.k_proj.weight": (nk * d, h),
            p + "self_attn.v_proj.weight": (nk * d, h),
            p + "self_attn.o_proj.weight": (h, nq * d),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    return shapes


def init_params(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    std = cfg.get("initializer_range", 0.02)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            scale = std
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                scale = std / math.sqrt(2 * cfg["num_hidden_layers"])
            out[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def _rms(x, w, eps):
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    x32 = x32 * jax_rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * w.astype(jnp.float32)).astype(x.dtype)


def jax_rsqrt(x):
    import jax

    return jax.lax.rsqrt(x)


def _rope(x, positions, theta):
    """HF rotate-half RoPE on x [B, T, H, D] at integer positions [B, T], computed in fp32."""
    import jax.numpy as jnp

    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(ang), jnp.cos(ang)], -1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang), jnp.sin(ang)], -1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    rot = jnp.concatenate([-x2, x1], -1)
    return (x32 * cos + rot * sin).astype(x.dtype)


def forward(params, cfg, tokens, dtype, attn_impl=None):
    """Logits float32 [B, T, vocab] for tokens [B, T] at positions 0..T-1 (causal)."""
    import jax
    import jax.numpy as jnp

    b, t = tokens.shape
    d, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps = cfg["rms_norm_eps"]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    p = {k: v.astype(dtype) for k, v in params.items()}
    x = p["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        hn = _rms(x, p[pre + "input_layernorm.weight"], eps)
        q = (hn @ p[pre + "self_attn.q_proj.weight"].T).reshape(b, t, nq, d)
        k = (hn @ p[pre + "self_attn.k_proj.weight"].T).reshape(b, t, nk, d)
        v = (hn @ p[pre + "self_attn.v_proj.weight"].T).reshape(b, t, nk, d)
        q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attn_impl)
        x = x + o.reshape(b, t, nq * d) @ p[pre + "self_attn.o_proj.weight"].T
        hn = _rms(x, p[pre + "post_attention_layernorm.weight"], eps)
        g = jax.nn.silu(hn @ p[pre + "mlp.gate_proj.weight"].T) * (hn @ p[pre + "mlp.up_proj.weight"].T)
        x = x + g @ p[pre + "mlp.down_proj.weight"].T
    x = _rms(x, p["model.norm.weight"], eps)
    return (x @ p["lm_head.weight"].T).astype(jnp.float32)


# ---------------------------------------------------------------------------------------- export


def export_hf(params: dict[str, np.ndarray], cfg: dict, out_dir: Path, extra_config: dict | None = None,
              readme: str | None = None) -> None:
    """Write a Hugging Face Llama directory: config, sharded fp32 safetensors, tokenizer files."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("model*.safetensors*"):
        f.unlink()
    shards, cur, size = [], {}, 0
    for name in sorted(params):
        arr = np.asarray(params[name], np.float32)
        if cur and size + arr.nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = arr
        size += arr.nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        for k, a in shard.items():
            weight_map[k] = fname
            total += a.nbytes
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    conf = dict(cfg) | (extra_config or {})
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": END_OF_TURN, "pad_token": PAD, "unk_token": "<unk>"}, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "pad_token_id": cfg["pad_token_id"], "do_sample": False, "max_new_tokens": 300}, indent=2))
    if readme is not None:
        (out_dir / "README.md").write_text(readme)


def load_hf_params(model_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out |= {k: v.astype(np.float32) for k, v in load_file(str(f)).items()}
    return out


UNTRAINED_README = """# jaxkv embedded default model — UNTRAINED PLACEHOLDER

Random weights (seed 0) in the final architecture and tokenizer, so the loader and the server can be
built against the real files. `config.json` carries `"jaxkv_untrained": true`. It is replaced by the
trained model (see `docs/eval.md`) once `python -m tools.train_tiny` has run.
"""


# ------------------------------------------------------------------------------------------ data

_TOK = None


def _tok():
    global _TOK
    if _TOK is None:
        _TOK = build_tokenizer()
    return _TOK


def encode_instance(inst) -> tuple[list[int], int]:
    """Prompt + target + end-of-turn ids and the number of prompt tokens."""
    tok = _tok()
    prompt = tok.encode(inst.prompt).ids
    target = tok.encode(inst.target).ids + [tok.token_to_id(END_OF_TURN)]
    return prompt + target, len(prompt)


def copy_instance(rng: random.Random, context: int) -> task_lib.Instance:
    """Train-only warm-up: repeat a short word list (dense supervision for induction heads)."""
    words = task_lib._other_words()
    n = rng.randint(8, max(9, min(120, context // 6)))
    seq = [rng.choice(words) for _ in range(n)]
    prefix = task_lib.USER_OPEN + "say the words below .\n"
    return task_lib.Instance("copy", prefix, (" ".join(seq) + "\n",), "start . " + task_lib.ASSISTANT_OPEN,
                             " ".join(seq), tuple(seq), "chain")


def sample_instance(rng: random.Random, task: str, ctx: int) -> task_lib.Instance:
    if task == "copy":
        return copy_instance(rng, ctx)
    # Training goes below the eval minimum context (short warm-up phases); tasks refuse what cannot fit.
    return task_lib.TASKS[task](random.Random(rng.randrange(2**62)), ctx)


def make_batch(args) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [B, T], loss weights float32 [B, T] aligned with the *next*-token targets)."""
    seed, seq_len, batch, task_weights, min_frac, ctx_weight = args
    rng = random.Random(seed)
    names = sorted(task_weights)
    wts = [task_weights[n] for n in names]
    toks = np.zeros((batch, seq_len), np.int32)
    wgt = np.zeros((batch, seq_len), np.float32)
    for b in range(batch):
        ids, n_prompt = [], 0
        for _ in range(20):
            task = rng.choices(names, wts)[0]
            ctx = rng.randint(int(seq_len * min_frac), seq_len)
            try:
                inst = sample_instance(rng, task, ctx)
            except ValueError:
                continue
            ids, n_prompt = encode_instance(inst)
            if len(ids) <= seq_len:
                break
        if not ids or len(ids) > seq_len:
            continue
        toks[b, : len(ids)] = ids
        # weight[t] scores the prediction of token t+1 from position t.
        wgt[b, : len(ids) - 1] = ctx_weight
        wgt[b, n_prompt - 1 : len(ids) - 1] = 1.0
    return toks, wgt


def teacher_forced_eval(forward_fn, params, contexts, num, seed=1234) -> list[dict]:
    """Per task and context: fraction of instances whose whole reference completion is the argmax path
    (= greedy decoding reproduces it exactly) and per-token answer accuracy."""
    rows = []
    for ctx in contexts:
        for task in sorted(task_lib.TASKS):
            exact, tok_acc = [], []
            for inst in task_lib.make_instances(task, ctx, num, seed=seed):
                ids, n = encode_instance(inst)
                padded = np.zeros((1, 1 << (len(ids) - 1).bit_length()), np.int32)  # causal: pad is inert
                padded[0, : len(ids)] = ids
                logits = np.asarray(forward_fn(params, padded))[0]
                pred = logits[n - 1 : len(ids) - 1].argmax(-1)
                gold = np.asarray(ids[n:])
                exact.append(float((pred == gold).all()))
                tok_acc.append(float((pred == gold).mean()))
            rows.append({"task": task, "context": ctx, "tf_exact": float(np.mean(exact)),
                         "tf_token_acc": float(np.mean(tok_acc)), "num": num})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def phase(curriculum, progress: float) -> tuple[int, int]:
    """(seq_len, batch) of the curriculum entry [start_fraction, seq_len, batch] active at `progress`."""
    cur = curriculum[0]
    for c in curriculum:
        if progress >= c[0]:
            cur = c
    return cur[1], cur[2]


def lr_at(tc: dict, step: int, progress: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from lr to lr * min_lr_ratio over the progress."""
    warm = min(1.0, (step + 1) / max(1, tc["warmup_steps"]))
    lo = tc["min_lr_ratio"]
    return tc["lr"] * warm * (lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------------------- train


def train(args) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    conf = json.loads(Path(args.config).read_text())
    cfg = hf_config(conf["model"])
    tc = conf["train"] | ({"total_steps": args.steps} if args.steps else {})
    for key in ("lr", "min_lr_ratio", "warmup_steps", "min_context_fraction"):
        if getattr(args, key) is not None:
            tc[key] = getattr(args, key)
    if args.curriculum:
        tc["curriculum"] = json.loads(args.curriculum)
    if args.task_weights:
        extra = json.loads(args.task_weights)
        unknown = set(extra) - set(tc["task_weights"])
        if unknown:
            raise SystemExit(f"--task-weights: unknown tasks {sorted(unknown)}; "
                             f"known {sorted(tc['task_weights'])}")
        tc["task_weights"] = {**tc["task_weights"], **extra}
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    total = tc["total_steps"]
    # AdamW at unit rate; the step's learning rate multiplies the update (decoupled decay included).
    opt = optax.chain(optax.clip_by_global_norm(tc["grad_clip"]),
                      optax.adamw(1.0, b1=0.9, b2=0.95, weight_decay=tc["weight_decay"],
                                  mask=lambda p: {k: v.ndim == 2 for k, v in p.items()}))

    ckpt_dir = Path(args.ckpt_dir).resolve()
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))
    log_path = ckpt_dir / "loss_log.jsonl"
    start = 0
    if mngr.latest_step() is not None:
        params = {k: jnp.asarray(v) for k, v in init_params(cfg, tc["seed"]).items()}
        abstract = {"params": params, "opt_state": opt.init(params)}
        restored = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
        params, opt_state, start = restored["params"], restored["opt_state"], mngr.latest_step()
        print(f"resumed from orbax step {start}", flush=True)
    else:
        if args.init_from:
            params = {k: jnp.asarray(v) for k, v in load_hf_params(Path(args.init_from)).items()}
            print(f"initialised from {args.init_from} (fresh optimiser state)", flush=True)
        else:
            params = {k: jnp.asarray(v) for k, v in init_params(cfg, tc["seed"]).items()}
        opt_state = opt.init(params)
    attn_impl = "cudnn" if on_gpu else "xla"

    def loss_fn(p, toks, wgt):
        logits = forward(p, cfg, toks, dtype, attn_impl)
        logp = jax.nn.log_softmax(logits[:, :-1], -1)
        nll = -jnp.take_along_axis(logp, toks[:, 1:, None], -1)[..., 0]
        w = wgt[:, :-1]
        per_seq = (nll * w).sum(1) / jnp.maximum(w.sum(1), 1e-6)
        ans = w == 1.0
        acc = ((logits[:, :-1].argmax(-1) == toks[:, 1:]) & ans).sum() / jnp.maximum(ans.sum(), 1)
        return per_seq.mean(), acc

    def train_step(p, o, toks, wgt, lr):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, toks, wgt)
        updates, o = opt.update(grads, o, p)
        p = optax.apply_updates(p, jax.tree.map(lambda u: lr * u, updates))
        return p, o, loss, acc

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    t0 = time.time()
    run_start = start

    def progress(step):
        frac = (step - run_start) / max(1, total - run_start) if args.time_budget else step / total
        if args.time_budget:
            frac = max(frac, (time.time() - t0) / args.time_budget)
        return frac

    def batch_args(step):
        seq_len, bsz = phase(tc["curriculum"], progress(step))
        return (tc["seed"] * 1_000_003 + step + int(args.data_offset), seq_len, bsz, tc["task_weights"],
                tc["min_context_fraction"], tc["context_weight"])

    workers = max(1, min(args.workers, (os.cpu_count() or 2) - 1))
    pool = mp.get_context("spawn").Pool(workers) if workers > 1 else None
    pending: list = []
    step = start
    bar = tqdm(total=total, initial=start, desc="train", mininterval=2.0)
    log_f = open(log_path, "a")
    ema = None
    next_submit = start
    try:
        while step < total:
            if pool:
                while len(pending) < 2 * workers and next_submit < total:
                    pending.append(pool.apply_async(make_batch, (batch_args(next_submit),)))
                    next_submit += 1
                toks, wgt = pending.pop(0).get()
            else:
                toks, wgt = make_batch(batch_args(step))
            lr = lr_at(tc, step - (run_start if args.init_from else 0), progress(step))
            params, opt_state, loss, acc = train_step(params, opt_state, jnp.asarray(toks), jnp.asarray(wgt),
                                                      jnp.float32(lr))
            step += 1
            if step % tc["log_every"] == 0 or step == total:
                loss_v, acc_v = float(loss), float(acc)
                ema = loss_v if ema is None else 0.9 * ema + 0.1 * loss_v
                rec = {"step": step, "loss": loss_v, "answer_acc": acc_v, "seq_len": int(toks.shape[1]),
                       "lr": lr, "elapsed": round(time.time() - t0, 2)}
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
                bar.set_postfix(loss=f"{ema:.3f}", acc=f"{acc_v:.3f}", T=toks.shape[1])
            bar.update(1)
            if step % tc["checkpoint_every"] == 0:
                mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            if args.time_budget and time.time() - t0 > args.time_budget:
                print(f"\ntime budget reached at step {step}", flush=True)
                break
    finally:
        bar.close()
        log_f.close()
        if pool:
            pool.terminate()
    if mngr.latest_step() != step:
        mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
    mngr.wait_until_finished()
    print(f"trained to step {step} in {time.time() - t0:.0f}s", flush=True)
    if args.export:
        out = Path(args.export)
        export_hf({k: np.asarray(v) for k, v in params.items()}, cfg, out)
        (out / "train_state.json").write_text(json.dumps({"step": step, "config": str(args.config)}))
        readme = out / "README.md"
        if readme.exists() and "UNTRAINED" in readme.read_text():
            readme.unlink()
        if args.copy_log:
            shutil.copy(log_path, out / "loss_log.jsonl")
        print(f"exported to {out}", flush=True)
    if args.tf_eval:
        fwd = jax.jit(lambda p, t: forward(p, cfg, t, dtype, attn_impl))
        rows = teacher_forced_eval(fwd, params, [int(c) for c in args.tf_eval.split(",")], args.tf_num)
        if args.export:
            (Path(args.export) / "tf_eval.json").write_text(json.dumps(rows, indent=1))


def plot_loss(logs: list[Path], png: Path) -> None:
    """Answer loss and teacher-forced answer-token accuracy against step, context length shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, offset = [], 0
    for log in logs:  # continuation runs count steps from 0 again: lay them end to end
        part = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        rows += [r | {"step": r["step"] + offset} for r in part]
        offset = rows[-1]["step"] if rows else 0
    step = np.array([r["step"] for r in rows])
    loss = np.array([r["loss"] for r in rows])
    acc = np.array([r["answer_acc"] for r in rows])
    k = max(1, len(rows) // 200)
    smooth = lambda x: np.convolve(x, np.ones(k) / k, mode="same")
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    ax[0].plot(step, loss, alpha=0.3)
    ax[0].plot(step, smooth(loss))
    ax[0].set_ylabel("answer loss (nats/token)")
    ax[1].plot(step, acc, alpha=0.3)
    ax[1].plot(step, smooth(acc))
    ax[1].set_ylabel("answer token accuracy (teacher forced)")
    for a in ax:
        a.set_xlabel("step")
        prev = None
        for r in rows:
            if r["seq_len"] != prev:
                a.axvline(r["step"], color="gray", lw=0.5)
                a.text(r["step"], a.get_ylim()[1], f"{r['seq_len']}", fontsize=7, va="top")
                prev = r["seq_len"]
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tools.train_tiny", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny_default.json"))
    ap.add_argument("--ckpt-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--export", help="write the trained model here in Hugging Face layout")
    ap.add_argument("--export-untrained", help="write a random-weight model here and exit")
    ap.add_argument("--init-from", help="start from an exported HF directory (params only)")
    ap.add_argument("--steps", type=int, help="override train.total_steps")
    ap.add_argument("--curriculum", help="JSON [[start_fraction, seq_len, batch], ...]")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--task-weights", help='JSON {"task": weight, ...}; updates the config\'s task_weights')
    ap.add_argument("--min-lr-ratio", type=float)
    ap.add_argument("--warmup-steps", type=int)
    ap.add_argument("--min-context-fraction", type=float)
    ap.add_argument("--data-offset", type=int, default=0, help="shift the data seed stream (continuations)")
    ap.add_argument("--time-budget", type=float, default=0.0, help="seconds; stop cleanly after this")
    ap.add_argument("--workers", type=int, default=8, help="data-generation processes")
    ap.add_argument("--tf-eval", help="comma-separated contexts for a teacher-forced eval after training")
    ap.add_argument("--tf-num", type=int, default=16)
    ap.add_argument("--copy-log", action="store_true", help="copy loss_log.jsonl into the export dir")
    ap.add_argument("--plot-loss", nargs="+", metavar="PATH",
                    help="LOG.jsonl [LOG2.jsonl ...] OUT.png: plot loss curves and exit")
    args = ap.parse_args(argv)
    if args.plot_loss:
        plot_loss([Path(p) for p in args.plot_loss[:-1]], Path(args.plot_loss[-1]))
        return
    if args.export_untrained:
        conf = json.loads(Path(args.config).read_text())
        cfg = hf_config(conf["model"])
        export_hf(init_params(cfg, 0), cfg, Path(args.export_untrained), {"jaxkv_untrained": True},
                  UNTRAINED_README)
        print(f"wrote untrained model to {args.export_untrained}")
        return
    train(args)


if __name__ == "__main__":
    main()
