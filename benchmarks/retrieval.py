"""Decode throughput of the retrieval policies against the full cache, in the same engine, plus the host
tier's bytes: what the diff loads move per step vs re-fetching the whole selection.

One engine per method (all heads global, prefix caching off, greedy, EOS ignored), `batch` random prompts
of `prompt` tokens, `new` (`--gen`) tokens each. Throughput counts only the engine steps that compiled
nothing (jaxkv.engine.runner / retrieval compilation counters unchanged), so the growing page bucket's
compiles do not pollute it. Bytes per decode step and sequence (SpeContext), layers tap..L-1: the selection
model (overlap of adjacent selections, `Retriever.slots_new`: ``B x (L - tap) x Hkv x 2 x D x itemsize``
per step re-fetched vs the new slots only), and with `--host-tier` the measured host -> device bytes of the
engine's diff loads from the pool's host mirror (`Retriever.transfer()`: moved including round padding,
needed, re-fetch baseline). `--cost` prints XLA's cost_analysis ("flops", "bytes accessed") of one decode
step (K = 1) per method at the context `prompt + new` instead (compile only; a CPU proxy).

    python -m benchmarks.retrieval --batch 16 --prompt 2048 --gen 32768 --budget 1024 --host-tier  # GPU
    python -m benchmarks.retrieval --batch 2 --prompt 64 --new 32 --budget 16 --page-size 4   # CPU smoke
    python -m benchmarks.retrieval --cost --methods full,specontext --gen 30720               # CPU proxy
    python -m benchmarks.retrieval --shape 1b --batch 16 --prompt 2048 --gen 32768 \\
        --methods full,specontext
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import append_jsonl, command_line, make_checkpoint, markdown_table, repo_root


def random_head_beside(model, num_heads: int | None = None, seed: int = 0, tap_layer: int = 1,
                       key_layer: int | None = None) -> None:
    """Saves a random-weight retrieval head beside `model` (a random-weight checkpoint made here): its
    selections mean nothing, but its cost per step is a distilled head's, which is what a speed run needs."""
    import jax

    from jaxkv.policies.retrieve import specontext as sc

    cfg = model.config
    hc = sc.HeadConfig.for_model(cfg, tap_layer=tap_layer, num_heads=num_heads or 2 * cfg.num_kv_heads,
                                 model_id=model.model_id, key_layer=key_layer)
    sc.save_head(Path(model.path) / sc.HEAD_DIR, sc.init_head(hc, jax.random.PRNGKey(seed)),
                 {"random": True, "seed": seed})


def load_model(args, tmp: str):
    """`--model` as is, or with `--shape` a random-weight checkpoint of that shape
    (`benchmarks.harness.make_checkpoint`) and a random retrieval head beside it."""
    import jaxkv

    if not args.shape:
        return jaxkv.load(args.model, dtype=args.dtype)
    path = Path(tmp) / args.shape
    make_checkpoint(args.shape, path, args.prompt + args.new + 1)
    model = jaxkv.load(path, dtype=args.dtype)
    random_head_beside(model, tap_layer=args.head_tap, key_layer=args.head_key_layer)
    return model


def _items(method: str) -> tuple[str, dict, list]:
    """A --methods entry -> (name, Engine keyword arguments from its `engine.X=V` items, the other items)."""
    name, *items = method.split(":")
    engine_kw = {}
    for item in [i for i in items if i.startswith("engine.")]:
        key, _, value = item[len("engine."):].partition("=")
        engine_kw[key] = json.loads(value)
    return name, engine_kw, [i for i in items if not i.startswith("engine.")]


def engine_kwargs(method: str) -> dict:
    """Engine options of a --methods entry, e.g. "full:engine.pipeline_decode=false" (values JSON)."""
    return _items(method)[1]


def policy_of(method: str):
    """A --methods entry -> the engine's kv_policy: "full" (None), a policy name, or
    "name:field=value:field=value" (values JSON, else strings), e.g. "specontext:key_dtype=bfloat16".
    Items "engine.X=V" are Engine options (`engine_kwargs`), not policy fields."""
    name, _, items = _items(method)
    if name == "full":
        return None
    if not items:
        return name
    from jaxkv.policies import get_policy

    fields = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--methods: {item!r} in {method!r} is not field=value")
        try:
            fields[key] = json.loads(value)
        except json.JSONDecodeError:
            fields[key] = value
    return get_policy(name, **fields)


