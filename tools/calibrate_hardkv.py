"""Fit HARD-KV's per-(layer, KV head) logit temperatures offline and store them beside the model.

    python -m tools.calibrate_hardkv --tasks mq_niah,vt,qa --context 2048 --num 8 --seed 7
    python -m tools.calibrate_hardkv --model /models/llama --out /models/llama/hardkv_calibration.json
    python -m tools.calibrate_hardkv --model smollm2 --tasks real_niah_multikey,real_vt --context 2048 \
        --out smollm2_hardkv_calibration.json                # real-text tasks, any model

For each calibration prompt the model runs densely over the whole prompt; at every layer the last
`window` queries are the observation window, and the temperature that makes the top-n* tokens of
softmax(g(z) / T) hold mass p (n* = what true attention needs for mass p) is solved per KV head by the
same bisection the policy uses online (`HardKV.temperatures`). The file holds the geometric mean over the
prompts; `hardkv` loads it automatically when it lies next to the model (`HardKV.bind`), which replaces the
per-compression bisection with a table lookup (the paper's "temperatures are stable" shortcut), and the
spread across prompts is printed so the stability claim can be checked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "jaxkv" / "assets" / "default_model"


def prompt_temperatures(model, policy, ids) -> np.ndarray:
    """[L, Hkv] temperatures solved on one prompt's observation window."""
    from jaxkv.models import llama
    from jaxkv.policies.base import NEG, Observation

    cfg, params = model.config, model.params
    n, w = len(ids), min(policy.window, len(ids))
    H, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    pos = jnp.arange(n, dtype=jnp.int32)

    def attend(layer, q, k, v, temps):
        qw = q[0, n - w:]  # [W, Hq, D]
        kpos = jnp.broadcast_to(pos, (1, H, n))
        qpos = pos[n - w:][None]
        logits = jnp.einsum("whgd,khd->hgwk", qw.reshape(w, H, G, -1).astype(jnp.float32),
                            k[0].astype(jnp.float32)) * cfg.head_dim ** -0.5
        vis = (pos[None, :] <= qpos[0][:, None])[None, None]  # [1, 1, W, N]
        logits = jnp.where(vis, logits, NEG)[None]
        obs = Observation(q=qw[None], q_pos=qpos, k=jnp.swapaxes(k, 1, 2), v=jnp.swapaxes(v, 1, 2),
                          k_pos=kpos, logits=logits, layer=layer)
        temps = temps.at[layer].set(policy.temperatures(obs)[0])
        from jaxkv.models.attention import dense_attention

        return dense_attention(q, k, v, pos[None], pos[None]), temps

    fwd = jax.jit(lambda p, t: llama.forward(p, cfg, t, pos[None], attend, jnp.zeros((cfg.num_layers, H)))[1])
    return np.asarray(fwd(params, jnp.asarray([ids], jnp.int32)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.calibrate_hardkv", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--tasks", default="mq_niah,vt,qa")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--num", type=int, default=8, help="prompts per task")
    ap.add_argument("--seed", type=int, default=7, help="keep apart from the eval seeds (101, 211, ...)")
    ap.add_argument("--p", type=float, default=0.9)
    ap.add_argument("--window", type=int, default=64, help="the policy's observation window (HardKV.window)")
    ap.add_argument("--transform", default="snapkv", choices=["snapkv", "vanilla"])
    ap.add_argument("--out", help="default: MODEL/hardkv_calibration.json")
    args = ap.parse_args(argv)

    import jaxkv
    from jaxkv.eval.tasks import make_instances
    from jaxkv.policies.compress.hardkv import CALIBRATION_FILE, HardKV, save_calibration

    if not args.out and not Path(args.model).is_dir():
        ap.error("--out is needed when --model is not a checkpoint directory")
    model = jaxkv.load(args.model)
    policy = HardKV(p=args.p, window=args.window, transform=args.transform)
    enc = lambda s: model.tokenizer.encode(s, add_special_tokens=False)
    prompts = [enc(i.prefix) + [t for s in i.segments for t in enc(s)] + enc(i.suffix)
               for task in args.tasks.split(",")
               for i in make_instances(task, args.context, args.num, args.seed, tokenizer=model.tokenizer)]
    logs = np.stack([np.log(prompt_temperatures(model, policy, ids))
                     for ids in tqdm(prompts, desc="calibrate")])
    temps = np.exp(logs.mean(0))
    out = Path(args.out) if args.out else Path(args.model) / CALIBRATION_FILE
    save_calibration(out, model, policy, temps)
    spread = logs.std(0)
    print(f"{len(prompts)} prompts; T per (layer, head): min {temps.min():.3f} median {np.median(temps):.3f} "
          f"max {temps.max():.3f}; std of log T across prompts: median {np.median(spread):.3f} "
          f"max {spread.max():.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
