"""Decode accuracy under *oracle* KV selections: can any SpeContext-style selector meet issue 12's target?

    python scripts/oracle_selection_accuracy.py --tasks chain,mq_niah --context 8192 \
        --budgets 256,512,1024 --num 8 --seed 0 [--selectors shared,layer,head] [--out r.json]

The retrieval head's recall is measured against oracles (`scripts/eval_retrieval_head.py`), but recall is
not accuracy. This script decodes greedily (full-attention prefill, then every step) with the selection
an oracle would make, so the answer to "is the accuracy target reachable by a better head?" is measured,
not inferred. Per decode step and KV head, with layers ``[0, tap)`` dense (``--tap``; default: the shipped
head's tap layer):

* ``shared``: the top-B of the layer-mean (layers tap..L-1) of the step's true GQA-max attention, read by
  every layer. The true attention comes from a full-attention pass of the same step, so this is the best
  *layer-shared* selection by that ranking: a SpeContext head (one selection per step for all layers) can
  at most match it.
* ``layer``: each layer's own top-B of its true attention, from its own query (an ideal per-layer selector;
  Quest's upper bound).
* ``head``: the shipped retrieval head through the library decode (`jaxkv.policies.retrieve.decode`).

The current token is always selected. Attention over a selection is the dense softmax masked to it, which
equals attending the selected slots only. Oracle selection runs outside the engine on purpose: an oracle
needs every layer's full attention each step, which no serving path computes.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _masked_attend(q, kl, vl, mask):
    """q [1, 1, Hq, D], kl/vl [1, N, Hkv, D], mask [1, Hkv, N] ->
    (out [1, 1, Hq, D], probs [1, Hkv, G, N])."""
    import jax
    import jax.numpy as jnp

    _, n, hkv, d = kl.shape
    g = q.shape[2] // hkv
    qg = q[:, 0].reshape(1, hkv, g, d)
    logits = jnp.einsum("bhgd,bnhd->bhgn", qg, kl, preferred_element_type=jnp.float32) * d ** -0.5
    logits = jnp.where(mask[:, :, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhgn,bnhd->bhgd", probs.astype(vl.dtype), vl, preferred_element_type=jnp.float32)
    return out.reshape(1, 1, hkv * g, d).astype(q.dtype), probs


def _top_mask(score, visible, pos, budget: int):
    """score [1, Hkv, N] -> bool mask of the top-`budget` visible slots per head, the current token forced."""
    import jax
    import jax.numpy as jnp

    n = score.shape[-1]
    s = jnp.where(visible[:, None], score, -jnp.inf)
    s = jnp.where(jnp.arange(n)[None, None] == pos, jnp.inf, s)
    idx = jax.lax.top_k(s, min(budget, n))[1]
    mask = jnp.zeros(s.shape, bool)
    mask = jnp.put_along_axis(mask, idx, True, axis=-1, inplace=False)
    return mask & visible[:, None]


@functools.cache
def _step_fn(cfg, mode: str, budget: int, tap: int):
    import jax
    import jax.numpy as jnp

    from jaxkv.models import llama, rope

    def write(kc, vc, layer, k, v, pos):
        return (kc.at[layer, 0, pos].set(k[0, 0].astype(kc.dtype)),
                vc.at[layer, 0, pos].set(v[0, 0].astype(vc.dtype)))

    def run(params, x0, pos, kc, vc, masks):
        """One pass over the layers; masks(layer, q, kc_layer) -> [1, Hkv, N] selection (None = dense).
        Returns (x, kc, vc, per-layer GQA-max probs [L, 1, Hkv, N])."""
        freqs = rope.inv_freq(cfg)
        n = kc.shape[2]
        visible = jnp.arange(n)[None] <= pos
        recs = []

        def attend(layer, q, k, v, state):
            kc, vc = write(*state, layer, k, v, pos)
            m = masks(layer, q, kc[layer])
            if m is None:  # dense: every visible key of every KV head
                m = jnp.broadcast_to(visible[:, None], (1, kc.shape[3], n))
            out, probs = _masked_attend(q, kc[layer], vc[layer], m)
            recs.append(jnp.max(probs, axis=2))
            return out, (kc, vc)

        x, state = x0, (kc, vc)
        positions = jnp.full((1, 1), pos, jnp.int32)
        for i, p in enumerate(llama.layer_list(params)):
            x, state = llama.decoder_layer(p, cfg, i, x, positions, freqs, attend, state)
        return x, state[0], state[1], jnp.stack(recs)

    def step(params, tok, pos, kc, vc):
        x0 = params["embed"][tok][None, None]
        n = kc.shape[2]
        visible = jnp.arange(n)[None] <= pos
        if mode == "full":
            x, kc, vc, _ = run(params, x0, pos, kc, vc, lambda layer, q, kl: None)
        elif mode == "shared":
            _, kc, vc, rec = run(params, x0, pos, kc, vc, lambda layer, q, kl: None)
            sel = _top_mask(jnp.mean(rec[tap:], axis=0), visible, pos, budget)
            x, kc, vc, _ = run(params, x0, pos, kc, vc, lambda layer, q, kl: None if layer < tap else sel)
        elif mode == "layer":
            def per_layer(layer, q, kl):
                if layer < tap:
                    return None
                every = jnp.broadcast_to(visible[:, None], (1, kl.shape[2], n))
                _, probs = _masked_attend(q, kl, kl, every)
                return _top_mask(jnp.max(probs, axis=2), visible, pos, budget)
            x, kc, vc, _ = run(params, x0, pos, kc, vc, per_layer)
        else:
            raise ValueError(mode)
        hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        return llama.lm_head(params, cfg, hidden)[0, 0], kc, vc

    return jax.jit(step, donate_argnums=(3, 4))


@functools.cache
def _prefill_fn(cfg):
    import jax
    import jax.numpy as jnp

    from jaxkv.models import llama, rope
    from jaxkv.policies.retrieve.decode import dense_cache_attend

    def prefill(params, tokens, n_valid, kc, vc):
        t = tokens.shape[1]
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        attend = dense_cache_attend(cfg, positions)
        x, state = params["embed"][tokens], (kc, vc)
        for i, p in enumerate(llama.layer_list(params)):
            x, state = llama.decoder_layer(p, cfg, i, x, positions, rope.inv_freq(cfg), attend, state)
        last = jax.lax.dynamic_slice_in_dim(x, n_valid - 1, 1, axis=1)
        hidden = llama.rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
        return llama.lm_head(params, cfg, hidden)[0, 0], *state

    return jax.jit(prefill, donate_argnums=(3, 4))


def oracle_generate(model, ids: list[int], max_new: int, stop, mode: str, budget: int, tap: int) -> list[int]:
    """Greedy decode of one prompt, every step attending the `mode` oracle's selection."""
    import jax.numpy as jnp

    from jaxkv.policies.retrieve.decode import _bucket  # the library decode's dense-cache length bucket

    cfg, params = model.config, model.params
    n = len(ids)
    size = _bucket(n + max_new)
    dtype = params["embed"].dtype
    kc = jnp.zeros((cfg.num_layers, 1, size, cfg.num_kv_heads, cfg.head_dim), dtype)
    vc = jnp.zeros_like(kc)
    toks = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, _bucket(n) - n))[None])
    logits, kc, vc = _prefill_fn(cfg)(params, toks, jnp.int32(n), kc, vc)
    step = _step_fn(cfg, mode, budget, tap)
    out = []
    tok = int(np.argmax(np.asarray(logits)))
    while tok not in stop and len(out) < max_new:
        out.append(tok)
        if len(out) == max_new:
            break
        logits, kc, vc = step(params, jnp.int32(tok), jnp.int32(n + len(out) - 1), kc, vc)
        tok = int(np.argmax(np.asarray(logits)))
    return out