def make_engine(model, method: str, args, **kw):
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine

    cfg = model.config
    policy = policy_of(method)
    pol = {} if policy is None else {"kv_policy": policy, "kv_budget": args.budget,
                                     "retrieval_host_tier": args.host_tier}
    kw = {**engine_kwargs(method), **kw}
    max_len = args.prompt + args.new + 1
    # Every row's whole context in the pool (the default pool budget would preempt real-size models).
    kw.setdefault("num_pages", args.batch * cfg.num_layers * cfg.num_kv_heads * -(-max_len // args.page_size))
    options = dict(max_num_seqs=args.batch, max_model_len=max_len, page_size=args.page_size,
                   max_step_tokens=args.max_step_tokens, enable_prefix_caching=False,
                   head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), **pol, **kw)
    return Engine(model, **{**options, **json.loads(getattr(args, "engine", None) or "{}")})  # --engine wins


def step_cost(model, method: str, args) -> dict:
    """cost_analysis of one decode dispatch (K = 1, `batch` rows, page bucket of `prompt + new`) on a pool
    of minimal size (its scatters would otherwise dominate the byte count; the step's reads of K/V are
    the page-table gathers, sized by the context)."""
    import jax.numpy as jnp

    from jaxkv.engine import retrieval, runner
    from jaxkv.engine.warmup import STOP_BUCKET

    cfg = model.config
    eng = make_engine(model, method, args, num_pages=cfg.num_layers * cfg.num_kv_heads * 2)
    s, L, H = args.batch, cfg.num_layers, cfg.num_kv_heads
    p = -(-(args.prompt + args.new) // args.page_size)
    d = dict(tokens=np.zeros(s, np.int32), positions=np.zeros(s, np.int32),
             slots=np.full((1, s, L, H), -1, np.int32), lengths=np.zeros((1, s, L, H), np.int32),
             prev_lengths=np.zeros((1, s, L, H), np.int32), active=np.zeros((1, s), bool),
             stop_ids=np.full((s, STOP_BUCKET), -1, np.int32), page_table=np.full((s, L, H, p), -1, np.int32),
             temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
             seeds=np.zeros(s, np.uint32), counters=np.zeros(s, np.int32), **eng.runner._heads)
    r, rn = eng.retriever, eng.runner
    if method == "full":
        lowered = runner._decode.lower(rn.params, rn.pool, {k: jnp.asarray(v) for k, v in d.items()},
                                       **rn._kw(True))
    else:
        pol = eng.kv_policy
        d |= dict(head_rows=np.arange(s, dtype=np.int32), known=np.ones(s, bool))
        lowered = retrieval._decode_retrieval.lower(
            rn.params, rn.pool, retrieval._on_device(d), r._state_for(pol), r.params_for(pol),
            r._page_state_for(pol), r.buffers.buffer_for(pol), r.buffers.host_for(pol), cfg=cfg, policy=pol,
            attn_impl=rn.attn_impl, greedy=True,
            local_layers=r.local_layers, chunk=r.buffers.chunk(pol, s))
    compiled = lowered.compile()
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, list) else c
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))
    return {"method": method, "budget": None if method == "full" else args.budget, "batch": s,
            "context": args.prompt + args.new, "flops": c.get("flops"),
            "bytes_accessed": c.get("bytes accessed"),
            "custom_calls": dict(targets)}


def start(model, method: str, args, seed: int):
    """An engine for `method` with `batch` random prompts of `prompt` tokens, `new` tokens each."""
    from jaxkv.sampling import SamplingParams

    eng = make_engine(model, method, args)
    rng = np.random.default_rng(seed)
    # tokens only, as the server asks for them: the random checkpoint's word-level tokenizer would
    # otherwise turn every token into text on the host between steps
    sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True, detokenize=False)
    for _ in range(args.batch):
        eng.add_request(rng.integers(10, model.config.vocab_size, args.prompt).tolist(), sp)
    return eng


def timed_steps(eng):
    """Runs `eng` to the end: per step (outputs, seconds, whether it compiled anything). Nothing blocks on
    the device between steps: a step returns when its tokens are on the host, while the engine may already
    have the next decode call on the device (pipelined decode), so the sum of step times is the wall time."""
    from jaxkv.engine import retrieval, runner

    compiles = lambda: runner.num_compilations() + retrieval.num_compilations()  # noqa: E731
    while eng.has_unfinished():
        c0, t0 = compiles(), time.perf_counter()
        outs = eng.step()
        yield outs, time.perf_counter() - t0, compiles() != c0


