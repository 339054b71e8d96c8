"""Tensor parallelism over KV heads: decode throughput and TTFT at TP 1/2/4, head-class placement.

Random weights (bf16) are generated on the devices directly in their shards (`jax.random` under
`out_shardings` from the `jaxkv.parallel` table): a transformers checkpoint of the 8B shape costs ~16 GB of
disk and minutes of save + load, the 70B shape ~140 GB, and the timings do not depend on the values.

Rows (every one on the same machine in one run, ratios against TP 1 of the same run):

* decode: `batch` sequences of `context` cached tokens each (page tables filled by the engine's own
  `HeadPageTables`, the pool's slot positions written to match), the engine's multi-step decode
  (`ModelRunner.decode`, K steps per call), timed after a warm-up call; tokens/s = batch / step time.
* ttft: one prompt of `context` tokens through `Engine.step` (the fresh-prompt path), second run timed.
* head-class: a map with 10% global heads (the rest sink 64 + window 256) whose global heads sit together
  in checkpoint order (a few layers hold several, as profiled retrieval heads do), placed contiguously
  vs balanced (`jaxkv.parallel.placement`): the attention of one decode step over all layers (the part
  placement changes; per shard under shard_map, the slowest shard sets the time) and the full decode step.

    python -m benchmarks.tp --shape 8b --tp 1,2 --out results.md      # GPU (nvidia-h200-x2)
    python -m benchmarks.tp --shape 70b --tp 2 --only decode,ttft               # 70B shape
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.tp --small   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (
    COPY_BW,
    SHAPES,
    SINK,
    WINDOW,
    command_line,
    describe_device,
    markdown_table,
    model_config,
    time_device,
    write_json,
)


def log(*a):
    print(*a, flush=True)


def make_model(cfg, tp: int, dtype, placement_perm=None):
    """Random parameters created in their shards; `placement_perm` only recorded (random weights: a
    permuted random tree is another random tree), so the engine permutes its head-class map by it."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxkv.loading import Model
    from jaxkv.models import llama
    from jaxkv.parallel.mesh import make_mesh, param_specs

    mesh = make_mesh(tp) if tp > 1 else None
    shapes = llama.param_shapes(cfg)
    is_leaf = lambda s: isinstance(s, tuple)  # noqa: E731
    dummy = jax.tree.map(lambda s: np.zeros((1,) * len(s)), shapes, is_leaf=is_leaf)
    specs = param_specs(dummy, cfg, tp) if mesh is not None else jax.tree.map(lambda _: P(), dummy)
    cache = {}

    def make(path, shape, spec, key):
        name = str(getattr(path[-1], "key", path[-1]))
        # TP 1: uncommitted like jaxkv.load's arrays (committed params would make the donated pool's first
        # output committed and the second call compile again).
        sharding = NamedSharding(mesh, spec) if mesh is not None else None
        norm = "norm" in name
        fkey = (shape, str(spec), norm)
        if fkey not in cache:
            def f(k, shape=shape, norm=norm):
                if norm:
                    return jnp.ones(shape, dtype)
                return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
            cache[fkey] = jax.jit(f, out_shardings=sharding) if sharding is not None else jax.jit(f)
        return cache[fkey](key)

    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_leaf)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    keys = jax.random.split(jax.random.PRNGKey(0), len(flat))
    leaves = [make(p, s, sp, k) for (p, s), sp, k in zip(flat, spec_leaves, keys, strict=True)]
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    return Model(cfg, params, None, {}, f"bench-tp{tp}", Path("/nonexistent"), mesh, placement_perm)