def _score(metrics, tok, inst, out: list[int]) -> float:
    return metrics.score(inst.metric, tok.decode(out), inst.answers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "jaxkv" / "assets" / "default_model"))
    ap.add_argument("--tasks", default="chain,mq_niah")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budgets", default="256,512,1024")
    ap.add_argument("--selectors", default="shared,layer,head")
    ap.add_argument("--heads", default=None,
                    help="comma list of retrieval head directories for the `head` selector, each reported as "
                         "head:<dir name> (default: the model's shipped head, reported as `head`)")
    ap.add_argument("--sink", type=int, default=0, help="the head selector's forced first positions")
    ap.add_argument("--recent", type=int, default=0, help="the head selector's forced newest positions")
    ap.add_argument("--tap", type=int, default=None,
                    help="layers [0, tap) of the oracles run dense (default: the shipped head's tap layer)")
    ap.add_argument("--num", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--implementation", default="reference", choices=["pallas", "reference"],
                    help="paged attention of the head's selection (the Pallas kernel's shared memory "
                         "does not fit B = 1024 at one page per head)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    import jaxkv
    from jaxkv.eval import metrics, tasks
    from jaxkv.policies.retrieve import decode
    from jaxkv.policies.retrieve import specontext as sc

    model = jaxkv.load(args.model)
    head = sc.load_for_model(model)
    tap = head.config.tap_layer if args.tap is None else args.tap
    if not 0 <= tap < model.config.num_layers:
        raise SystemExit(f"--tap must be in [0, {model.config.num_layers})")
    heads = {"head": head}
    if args.heads:
        heads = {f"head:{Path(d).name}": sc.load_head(d, model) for d in args.heads.split(",")}
    tok = model.tokenizer
    stop = tuple(model.config.eos_token_ids)
    budgets = [int(b) for b in args.budgets.split(",")]
    selectors = args.selectors.split(",")
    unknown = set(selectors) - {"shared", "layer", "head"}
    if unknown:
        raise SystemExit(f"unknown selectors {sorted(unknown)}; choose from shared, layer, head")
    selectors = [h for s in selectors for h in (heads if s == "head" else [s])]
    rows, t0 = [], time.perf_counter()
    for task in args.tasks.split(","):
        insts = tasks.make_instances(task, args.context, args.num, seed=args.seed)
        for i, inst in enumerate(tqdm(insts, desc=f"{task}@{args.context}", file=sys.stderr)):
            ids = tok.encode(inst.prompt, add_special_tokens=False)
            max_new = len(tok.encode(inst.target, add_special_tokens=False)) + 8
            score = functools.partial(_score, metrics, tok, inst)
            row = {"task": task, "index": i, "prompt_tokens": len(ids),
                   "full": score(oracle_generate(model, ids, max_new, stop, "full", 0, tap))}
            for b in budgets:
                for s in selectors:
                    if s in heads:
                        pol = sc.SpeContext(budget=b, sink=args.sink, recent=args.recent)
                        out = decode.generate(model, pol, heads[s], ids, max_new, stop,
                                              implementation=args.implementation)["token_ids"]
                    else:
                        out = oracle_generate(model, ids, max_new, stop, s, b, tap)
                    row[f"{s}@{b}"] = score(out)
            rows.append(row)
            print(json.dumps(row), flush=True)
    elapsed = time.perf_counter() - t0
    cols = [f"{s}@{b}" for b in budgets for s in selectors]
    print("\n| task | context | n | full | " + " | ".join(cols) + " |")
    print("|" + "---|" * (4 + len(cols)))
    for task in args.tasks.split(","):
        r = [x for x in rows if x["task"] == task]
        cells = " | ".join(f"{np.mean([x[c] for x in r]):.3f}" for c in cols)
        print(f"| {task} | {args.context} | {len(r)} | {np.mean([x['full'] for x in r]):.3f} | {cells} |")
    print(f"\n{len(rows)} instances, {elapsed:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