def run_method(model, method: str, args) -> dict:
    cfg = model.config
    eng = start(model, method, args, seed=0)
    steady_tokens, steady_s, all_tokens, t_all = 0, 0.0, 0, time.perf_counter()
    decode_started, steps, compiles, last_print = False, 0, 0, time.perf_counter()
    finished = True
    for outs, dt, compiled in timed_steps(eng):
        n = sum(len(o.new_token_ids) for o in outs)
        all_tokens += n
        steps, compiles = steps + 1, compiles + compiled
        if time.perf_counter() - last_print > args.progress_s:  # where a long run spends its time
            last_print = time.perf_counter()
            print(f"[{method}] {last_print - t_all:.0f}s: {steps} steps ({compiles} compiled), {all_tokens} "
                  f"tokens, {eng.scheduler.num_preemptions} preemptions, "
                  f"{eng.retriever.buffers.pages_offloaded} pages offloaded", file=sys.stderr, flush=True)
        if args.max_wall_s and time.perf_counter() - t_all > args.max_wall_s:
            finished = False   # a row that thrashes (e.g. preempting) reports what it did, not a timeout
            break
        decode_started = decode_started or (n > 0 and not eng.scheduler.waiting)
        if decode_started and not compiled and n:
            steady_tokens += n
            steady_s += dt
    r = eng.retriever.buffers
    row = {"method": method, "steps": steps, "compiled_steps": compiles, "finished": finished,
           "budget": None if policy_of(method) is None else args.budget, "tokens": all_tokens,
           "wall_s": time.perf_counter() - t_all, "steady_tokens": steady_tokens, "steady_s": steady_s,
           "tok_per_s": steady_tokens / steady_s if steady_s else float("nan"),
           "preemptions": eng.scheduler.num_preemptions, "pages_offloaded": r.pages_offloaded,
           "offload_passes": r.offload_passes,
           "device_pages": eng.allocator.num_pages}
    if method.split(":")[0] == "specontext":
        item = eng.runner.pool.k.dtype.itemsize
        tap = eng.retriever.params_for(eng.kv_policy).config.tap_layer
        per_slot = (cfg.num_layers - tap) * 2 * cfg.head_dim * item  # one KV head's slot, K + V, host layers
        row |= {"sel_steps": r.steps, "overlap": 1 - r.slots_new / max(r.slots_selected, 1),
                "bytes_full_per_step": r.slots_selected * per_slot / max(r.steps, 1),
                "bytes_diff_per_step": r.slots_new * per_slot / max(r.steps, 1),
                "diff_ratio": r.slots_selected / max(r.slots_new, 1)} | r.transfer()
    return row


def run_points(model, method: str, args) -> list[dict]:
    """Steady decode speed at fixed contexts: per point, `batch` prompts of that many tokens, then
    `--point-steps` engine steps of decode; steps that compiled nothing and decoded every row count."""
    from jaxkv.engine.engine import DEFAULT_DECODE_STEPS

    out = []
    for ctx in (int(c) for c in args.points.split(",")):
        new = DEFAULT_DECODE_STEPS * args.point_steps
        a = argparse.Namespace(**{**vars(args), "prompt": ctx, "new": new})
        eng = start(model, method, a, seed=ctx)
        started, tokens, secs = set(), 0, 0.0
        for outs, dt, compiled in timed_steps(eng):
            n = sum(len(o.new_token_ids) for o in outs)
            if len(started) == args.batch and not compiled and n == args.batch * eng.decode_steps:
                tokens, secs = tokens + n, secs + dt
            started |= {o.request_id for o in outs if o.new_token_ids}
        row = {"method": method, "context": ctx, "batch": args.batch, "steady_tokens": tokens,
               "ms_per_token_step": 1e3 * secs * args.batch / tokens if tokens else float("nan"),
               "preemptions": eng.scheduler.num_preemptions}  # > 0: the pool was too small, timings moot
        r = eng.retriever.buffers
        if r.slots_selected:  # what a step's diff load moved: 1 - overlap of the selection (a random head:
            row["overlap"] = 1 - r.slots_new / r.slots_selected  # little overlap, the load's worst case)
        out.append(row)
        print(json.dumps(row), flush=True)
        del eng
    return out