def clustered_map(num_layers: int, hkv: int, frac: float = 0.10):
    """`frac` of the heads global, packed into as few layers as possible from the middle layers on, at
    the lowest head indices (checkpoint order); the rest local(SINK, WINDOW)."""
    from jaxkv.cache.head_classes import HeadClass, HeadClassMap

    n = max(1, round(frac * num_layers * hkv))
    per_layer = max(1, hkv // 2)
    g, loc = HeadClass.global_(), HeadClass.local(SINK, WINDOW)
    rows = [[loc] * hkv for _ in range(num_layers)]
    layer = num_layers // 4
    while n > 0:
        k = min(per_layer, n)
        for h in range(k):
            rows[layer % num_layers][h] = g
        n -= k
        layer += 1
    return HeadClassMap(num_layers, hkv, tuple(tuple(r) for r in rows))


ATTN_IMPL = None  # --attn-impl


def engine_for(model, hc, *, batch: int, context: int, steps: int, page_size: int):
    from jaxkv.cache.tables import HeadPageTables  # noqa: F401  (the engine's own tables are used)
    from jaxkv.engine.engine import Engine

    cfg = model.config
    tp = 1 if model.mesh is None else int(model.mesh.shape["tp"])
    max_len = context + 4 * steps
    probe = Engine(model, num_pages=cfg.num_layers * cfg.num_kv_heads * 2 * tp, page_size=page_size,
                   max_num_seqs=batch, max_model_len=max_len, max_step_tokens=steps, head_classes=hc,
                   enable_prefix_caching=False, decode_steps=steps, kv_cache_bytes=0, attn_impl=ATTN_IMPL)
    # Pages per (layer, head) of one sequence, in placed order; the pool is split evenly over the shards,
    # so it is sized by the shard that needs most (a contiguous placement of clustered global heads
    # needs more there: placement balances memory as well as time).
    per_head = probe.tables._pages_for(np.full((cfg.num_layers, cfg.num_kv_heads), context + steps))
    per_shard = per_head.reshape(cfg.num_layers, tp, -1).sum(axis=(0, 2)).max()
    del probe
    num_pages = tp * (batch * int(per_shard) + cfg.num_layers * cfg.num_kv_heads * 2)
    return Engine(model, num_pages=num_pages, page_size=page_size, max_num_seqs=batch, max_model_len=max_len,
                  max_step_tokens=steps, head_classes=hc, enable_prefix_caching=False, decode_steps=steps,
                  attn_impl=ATTN_IMPL)


def fill_context(engine, batch: int, context: int) -> list[str]:
    """Reserves `context` tokens per sequence through the engine's tables and writes the slot positions
    into the pool (K/V values stay zero: timings do not depend on them)."""
    import jax

    ps = engine.page_size
    pos = np.full((engine.allocator.num_pages * ps,), -1, np.int32)
    ids = []
    for i in range(batch):
        rid = f"bench-{i}"
        slots = engine.tables.append(rid, np.arange(context, dtype=np.int32), through_pool=False)
        t = np.broadcast_to(np.arange(context, dtype=np.int32)[:, None, None], slots.shape)
        ok = slots >= 0
        pos[slots[ok]] = t[ok]
        ids.append(rid)
    pool = engine.runner.pool
    pos = pos.reshape(-1, ps)
    from jaxkv.parallel.mesh import put

    # TP 1: uncommitted, like the engine's own pool (see make_model).
    engine.runner.pool = dataclasses.replace(pool, pos=put(pos, pool.pos.sharding) if engine.runner.mesh
                                             is not None else jax.numpy.asarray(pos))
    return ids


def decode_batch(engine, ids, context: int, steps: int, vocab: int):
    from jaxkv.engine.buckets import bucket_for
    from jaxkv.engine.runner import DecodeBatch

    cfg = engine.model.config
    L, H, K, S = cfg.num_layers, cfg.num_kv_heads, steps, len(ids)
    rng = np.random.default_rng(0)
    slots = [engine.tables.append(rid, np.arange(context, context + K, dtype=np.int32)) for rid in ids]
    P = bucket_for(max(engine.tables.max_pages(r) for r in ids), engine._page_buckets)
    b = DecodeBatch(
        tokens=rng.integers(3, vocab, size=S).astype(np.int32), positions=np.full(S, context, np.int32),
        slots=np.full((K, S, L, H), -1, np.int32), lengths=np.zeros((K, S, L, H), np.int32),
        prev_lengths=np.zeros((K, S, L, H), np.int32), active=np.ones((K, S), bool),
        page_table=np.full((S, L, H, P), -1, np.int32), stop_ids=np.full((S, 4), -1, np.int32),
        temperature=np.zeros(S, np.float32), top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32),
        seeds=np.zeros(S, np.uint32), counters=np.zeros(S, np.int32))
    for row, rid in enumerate(ids):
        b.slots[:, row] = slots[row]
        lens = engine.tables.recent_lengths(rid, K + 1)
        b.lengths[:, row], b.prev_lengths[:, row] = lens[1:], lens[:-1]
    engine.tables.fill_step(ids, b.page_table, np.zeros((S, L, H), np.int32))
    return b


def time_decode(engine, b, iters: int) -> tuple[float, float]:
    """-> (compile + first call s, ms per decode step); raises if a timed call compiled."""
    from jaxkv.engine.runner import num_compilations

    t0 = time.perf_counter()
    engine.runner.decode(b)
    first = time.perf_counter() - t0
    engine.runner.decode(b)  # the donated pool's first output may add a (no-compile) dispatch cache entry
    n = num_compilations()
    t0 = time.perf_counter()
    for _ in range(iters):
        engine.runner.decode(b)
    ms = 1e3 * (time.perf_counter() - t0) / (iters * b.slots.shape[0])
    if num_compilations() != n:
        log(f"WARNING: timed decode calls added {num_compilations() - n} cache entries")
    return first, ms