def estimate(points: list[dict], start: int, end: int) -> float:
    """tokens/s of decoding every row from context `start` to `end`, the step time interpolated linearly
    between the measured contexts (held flat outside them)."""
    xs = np.array([p["context"] for p in points], float)
    ys = np.array([p["ms_per_token_step"] for p in points], float)
    ctx = np.arange(start, end, 64, dtype=float)
    ms = np.interp(ctx, xs, ys).mean()
    return 1e3 / ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.retrieval", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(repo_root() / "jaxkv" / "assets" / "default_model"))
    ap.add_argument("--head-tap", type=int, default=1,
                    help="with --shape: the random head's tap layer (layers [0, tap) run dense every step)")
    ap.add_argument("--head-key-layer", type=int, default=None,
                    help="with --shape: a lagged random head whose keys read the stream after N layers")
    ap.add_argument("--shape", choices=("1b", "8b", "small"),
                    help="instead of --model: a random-weight checkpoint of this shape "
                         "with a random retrieval head (speed only: its selections mean nothing)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", default="full,specontext,quest")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", "--gen", dest="new", type=int, default=8192, help="generated tokens per request")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-step-tokens", type=int, default=2048)
    ap.add_argument("--host-tier", action="store_true",
                    help="SpeContext loads its selection diff from a host-memory mirror of the pool")
    ap.add_argument("--cost", action="store_true", help="cost_analysis of one decode step per method, no run")
    ap.add_argument("--out", help="JSON lines file")
    ap.add_argument("--points", help="contexts (comma-separated): steady decode step time at each instead of "
                                     "one long run; the table adds the [prompt -> prompt + gen] estimate")
    ap.add_argument("--max-wall-s", type=float, default=0.0,
                    help="stop a method after this many seconds and report it unfinished (0: run to the end)")
    ap.add_argument("--progress-s", type=float, default=15.0,
                    help="seconds between progress lines on stderr (steps, compiles, preemptions)")
    ap.add_argument("--point-steps", type=int, default=4, help="decode engine steps per point")
    ap.add_argument("--engine", default="{}",
                    help='Engine keyword arguments as JSON, over the benchmark\'s own, '
                         'e.g. \'{"page_classes": 1}\'')
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    model = load_model(args, tmp.name)
    cmd = command_line("benchmarks.retrieval", argv)
    if args.points:
        per = {m: run_points(model, m, args) for m in args.methods.split(",")}
        ctxs = [p["context"] for p in next(iter(per.values()))]
        header = ["method", *(f"ms / step @ {c}" for c in ctxs),
                  f"est. tok/s [{args.prompt} -> {args.prompt + args.new}]", "vs first"]
        lines, first = [], None
        for m, pts in per.items():
            tps = args.batch * estimate(pts, args.prompt, args.prompt + args.new)
            first = first or tps
            lines.append([m, *(f"{p['ms_per_token_step']:.3f}" for p in pts), f"{tps:.0f}",
                          f"{tps / first:.2f}x"])
        print(f"\n{cmd}\n{markdown_table(header, lines)}")
        return 0
    rows = []
    for method in args.methods.split(","):
        row = (step_cost if args.cost else run_method)(model, method, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            append_jsonl(args.out, row)
    print(f"\n{cmd}")
    if args.cost:
        print(markdown_table(["method", "batch", "context", "GFLOP / step", "GB accessed / step"],
                             [[r["method"], r["batch"], r["context"], f"{r['flops'] / 1e9:.3f}",
                               f"{r['bytes_accessed'] / 1e9:.3f}"] for r in rows]))
        return 0
    header = ["method", "budget", "decode tok/s (steady)", "vs full", "wall s", "overlap",
              "diff bytes/step/seq", "full re-fetch", "ratio", "host->device bytes/step/seq (moved / needed)",
              "re-fetch", "ratio"]
    base = rows[0]["tok_per_s"] if rows and rows[0]["method"] == "full" else float("nan")
    lines = []
    for r in rows:
        sel = ([f"{r['overlap']:.3f}", f"{r['bytes_diff_per_step'] / 1e6:.3f} MB",
                f"{r['bytes_full_per_step'] / 1e6:.3f} MB", f"{r['diff_ratio']:.1f}x"]
               if "overlap" in r else ["-"] * 4)
        h2d = ([f"{r['h2d_bytes_per_step'] / 1e6:.3f} / {r['h2d_bytes_needed_per_step'] / 1e6:.3f} MB",
                f"{r['h2d_bytes_refetch_per_step'] / 1e6:.3f} MB", f"{r['h2d_ratio']:.1f}x"]
               if "h2d_ratio" in r else ["-"] * 3)
        lines.append([r["method"], r["budget"] or "-", f"{r['tok_per_s']:.0f}",
                      f"{r['tok_per_s'] / base:.2f}",
                      f"{r['wall_s']:.1f}{'' if r['finished'] else ' (stopped)'}", *sel, *h2d])
    print(markdown_table(header, lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