def attention_step(engine, b, iters: int) -> float:
    """ms of one decode step's paged attention over all layers (per shard; the slowest shard sets it)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxkv.parallel import shard as tps
    from jaxkv.parallel.mesh import batch_specs, local_config, pool_specs
    from pallas_kernels.paged_attention.api import (
        paged_attention,
        paged_attention_plan,
        paged_attention_with_plan,
    )

    cfg, runner = engine.model.config, engine.runner
    mesh = runner.mesh
    tp = 1 if mesh is None else int(mesh.shape["tp"])
    lcfg = local_config(cfg, tp)
    S = b.tokens.shape[0]
    meta = {"page_table": b.page_table, "lengths": b.prev_lengths[0], "sink": runner._heads["sink"],
            "window": runner._heads["window"]}
    q_seq = jnp.arange(S, dtype=jnp.int32)
    positions = jnp.asarray(b.positions)
    scale = cfg.head_dim ** -0.5

    def body(pool, m, q):
        if mesh is not None:
            m = tps.localize(m, pool.k.shape[0], pool.page_size)
        out = jnp.zeros((S, lcfg.num_heads, cfg.head_dim), jnp.float32)
        if runner.use_plan:
            plan = paged_attention_plan(pool.pos, m["page_table"].transpose(1, 0, 2, 3),
                                        m["lengths"].transpose(1, 0, 2), q_seq, positions, m["sink"],
                                        m["window"], num_q_heads=lcfg.num_heads, ordered=False)
        for layer in range(cfg.num_layers):
            ql = q[layer].astype(pool.k.dtype)
            if runner.use_plan:
                o, _ = paged_attention_with_plan(plan.layer(layer), ql, pool.k, pool.v, pool.pos,
                                                 m["page_table"][:, layer], scale=scale)
            else:
                o, _ = paged_attention(ql, pool.k, pool.v, pool.pos, m["page_table"][:, layer],
                                       m["lengths"][:, layer], q_seq, positions, m["sink"][layer],
                                       m["window"][layer], scale=scale)
            out = out + o.astype(jnp.float32)
        return out

    q = jax.random.normal(jax.random.PRNGKey(1), (cfg.num_layers, S, cfg.num_heads, cfg.head_dim))
    if mesh is not None:
        qspec = P(None, None, "tp", None)
        f = jax.jit(tps.shard_map(body, mesh, (pool_specs(runner.pool), batch_specs(meta), qspec),
                                  P(None, "tp", None)))
    else:
        f = jax.jit(body)
    return time_device(f, runner.pool, meta, q, iters=iters, warmup=1, rounds=1)


def step_floor_ms(cfg, tp: int, batch: int, hc, context: int, perm=None, dtype_bytes: int = 2) -> float:
    """(weights a shard reads + the slowest shard's KV bytes) / COPY_BW per decode step."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * d * (cfg.num_heads * 2 + cfg.num_kv_heads * 2) + 3 * h * i
    weights = (cfg.num_layers * per_layer + h * cfg.vocab_size) * dtype_bytes / tp
    kinds = hc.kinds()
    if perm is not None:
        kinds = np.take_along_axis(kinds, perm, axis=1)
    per_head = np.where(kinds == "global", context, min(context, SINK + WINDOW)).astype(np.float64)
    per_shard = per_head.reshape(cfg.num_layers, tp, -1).sum(-1).max(-1).sum()  # slowest shard per layer
    kv = per_shard * batch * 2 * d * dtype_bytes
    return 1e3 * (weights + kv) / COPY_BW


def time_ttft(model, context: int, page_size: int) -> tuple[float, float]:
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    engine = Engine(model, page_size=page_size, max_num_seqs=1, max_model_len=context + 16,
                    enable_prefix_caching=False, head_classes=None, attn_impl=ATTN_IMPL,
                    num_pages=(model.config.num_layers * model.config.num_kv_heads
                               * (-(-(context + 16) // page_size) + 2) * _tp(model)))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(2):
        prompt = rng.integers(3, model.config.vocab_size, size=context).tolist()
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def _tp(model) -> int:
    return 1 if model.mesh is None else int(model.mesh.shape["tp"])


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.tp", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per call (engine decode_steps)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--only", default="decode,ttft,headclass")
    ap.add_argument("--headclass-tp", type=int, default=None, help="TP of the placement rows (largest --tp)")
    ap.add_argument("--attn-impl", default=None, help="paged attention implementation (default: per backend)")
    ap.add_argument("--small", action="store_true",
                    help="CPU smoke: the small-tp4 shape, short context, fp32")
    ap.add_argument("--out", default=None, help="append the section to this markdown file")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    global ATTN_IMPL
    ATTN_IMPL = args.attn_impl
    if args.small:
        args.shape, args.batch, args.context, args.steps, args.iters = "small-tp4", 4, 64, 4, 1

    import jax
    import jax.numpy as jnp

    from jaxkv.cache.head_classes import all_global
    from jaxkv.parallel.placement import balanced_permutation, contiguous_permutation, global_counts

    dtype = jnp.float32 if args.small else jnp.bfloat16
    tps = [int(x) for x in args.tp.split(",")]
    only = set(args.only.split(","))
    cfg = model_config(args.shape, args.context + 4 * args.steps + 16)
    rows, results = [], {}
    log(f"devices: {jax.devices()}")

    def add(row, value, unit, floor=None, note=""):
        rows.append((row, value, unit, floor, note))
        log(f"{row}: {value:.4g} {unit}" + (f" (floor {floor:.4g})" if floor else "") + f" {note}")
        if args.json:
            write_json(args.json, [list(r) for r in rows])

    glob = all_global(cfg.num_layers, cfg.num_kv_heads)
    for tp in tps:
        model = make_model(cfg, tp, dtype)
        if "decode" in only:
            engine = engine_for(model, glob, batch=args.batch, context=args.context, steps=args.steps,
                                page_size=args.page_size)
            ids = fill_context(engine, args.batch, args.context)
            b = decode_batch(engine, ids, args.context, args.steps, cfg.vocab_size)
            first, ms = time_decode(engine, b, args.iters)
            results[("decode", tp)] = ms
            add(f"decode TP {tp}: step (batch {args.batch}, {args.context} ctx)", ms, "ms",
                step_floor_ms(cfg, tp, args.batch, glob, args.context), f"compile+first {first:.1f}s")
            add(f"decode TP {tp}: throughput", args.batch * 1e3 / ms, "tok/s")
            if tp > 1 and ("decode", 1) in results:
                add(f"decode TP {tp}: speed-up vs TP 1", results[("decode", 1)] / ms, "x")
            del engine, b
        if "ttft" in only:
            first, ttft = time_ttft(model, args.context, args.page_size)
            results[("ttft", tp)] = ttft
            add(f"ttft TP {tp}: one {args.context}-token prompt", ttft, "s", None, f"first run {first:.1f}s")
            if tp > 1 and ("ttft", 1) in results:
                add(f"ttft TP {tp}: speed-up vs TP 1", results[("ttft", 1)] / ttft, "x")
        del model

    htp = args.headclass_tp or max(tps)
    if "headclass" in only and htp > 1:
        hc = clustered_map(cfg.num_layers, cfg.num_kv_heads)
        counts = hc.counts()
        for name, perm in (("contiguous", contiguous_permutation(cfg.num_layers, cfg.num_kv_heads)),
                           ("balanced", balanced_permutation(hc, htp))):
            spread = global_counts(hc, perm, htp).max(1).sum()
            model = make_model(cfg, htp, dtype, perm)
            engine = engine_for(model, hc, batch=args.batch, context=args.context, steps=args.steps,
                                page_size=args.page_size)
            ids = fill_context(engine, args.batch, args.context)
            b = decode_batch(engine, ids, args.context, args.steps, cfg.vocab_size)
            attn = attention_step(engine, b, max(3, args.iters))
            _, ms = time_decode(engine, b, args.iters)
            results[("attn", name)], results[("step", name)] = attn, ms
            note = f"{counts['global']} global heads; sum over layers of the max per shard: {spread}"
            add(f"head-class TP {htp} {name}: attention of a decode step", attn, "ms", None, note)
            add(f"head-class TP {htp} {name}: decode step", ms, "ms",
                step_floor_ms(cfg, htp, args.batch, hc, args.context, perm))
            del engine, b, model
        add(f"head-class TP {htp}: balanced vs contiguous, attention", results[("attn", "contiguous")]
            / results[("attn", "balanced")], "x")
        add(f"head-class TP {htp}: balanced vs contiguous, decode step", results[("step", "contiguous")]
            / results[("step", "balanced")], "x")

    lines = [f"### {args.shape} shape, batch {args.batch}, {args.context} context", "",
             f"Command: `{command_line('benchmarks.tp', argv)}`", "",
             f"{describe_device()} Random {np.dtype(dtype).name} weights created in their shards; "
             f"decode = the engine's multi-step decode ({args.steps} steps per call, page size "
             f"{args.page_size}), timed over {args.iters} calls after a warm-up; floor = (weights per shard "
             f"+ the slowest shard's KV bytes) / {COPY_BW / 1e12:.1f} TB/s.", "",
             markdown_table(["row", "value", "unit", "floor", "note"],
                            [[row, f"{value:.4g}", unit, "" if floor is None else f"{floor:.4g}", note]
                             for row, value, unit, floor, note in rows])]
    text = "\n".join(lines) + "\n"
    log("\n" + text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
