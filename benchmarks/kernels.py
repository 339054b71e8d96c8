"""GPU benchmark (and --check parity run) of the jaxkv Pallas kernels against their anchors.

Each row times jaxkv and its anchor in the same run and the same way (default: device-throughput timing,
--iters calls enqueued back to back with one block at the end; `--timing host` = the old per-call host
clock) and the table with the exact command is printed (and with --out written to a "## Kernels" section).

    python -m benchmarks.kernels --check          # kernels vs jnp twins on the GPU, then benchmark
    python -m benchmarks.kernels --quick          # small contexts only
    python -m benchmarks.kernels --small --out /tmp/b.md   # tiny sizes, CPU interpret mode: logic check
"""

from __future__ import annotations

import argparse
import functools
import math
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (
    command_line,
    describe_device,
    markdown_table,
    time_device,
    time_host,
    time_state,
    write_section,
)
from pallas_kernels.attention_scores.api import attention_scores
from pallas_kernels.lse_merge.api import lse_merge
from pallas_kernels.paged_attention.api import (
    paged_attention,
    paged_attention_pallas,
    paged_attention_plan,
    paged_attention_with_plan,
)
from pallas_kernels.rewrite.api import rewrite
from pallas_kernels.rope_shift.api import rope_inv_freq, rope_shift

ROWS: list[tuple] = []      # (row, jaxkv, anchor, ratio, target, met)
HEADER_NOTES: list[str] = []   # lines printed above the table (machine copy ceiling, ...)
PAGED_ANCHOR_FALLBACK: list[str] = []   # "ctx/page" where cuDNN paged failed and the dense anchor stood in


def log(*a):
    print(*a, flush=True)


TIMING = {"method": "device", "rounds": 3}   # set from --timing / --rounds in main()


def timing_note(iters):
    if TIMING["method"] == "host":
        return (f"host timing: median of {iters} calls, each timed with the host clock around "
                "`block_until_ready` (includes dispatch + sync per call)")
    return (f"device-throughput timing: 2 warm-up calls, then {iters} calls enqueued back to back "
            f"(async dispatch, inputs rotated over 2 sets) and one block at the end; time / {iters}, median "
            f"of {TIMING['rounds']} such rounds")


def timeit(fn, *args, iters=10, alts=()):
    """ms per call of `fn` by the --timing method (`harness.time_device` / `harness.time_host`). `alts`:
    further argument tuples rotated with `args` (a fresh input per call)."""
    if TIMING["method"] == "host":
        return time_host(fn, *args, iters=iters, alts=alts)
    return time_device(fn, *args, iters=iters, rounds=TIMING["rounds"], alts=alts)


def timeit_state(step, state, iters=10):
    """For donating functions: state -> state (each call consumes the previous state, so inputs differ)."""
    return time_state(step, state, iters=iters, rounds=TIMING["rounds"], host=TIMING["method"] == "host")


def best_splits(make, inputs, args, alts=()):
    """Time the kernel for each --splits value (None = api heuristic); return (best ms, its splits)."""
    res = {}
    for ns in args.splits:
        try:
            res[ns] = timeit(make(ns), *inputs, iters=args.iters, alts=alts)
        except Exception as e:  # noqa: BLE001 - one split count failing must not lose the row
            log(f"  splits={ns} failed: {repr(e)[:300]}")
    log("  splits sweep (ms):", res)
    if not res:
        raise RuntimeError("every split count failed")
    ns = min(res, key=res.get)
    return res[ns], ns


def row(name, ours, anchor, ratio, target=None):
    ok = ratio is not None and math.isfinite(ratio)
    met = "" if target is None else ("yes" if ok and ratio >= target else "**no**")
    rs = f"{ratio:.2f}x" if ok else "n/a"
    ROWS.append((name, ours, anchor, rs, "" if target is None else f">= {target}x", met))
    log(f"ROW | {name} | {ours} | {anchor} | {rs} | {target} | {met}")


# ---------------------------------------------------------------- data
def uniform_pool(key, b, hkv, ctx, page, d, dtype=jnp.bfloat16, local=None):
    """jaxkv per-head pool: every (seq, head) owns ctx/page pages, slot i holds position i (ordered)."""
    mp = ctx // page
    n = b * hkv * mp
    k1, k2, k3 = jax.random.split(key, 3)
    k_pages = jax.random.normal(k1, (n, page, d), dtype)
    v_pages = jax.random.normal(k2, (n, page, d), dtype)
    perm = jax.random.permutation(k3, n).astype(jnp.int32)
    page_table = perm.reshape(b, hkv, mp)
    slot_pos = jnp.zeros((n, page), jnp.int32).at[page_table].set(
        (jnp.arange(mp, dtype=jnp.int32)[:, None] * page + jnp.arange(page, dtype=jnp.int32))[None, None])
    lengths = jnp.full((b, hkv), ctx, jnp.int32)
    return k_pages, v_pages, slot_pos, page_table, lengths


def decode_queries(key, b, hq, d, ctx, dtype=jnp.bfloat16):
    q = jax.random.normal(key, (b, hq, d), dtype)
    return q, jnp.arange(b, dtype=jnp.int32), jnp.full((b,), ctx - 1, jnp.int32)


# ---------------------------------------------------------------- check mode
def check(args):
    from tests.kernels._data import random_paged_case

    rng = np.random.default_rng(0)
    res = []
    for ring, q_lens, ordered in [(False, (1,) * 6, True), (False, (37, 1, 0, 64, 5, 2), True),
                                  (True, (1, 9, 3, 1, 1, 17), False)]:
        c = random_paged_case(rng, num_seqs=6, num_kv_heads=8, group=4, head_dim=128, page_size=16,
                              max_pages=40, q_lens=q_lens, ring=ring)
        sink = jnp.array([0, 4, 0, 16, 4, 0, 8, 4], jnp.int32)
        window = jnp.array([0, 64, 0, 100, 33, 0, 200, 17], jnp.int32)
        a = [jnp.asarray(c[k], jnp.bfloat16) if k in ("q", "k_pages", "v_pages") else jnp.asarray(c[k])
             for k in ("q", "k_pages", "v_pages", "slot_pos", "page_table", "lengths", "q_seq", "q_pos")]
        o1, l1 = paged_attention(*a, sink, window, scale=0.088, implementation="pallas", ordered=ordered)
        o2, l2 = paged_attention(*a, sink, window, scale=0.088, implementation="reference")
        o1, o2 = np.asarray(o1.astype(jnp.float32)), np.asarray(o2.astype(jnp.float32))
        rel = np.linalg.norm(o1 - o2) / max(np.linalg.norm(o2), 1e-9)
        fin = np.isfinite(np.asarray(l2))
        lerr = float(np.max(np.abs(np.asarray(l1)[fin] - np.asarray(l2)[fin]))) if fin.any() else 0.0
        same_inf = bool(np.array_equal(np.isinf(np.asarray(l1)), np.isinf(np.asarray(l2))))
        res.append((f"paged_attention ring={ring} q_lens={q_lens}", rel, lerr, same_inf and rel < 2e-2))
        sc1 = attention_scores(a[0], a[1], a[3], a[4], a[5], a[6], a[7], sink, window, l2, scale=0.088,
                               implementation="pallas")
        sc2 = attention_scores(a[0], a[1], a[3], a[4], a[5], a[6], a[7], sink, window, l2, scale=0.088,
                               implementation="reference")
        rel = float(np.linalg.norm(np.asarray(sc1 - sc2)) / max(np.linalg.norm(np.asarray(sc2)), 1e-9))
        res.append((f"attention_scores q_lens={q_lens}", rel, 0.0, rel < 2e-2))
    outs = jax.random.normal(jax.random.key(1), (4, 300, 128), jnp.float32)
    lses = jax.random.normal(jax.random.key(2), (4, 300)).at[1, :50].set(-jnp.inf)
    m1 = lse_merge(outs, lses, implementation="pallas")
    m2 = lse_merge(outs, lses, implementation="reference")
    rel = float(jnp.linalg.norm(m1[0] - m2[0]) / jnp.linalg.norm(m2[0]))
    res.append(("lse_merge", rel, float(jnp.max(jnp.abs(m1[1] - m2[1]))), rel < 1e-5))
    from pallas_kernels.rows_attention import rows_attention
    from pallas_kernels.rows_attention.reference import rows_attention as rows_twin

    t_rows = 3000
    pick = np.sort(rng.choice(t_rows - 64, 500, replace=False))
    q_pos = jnp.asarray(np.concatenate([pick, np.arange(t_rows - 64, t_rows), [-1] * 7]), jnp.int32)
    ks = jax.random.split(jax.random.key(4), 3)
    qr = jax.random.normal(ks[0], (q_pos.shape[0], 32, 128), jnp.bfloat16)
    kr, vr = (jax.random.normal(x, (t_rows, 8, 128), jnp.bfloat16) for x in ks[1:])
    o1, l1 = rows_attention(qr, kr, vr, q_pos, scale=0.088, implementation="split")
    o2, l2 = rows_twin(qr, kr, vr, q_pos, scale=0.088)
    o1, o2 = np.asarray(o1.astype(jnp.float32)), np.asarray(o2.astype(jnp.float32))
    rel = float(np.linalg.norm(o1 - o2) / np.linalg.norm(o2))
    fin = np.isfinite(np.asarray(l2))
    lerr = float(np.max(np.abs(np.asarray(l1)[fin] - np.asarray(l2)[fin])))
    res.append(("rows_attention split (cuDNN prefix + paged diagonal)", rel, lerr,
                rel < 2e-2 and lerr < 2e-2))
    for style in ("neox", "gptj"):
        n, page, d = 512, 16, 128
        ks = jax.random.split(jax.random.key(3), 3)
        k = jax.random.normal(ks[0], (n, page, d), jnp.bfloat16)
        v = jax.random.normal(ks[1], (n, page, d), jnp.bfloat16)
        pos = jax.random.randint(ks[2], (n, page), -1, 5000)
        src = jnp.arange(0, 200, dtype=jnp.int32).at[7].set(-1)
        dst = jnp.arange(256, 456, dtype=jnp.int32)
        dl = jax.random.randint(ks[0], (200,), -3000, 100000)
        inv = jnp.asarray(rope_inv_freq(d, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                      "original_max_position_embeddings": 8192}))
        r = rope_shift(k, v, pos, src, dst, dl, inv, style=style, implementation="reference")
        o = rope_shift(k.copy(), v.copy(), pos.copy(), src, dst, dl, inv, style=style,
                       implementation="pallas")
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(r, o, strict=True))
        res.append((f"rope_shift {style}", err, 0.0, err < 0.02))
    from tests.kernels._data import random_rewrite_case

    cs = random_rewrite_case(np.random.default_rng(5), s=4, layers=3, h=8, mp=40, p=16, d=128, maxsel=300)
    r = rewrite(*[jnp.asarray(x) for x in cs], implementation="reference")
    o = rewrite(*[jnp.asarray(x) for x in cs], implementation="pallas")
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
              for a, b in zip(r, o, strict=True))
    res.append(("rewrite", err, 0.0, err == 0.0))
    try:
        from pallas_kernels.head_class_prefill import api as hcp

        if hasattr(hcp, "check_gpu"):
            got = hcp.check_gpu(**({"t": 256} if args.small else {}))
            for impl, v in (got.items() if isinstance(got, dict) else [("all", got)]):
                ok = bool(v[-1]) if isinstance(v, (tuple, list)) else bool(v)
                errs = v[:-1] if isinstance(v, (tuple, list)) else ()
                res.append((f"head_class_prefill.check_gpu {impl}", *(list(errs) + [0.0, 0.0])[:2], ok))
        else:
            log("head_class_prefill.check_gpu missing: not checked")
    except Exception as e:  # noqa: BLE001 - the module is optional here
        log(f"head_class_prefill check unavailable: {repr(e)[:300]}")
    log("\nCHECK (rel err = ||pallas - twin|| / ||twin||; check_gpu rows: max|out err|, max|lse err|)")
    for name, rel, lerr, ok in res:
        log(f"CHECK {'PASS' if ok else 'FAIL'} {name}: rel={rel:.2e} lse_maxabs={lerr:.2e}")
    return all(r[-1] for r in res)


# ---------------------------------------------------------------- benchmarks
def on_gpu():
    return jax.default_backend() == "gpu"


def dpa(q, k, v, **kw):
    """jax.nn.dot_product_attention: cuDNN on the GPU; XLA elsewhere (--small on CPU: logic check only)."""
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn" if on_gpu() else None, **kw)


def bench_uniform_decode(ctx, page, b, args):
    hq, hkv, d = args.hq, args.hkv, args.d
    scale = 1 / math.sqrt(d)
    key = jax.random.key(ctx + page)
    kp, vp, pos, pt, lens = uniform_pool(key, b, hkv, ctx, page, d)
    q, q_seq, q_pos = decode_queries(jax.random.key(7), b, hq, d, ctx)
    q2 = jax.random.normal(jax.random.key(17), q.shape, q.dtype)
    zeros = jnp.zeros((hkv,), jnp.int32)
    nbytes = 2 * b * hkv * ctx * d * 2
    t_ours, _ = best_splits(lambda ns: jax.jit(lambda q, kp, vp, pos, pt, lens: paged_attention(
        q, kp, vp, pos, pt, lens, q_seq, q_pos, zeros, zeros, scale=scale, implementation="pallas",
        ordered=True, num_splits=ns)[0]), (q, kp, vp, pos, pt, lens), args,
        alts=[(q2, kp, vp, pos, pt, lens)])
    del kp, vp, pos, pt
    # cuDNN paged: pages hold all KV heads [blocks, page, Hkv, D]
    mp = ctx // page
    kc = jax.random.normal(key, (b * mp, page, hkv, d), jnp.bfloat16)
    vc = jax.random.normal(jax.random.key(3), (b * mp, page, hkv, d), jnp.bfloat16)
    ptc = jax.random.permutation(key, b * mp).astype(jnp.int32).reshape(b, 1, mp, 1)
    q4, q4b = q[:, None], q2[:, None]
    ones = jnp.ones((b,), jnp.int32)
    kvl = jnp.full((b,), ctx, jnp.int32)
    # cuDNN dense on contiguous [B, L, Hkv, D] (same bytes)
    kd = kc.reshape(b, ctx, hkv, d)
    vd = vc.reshape(b, ctx, hkv, d)
    dense = jax.jit(lambda q, k, v: dpa(q, k, v, scale=scale))
    t_dense = timeit(dense, q4, kd, vd, iters=args.iters, alts=[(q4b, kd, vd)])
    try:
        from jax._src.cudnn.fused_attention_stablehlo import paged_attention as cudnn_paged

        cud = jax.jit(lambda q, k, v, pt: cudnn_paged(q, k, v, ones, kvl, pt, pt, scale=scale))
        t_cudnn = timeit(cud, q4, kc, vc, ptc, iters=args.iters, alts=[(q4b, kc, vc, ptc)])
    except Exception as e:  # noqa: BLE001 - no cuDNN (CPU --small): the dense anchor stands in, logged
        log(f"cuDNN paged unavailable ({repr(e)[:120]}); anchor = dense attention")
        t_cudnn = t_dense
        PAGED_ANCHOR_FALLBACK.append(f"{ctx}/{page}")
    del kd, vd, kc, vc
    # deprecated Pallas-Triton paged attention (floor): pages [Hkv, N, page, D]
    t_floor = float("nan")
    try:
        if not (args.floor and on_gpu()):
            raise RuntimeError("not run (--floor, GPU only)")
        from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged

        kf = jax.random.normal(key, (hkv, b * mp, page, d), jnp.bfloat16)
        vf = jax.random.normal(jax.random.key(4), (hkv, b * mp, page, d), jnp.bfloat16)
        bt = ptc.reshape(b, mp)
        splits = 16 if mp % 16 == 0 else 1
        flo = jax.jit(lambda q, k, v, bt: pallas_paged.paged_attention(q, k, v, bt, kvl, k_splits=splits))
        t_floor = timeit(flo, q, kf, vf, bt, iters=args.iters, alts=[(q2, kf, vf, bt)])
        del kf, vf
    except Exception as e:  # noqa: BLE001 - the floor is best effort
        log("pallas floor:", repr(e)[:200])
    gbs = lambda t: nbytes / t / 1e6
    name = f"decode B={b} ctx={fmt_ctx(ctx)} page={page}"
    log(f"{name}: ours {t_ours:.3f} ms ({gbs(t_ours):.0f} GB/s) "
        f"cudnn_paged {t_cudnn:.3f} ({gbs(t_cudnn):.0f}) "
        f"cudnn_dense {t_dense:.3f} ({gbs(t_dense):.0f}) pallas_floor {t_floor:.3f} ({gbs(t_floor):.0f})")
    fb = " [cuDNN paged failed: dense anchor]" if f"{ctx}/{page}" in PAGED_ANCHOR_FALLBACK else ""
    row(f"{name}: vs cuDNN paged{fb} (GB/s)", f"{gbs(t_ours):.0f}", f"{gbs(t_cudnn):.0f}", t_cudnn / t_ours,
        0.9)
    row(f"{name}: vs cuDNN dense (GB/s)", f"{gbs(t_ours):.0f}", f"{gbs(t_dense):.0f}", t_dense / t_ours)
    if args.floor:
        row(f"{name}: vs Pallas-Triton paged floor (GB/s)", f"{gbs(t_ours):.0f}", f"{gbs(t_floor):.0f}",
            t_floor / t_ours)
    return t_cudnn


def fmt_ctx(ctx):
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def head_class_arrays(hkv):
    # 1 of 8 KV heads global (12.5%; the per-head sink/window arrays are per layer), rest sink 64 + window 256
    sink = jnp.array([0] + [64] * (hkv - 1), jnp.int32)
    window = jnp.array([0] + [256] * (hkv - 1), jnp.int32)
    return sink, window


def _interp():
    return not on_gpu()      # --small on CPU: Pallas interpret mode


def bench_headclass_decode(ctx, page, b, t_cudnn, args):
    """One layer, 1 of 8 KV heads global. jaxkv "plan amortised": the plan is built once outside the timed
    region (the engine builds it once per step for all layers), timed = q pad + kernel + merge + output.
    "per call": paged_attention_pallas with the plan built inside. Returns the best (schedule, splits)."""
    hq, hkv, d = args.hq, args.hkv, args.d
    kp, vp, pos, pt, lens = uniform_pool(jax.random.key(11), b, hkv, ctx, page, d)
    q, q_seq, q_pos = decode_queries(jax.random.key(7), b, hq, d, ctx)
    q2 = jax.random.normal(jax.random.key(17), q.shape, q.dtype)
    sink, window = head_class_arrays(hkv)
    run = jax.jit(lambda plan, q, kp, vp, pos, pt: paged_attention_with_plan(plan, q, kp, vp, pos, pt,
                                                                             scale=0.088)[0])
    res = {}
    for sched in args.schedules:
        for ns in args.splits:
            try:
                plan = jax.jit(lambda pos, pt, lens, ns=ns, sched=sched: paged_attention_plan(
                    pos, pt, lens, q_seq, q_pos, sink, window, num_q_heads=hq, ordered=True, num_splits=ns,
                    schedule=sched))(pos, pt, lens)
                res[(sched, ns)] = timeit(run, plan, q, kp, vp, pos, pt, iters=args.iters,
                                          alts=[(plan, q2, kp, vp, pos, pt)])
            except Exception as e:  # noqa: BLE001 - one config failing must not lose the row
                log(f"  head-class {sched} splits={ns} failed: {repr(e)[:300]}")
    log(f"  head-class plan-amortised sweep (ms): {res}")
    if not res:
        raise RuntimeError("every head-class config failed")
    sched, ns = min(res, key=res.get)
    t = res[(sched, ns)]
    t_call = float("nan")
    try:
        call = jax.jit(lambda q, kp, vp, pos, pt, lens: paged_attention_pallas(
            q, kp, vp, pos, pt, lens, q_seq, q_pos, sink, window, scale=0.088, ordered=True, num_splits=ns,
            schedule=sched, interpret=_interp())[0])
        t_call = timeit(call, q, kp, vp, pos, pt, lens, iters=args.iters, alts=[(q2, kp, vp, pos, pt, lens)])
    except Exception as e:  # noqa: BLE001
        log(f"  head-class per-call failed: {repr(e)[:300]}")
    target = TARGETS_HC.get(ctx)
    ceil = hkv / (1 + (hkv - 1) * 320 / ctx)
    name = f"head-class decode B={b} ctx={fmt_ctx(ctx)} page={page}"
    row(f"{name}, plan amortised (ms; {sched}, splits={ns}; bytes ceiling {ceil:.1f}x)",
        f"{t:.3f}", f"{t_cudnn:.3f}", t_cudnn / t, target)
    row(f"{name}, per call incl. plan (ms; same config)", f"{t_call:.3f}", f"{t_cudnn:.3f}", t_cudnn / t_call)
    return [(sched, ns)] + [(s_, ns) for s_ in args.schedules if s_ != sched]


TARGETS_HC = {32768: 6, 131072: 15}


def _padded_pages(pos, page):
    """Sorted positions -> [pages, page] slot positions, -1 past the end."""
    n = -(-len(pos) // page)
    return np.pad(pos.astype(np.int32), (0, n * page - len(pos)), constant_values=-1).reshape(n, page)


def compressed_positions(ctx, keep, sink=64, recent=256, seed=0):
    """What a compressing policy leaves a global head: `keep` of `ctx` positions (sinks, the recent window and
    a random retained middle), sorted, as the static rewrite stores them (contiguous, position order)."""
    sink, recent = min(sink, keep // 4), min(recent, keep // 2)   # tiny --small contexts
    middle = np.random.default_rng(seed).choice(np.arange(sink, ctx - recent), keep - sink - recent,
                                                replace=False)
    return np.sort(np.concatenate([np.arange(sink), middle, np.arange(ctx - recent, ctx)]))


def headclass_step_pool(key, layers, b, hkv, ctx, page, d, global_heads, sink=64, window=256,
                        global_keep=None):
    """One pool for `layers` layers: global heads (layer, head) in `global_heads` store the whole context
    (or, with `global_keep`, that fraction of it, as a compressing policy's rewrite leaves them), the others
    only their sink + window slots (positions [0, sink) and [ctx - window, ctx), ordered), as an evicting
    engine would. Returns pool arrays, page_table [L, B, Hkv, MP], lengths [L, B, Hkv], sink and window
    [L, Hkv]."""
    mp = ctx // page
    loc_pos = _padded_pages(np.concatenate([np.arange(sink), np.arange(ctx - window, ctx)]), page)
    glob_len = int(ctx * global_keep) if global_keep else ctx
    glob_pos = _padded_pages(compressed_positions(ctx, glob_len) if global_keep else np.arange(ctx), page)
    is_glob = np.zeros((layers, hkv), bool)
    for lh in global_heads:
        is_glob[lh] = True
    n_units = np.where(is_glob, len(glob_pos), len(loc_pos)).sum() * b
    perm = np.random.default_rng(0).permutation(n_units).astype(np.int32)
    pt = -np.ones((layers, b, hkv, mp), np.int32)
    slot_pos = np.empty((n_units, page), np.int32)
    nxt = 0
    for lyr in range(layers):
        for h in range(hkv):
            pos_u = glob_pos if is_glob[lyr, h] else loc_pos
            npg = len(pos_u)
            for s_ in range(b):
                ids = perm[nxt:nxt + npg]
                nxt += npg
                pt[lyr, s_, h, :npg] = ids
                slot_pos[ids] = pos_u
    lens = np.where(is_glob, glob_len, sink + window)[:, None, :].repeat(b, axis=1).astype(np.int32)
    sink_l = np.where(is_glob, 0, sink).astype(np.int32)
    window_l = np.where(is_glob, 0, window).astype(np.int32)
    k1, k2 = jax.random.split(key)
    kp = jax.random.normal(k1, (n_units, page, d), jnp.bfloat16)
    vp = jax.random.normal(k2, (n_units, page, d), jnp.bfloat16)
    return (kp, vp, jnp.asarray(slot_pos), jnp.asarray(pt), jnp.asarray(lens), jnp.asarray(sink_l),
            jnp.asarray(window_l), int(is_glob.sum()))


def bench_headclass_step(ctx, page, b, t_cudnn, cfgs, args, global_keep=None):
    """Whole decode step of a 10-layer x 8-KV-head model with 10% of KV heads global (head 0 of layers 0-7;
    layers 8-9 all local), the rest sink 64 + window 256: one multi-layer plan + 10 per-layer kernel calls
    in one jit. With `global_keep` the global heads hold only that fraction of the context (compressed by a
    policy, e.g. HARD-KV at 12.5 %). Anchor: dense cuDNN paged attention of one layer at this
    context (the whole, uncompressed cache), timed once (the uniform decode row) x 10."""
    layers, hq, hkv, d = 10, args.hq, args.hkv, args.d
    kp, vp, pos, pt, lens, sink_l, window_l, n_glob = headclass_step_pool(
        jax.random.key(21), layers, b, hkv, ctx, page, d, [(lyr, 0) for lyr in range(8)],
        global_keep=global_keep)
    q_seq = jnp.arange(b, dtype=jnp.int32)
    q_pos = jnp.full((b,), ctx - 1, jnp.int32)
    qs = jax.random.normal(jax.random.key(22), (layers, b, hq, d), jnp.bfloat16)
    qs2 = jax.random.normal(jax.random.key(23), (layers, b, hq, d), jnp.bfloat16)
    res = {}
    for sched, ns in cfgs:
        def step(qs, kp, vp, pos, pt, lens, sched=sched, ns=ns):
            plan = paged_attention_plan(pos, pt, lens, q_seq, q_pos, sink_l, window_l, num_q_heads=hq,
                                        ordered=True, num_splits=ns, schedule=sched)
            return jnp.stack([paged_attention_with_plan(plan.layer(lyr), qs[lyr], kp, vp, pos, pt[lyr],
                                                        scale=0.088)[0] for lyr in range(layers)])
        try:
            res[(sched, ns)] = timeit(jax.jit(step), qs, kp, vp, pos, pt, lens, iters=args.iters,
                                      alts=[(qs2, kp, vp, pos, pt, lens)])
        except Exception as e:  # noqa: BLE001
            log(f"  head-class step {sched} splits={ns} failed: {repr(e)[:300]}")
    log(f"  head-class step sweep (ms): {res}")
    if not res:
        raise RuntimeError("every head-class step config failed")
    sched, ns = min(res, key=res.get)
    t = res[(sched, ns)]
    units = layers * hkv
    glob_len = int(ctx * global_keep) if global_keep else ctx
    ceil = units * ctx / (n_glob * glob_len + (units - n_glob) * 320)
    comp = f", global heads compressed to {global_keep:.1%}" if global_keep else ""
    target = TARGETS_HC_COMPRESSED.get(ctx) if global_keep else TARGETS_HC.get(ctx)
    row(f"head-class step B={b} ctx={fmt_ctx(ctx)} page={page}: 10 layers x 8 KV heads, {n_glob} of {units} "
        f"global{comp}; multi-layer plan + 10 kernel calls vs 10 x dense cuDNN paged (1 timed x 10) "
        f"(ms; {sched}, splits={ns}; bytes ceiling {ceil:.1f}x)",
        f"{t:.3f}", f"{10 * t_cudnn:.3f}", 10 * t_cudnn / t, target)


# head-class decode at 128K, global heads under a 12.5 % budget
TARGETS_HC_COMPRESSED = {131072: 15}


def bench_headclass_prefill(ctx, args):
    hq, hkv, d, page = args.hq, args.hkv, args.d, 16
    kp, vp, pos, pt, lens = uniform_pool(jax.random.key(12), 1, hkv, ctx, page, d)
    q = jax.random.normal(jax.random.key(8), (ctx, hq, d), jnp.bfloat16)
    q2 = jax.random.normal(jax.random.key(18), (ctx, hq, d), jnp.bfloat16)
    q_seq = jnp.zeros((ctx,), jnp.int32)
    q_pos = jnp.arange(ctx, dtype=jnp.int32)
    sink, window = head_class_arrays(hkv)
    it = max(3, args.iters // 2)
    res = {}
    for bq in args.prefill_block_q:
        ours = jax.jit(lambda q, kp, vp, pos, pt, lens, bq=bq: paged_attention(
            q, kp, vp, pos, pt, lens, q_seq, q_pos, sink, window, scale=0.088, implementation="pallas",
            ordered=True, block_q=bq, num_splits=1)[0])
        try:
            res[bq] = timeit(ours, q, kp, vp, pos, pt, lens, iters=it, alts=[(q2, kp, vp, pos, pt, lens)])
        except Exception as e:  # noqa: BLE001
            log(f"prefill block_q={bq} failed: {repr(e)[:300]}")
    del kp, vp, pos, pt
    kd = jax.random.normal(jax.random.key(1), (1, ctx, hkv, d), jnp.bfloat16)
    vd = jax.random.normal(jax.random.key(2), (1, ctx, hkv, d), jnp.bfloat16)
    dense = jax.jit(lambda q, k, v: dpa(q, k, v, scale=0.088, is_causal=True))
    t_d = timeit(dense, q[None], kd, vd, iters=it, alts=[(q2[None], kd, vd)])
    target = 5 if ctx == 32768 else None
    log(f"prefill {ctx}: ours {res} ms, cudnn dense causal {t_d:.3f} ms")
    if res:
        bq, t = min(res.items(), key=lambda kv: kv[1])
        row(f"head-class prefill T={fmt_ctx(ctx)}, paged kernel over pages (ms, block_q={bq})", f"{t:.3f}",
            f"{t_d:.3f}", t_d / t)
    # pallas_kernels.head_class_prefill: fresh prompt, contiguous K/V, global heads by `global_impl`
    sk = tuple(int(x) for x in np.asarray(sink))
    wd = tuple(int(x) for x in np.asarray(window))
    k3, v3 = kd[0], vd[0]
    hc = {}
    try:
        from pallas_kernels.head_class_prefill.api import head_class_prefill
    except Exception as e:  # noqa: BLE001 - module missing or broken: rows say so
        log(f"head_class_prefill unavailable: {repr(e)[:300]}")
        head_class_prefill = None
    for impl in ("mosaic", "cudnn", "pallas"):
        name = f"head-class prefill T={fmt_ctx(ctx)}, head_class_prefill global_impl={impl} (ms)"
        if head_class_prefill is None:
            row(name, "unavailable", f"{t_d:.3f}", None)
            continue
        try:
            fn = jax.jit(lambda q, k, v, impl=impl: head_class_prefill(
                q, k, v, sk, wd, scale=0.088, global_impl=impl, interpret=_interp())[0])
            hc[impl] = timeit(fn, q, k3, v3, iters=it, alts=[(q2, k3, v3)])
            row(name, f"{hc[impl]:.3f}", f"{t_d:.3f}", t_d / hc[impl])
        except Exception as e:  # noqa: BLE001
            log(f"head_class_prefill {impl} failed: {repr(e)[:400]}")
            row(name, "unavailable", f"{t_d:.3f}", None)
    # local heads' tile sweep (block_q x pages_per_block of 16 keys) with the dense global impls
    tiles = [tuple(int(x) for x in t.split("x")) for t in args.prefill_local_tiles.split(",") if t]
    for impl in [i for i in ("cudnn", "mosaic") if i in hc]:
        for bq, ppb in tiles:
            try:
                fn = jax.jit(lambda q, k, v, impl=impl, bq=bq, ppb=ppb: head_class_prefill(
                    q, k, v, sk, wd, scale=0.088, global_impl=impl, interpret=_interp(),
                    local_block_q=bq, local_pages_per_block=ppb)[0])
                key = f"{impl}, local tiles {bq}x{ppb}"
                hc[key] = timeit(fn, q, k3, v3, iters=it, alts=[(q2, k3, v3)])
                log(f"  prefill {ctx} {key}: {hc[key]:.3f} ms")
            except Exception as e:  # noqa: BLE001
                log(f"head_class_prefill {impl} tiles {bq}x{ppb} failed: {repr(e)[:300]}")
    # local heads' launch sweep: (block_q x pages) x (num_warps x num_stages), global through cuDNN
    launches = [tuple(int(x) for x in t.split("x")) for t in args.prefill_local_launch.split(",") if t]
    for (bq, ppb), (nw, ns) in [(tl, ln) for tl in (tiles or [(32, 2)]) for ln in launches]:
        if "cudnn" not in hc:
            break
        try:
            fn = jax.jit(lambda q, k, v, bq=bq, ppb=ppb, nw=nw, ns=ns: head_class_prefill(
                q, k, v, sk, wd, scale=0.088, global_impl="cudnn", local_block_q=bq,
                local_pages_per_block=ppb, local_launch=(nw, ns))[0])
            key = f"cudnn, local tiles {bq}x{ppb} warps {nw} stages {ns}"
            hc[key] = timeit(fn, q, k3, v3, iters=it, alts=[(q2, k3, v3)])
            log(f"  prefill {ctx} {key}: {hc[key]:.3f} ms")
        except Exception as e:  # noqa: BLE001
            log(f"head_class_prefill local launch {bq}x{ppb} {nw}x{ns} failed: {repr(e)[:300]}")
    # local heads through cuDNN's sliding window + the sink keys by LSE merge (local_impl="cudnn")
    for impl in [i for i in ("cudnn", "mosaic") if i in hc]:
        try:
            fn = jax.jit(lambda q, k, v, impl=impl: head_class_prefill(
                q, k, v, sk, wd, scale=0.088, global_impl=impl, local_impl="cudnn")[0])
            key = f"{impl}, local cudnn window + sink"
            hc[key] = timeit(fn, q, k3, v3, iters=it, alts=[(q2, k3, v3)])
            log(f"  prefill {ctx} {key}: {hc[key]:.3f} ms")
        except Exception as e:  # noqa: BLE001
            log(f"head_class_prefill {impl} + local cudnn failed: {repr(e)[:400]}")
    if head_class_prefill is not None and hc:
        # where the time goes: the global heads alone (dense impl) and the local heads alone (paged kernel)
        glob = [h for h, w in enumerate(wd) if w == 0]
        loc = [h for h, w in enumerate(wd) if w > 0]
        g = hq // hkv
        qg = jnp.concatenate([q[:, h * g:(h + 1) * g] for h in glob], axis=1)
        ql = jnp.concatenate([q[:, h * g:(h + 1) * g] for h in loc], axis=1)
        parts = {"global heads only (cudnn)": (qg, k3[:, glob], v3[:, glob], (0,) * len(glob),
                                               (0,) * len(glob)),
                 "local heads only (paged kernel)": (ql, k3[:, loc], v3[:, loc], tuple(sk[h] for h in loc),
                                                     tuple(wd[h] for h in loc)),
                 "local heads only (cudnn window + sink)": (ql, k3[:, loc], v3[:, loc],
                                                            tuple(sk[h] for h in loc),
                                                            tuple(wd[h] for h in loc))}
        for name, (qq, kk, vv, s_, w_) in parts.items():
            try:
                li = "cudnn" if "cudnn window" in name else "pallas" if "paged" in name else None
                fn = jax.jit(lambda q, k, v, s_=s_, w_=w_, li=li: head_class_prefill(
                    q, k, v, s_, w_, scale=0.088, global_impl="cudnn", local_impl=li, interpret=_interp())[0])
                log(f"  prefill {ctx} breakdown, {name}: {timeit(fn, qq, kk, vv, iters=it):.3f} ms")
            except Exception as e:  # noqa: BLE001
                log(f"breakdown {name} failed: {repr(e)[:300]}")
    if hc:
        impl, t = min(hc.items(), key=lambda kv: kv[1])
        row(f"head-class prefill T={fmt_ctx(ctx)}, best head_class_prefill ({impl}) vs cuDNN flash causal, "
            "all heads (ms)", f"{t:.3f}", f"{t_d:.3f}", t_d / t, target)


def bench_copy_ceiling(args):
    """The machine's plain copy bandwidth: x + 1 over one big bf16 array (read + write counted)."""
    n = args.copy_bytes // 2
    x = jax.random.normal(jax.random.key(30), (n,), jnp.bfloat16)
    x2 = jax.random.normal(jax.random.key(31), (n,), jnp.bfloat16)
    t = timeit(jax.jit(lambda x: x + 1), x, iters=max(3, args.iters // 5), alts=[(x2,)])
    moved = 2 * n * 2
    note = (f"Device copy ceiling: `x + 1` over a {n * 2 / 2**30:.2f} GiB bf16 array, read + write counted: "
            f"{moved / t / 1e6:.0f} GB/s ({t:.3f} ms).")
    log(note)
    HEADER_NOTES.append(note)


def bench_rope(args):
    m, page, d = args.rope_pages, 16, args.d
    n = 2 * m
    ks = jax.random.split(jax.random.key(9), 3)
    k = jax.random.normal(ks[0], (n, page, d), jnp.bfloat16)
    v = jax.random.normal(ks[1], (n, page, d), jnp.bfloat16)
    pos = jax.random.randint(ks[2], (n, page), 0, 100000)
    src = jnp.arange(m, dtype=jnp.int32)
    dst = src + m
    dl = jax.random.randint(ks[0], (m,), -5000, 5000)
    inv = jnp.asarray(rope_inv_freq(d, 500000.0))
    # bytes, both sides: read + write of the moved pages' K, V and positions
    moved = 2 * m * page * (2 * d * 2 + 4)
    res = {}
    for style in ("neox", "gptj"):
        for block in args.rope_blocks:
            step = lambda st, style=style, block=block: rope_shift(*st, src, dst, dl, inv, style=style,
                                                                    implementation="pallas", block=block)
            try:
                t, st = timeit_state(step, (k, v, pos), iters=args.iters)
                k, v, pos = st
                res[(style, block)] = t
            except Exception as e:  # noqa: BLE001
                log(f"rope {style} block={block} failed: {repr(e)[:300]}")
                k = jax.random.normal(ks[0], (n, page, d), jnp.bfloat16)
                v = jax.random.normal(ks[1], (n, page, d), jnp.bfloat16)
                pos = jax.random.randint(ks[2], (n, page), 0, 100000)
    del k, v, pos
    # anchor: an in-place (donated) x + 1 over arrays holding exactly the moved pages' K, V and positions
    kc = jax.random.normal(ks[0], (m, page, d), jnp.bfloat16)
    vc = jax.random.normal(ks[1], (m, page, d), jnp.bfloat16)
    pc = jax.random.randint(ks[2], (m, page), 0, 100000)
    cp = jax.jit(lambda k, v, p: (k + 1, v + 1, p + 1), donate_argnums=(0, 1, 2))
    t_cp, (kc, vc, pc) = timeit_state(lambda st: cp(*st), (kc, vc, pc), iters=args.iters)
    log(f"rope: {res} ms; in-place copy of the same pages {t_cp:.3f} ms ({moved / t_cp / 1e6:.0f} GB/s)")
    # second anchor: a device memcpy of the same bytes (jit outputs must be fresh buffers: XLA copies)
    mc = jax.jit(lambda k, v, p: (jnp.copy(k), jnp.copy(v), jnp.copy(p)))
    try:
        t_mc = timeit(mc, kc, vc, pc, iters=args.iters)
        log(f"rope anchor: device copy (jnp.copy, new buffers) {t_mc:.3f} ms ({moved / t_mc / 1e6:.0f} GB/s)")
    except Exception as e:  # noqa: BLE001
        t_mc = None
        log(f"memcpy anchor failed: {repr(e)[:300]}")
    for style in ("neox", "gptj"):
        cand = {b: t for (s, b), t in res.items() if s == style}
        if cand:
            b, t = min(cand.items(), key=lambda kv: kv[1])
            row(f"RoPE shift + copy {style}, {m} pages of 16 vs in-place x + 1 of the same K/V/pos bytes "
                f"(GB/s read + write, block={b})", f"{moved / t / 1e6:.0f}", f"{moved / t_cp / 1e6:.0f}",
                t_cp / t, 0.7)
            if t_mc:
                row(f"RoPE shift + copy {style}, {m} pages of 16 vs device copy "
                    "(jnp.copy into new buffers) of "
                    f"the same bytes (GB/s read + write, block={b})", f"{moved / t / 1e6:.0f}",
                    f"{moved / t_mc / 1e6:.0f}", t_mc / t, 0.7)


def bench_rewrite(args):
    s, layers, h, page, d = args.rewrite_seqs, args.rewrite_layers, args.hkv, 16, args.d
    old, new = args.rewrite_len
    mp = old // page
    u = s * layers * h
    n = u * mp
    ks = jax.random.split(jax.random.key(10), 4)
    k = jax.random.normal(ks[0], (n, page, d), jnp.bfloat16)
    v = jax.random.normal(ks[1], (n, page, d), jnp.bfloat16)
    pos = jnp.tile(jnp.arange(page, dtype=jnp.int32), (n, 1))
    pt = jax.random.permutation(ks[2], n).astype(jnp.int32).reshape(s, layers, h, mp)
    lens = jnp.full((s, layers, h), old, jnp.int32)
    stride = old // new
    sel = jnp.sort(jax.random.randint(ks[3], (s, layers, h, new), 0, stride) + jnp.arange(new) * stride)
    cnt = jnp.full((s, layers, h), new, jnp.int32)
    moved = 2 * u * new * (2 * d * 2 + 4)
    res = {}
    for impl in ("pallas", "reference"):
        fn = jax.jit(lambda k, v, p, impl=impl: rewrite(k, v, p, pt, lens, sel, cnt, implementation=impl)[:3],
                     donate_argnums=(0, 1, 2))
        t, st = timeit_state(lambda st, fn=fn: fn(*st), (k, v, pos), iters=max(3, args.iters // 2))
        k, v, pos = st
        res[impl] = t
    log(f"rewrite {s}x{layers}x{h} heads {old}->{new}: {res} ms")
    row(f"rewrite {s} seqs x {layers} layers x {h} heads, {fmt_ctx(old)}->{fmt_ctx(new)} "
        "(ms; vs XLA gather/scatter twin)",
        f"{res['pallas']:.2f}", f"{res['reference']:.2f}", res["reference"] / res["pallas"])
    row("rewrite effective bandwidth (GB/s; moved bytes, read+write)",
        f"{moved / res['pallas'] / 1e6:.0f}", f"{moved / res['reference'] / 1e6:.0f}",
        res["reference"] / res["pallas"])


def _profile_decode(ctx, page, b, hc, sweep, it):
    from pallas_kernels.paged_attention import api as pa
    from pallas_kernels.paged_attention import kernel as pk

    hq, hkv, d = 32, 8, 128
    kp, vp, pos, pt, lens = uniform_pool(jax.random.key(ctx + page), b, hkv, ctx, page, d)
    q, q_seq, q_pos = decode_queries(jax.random.key(7), b, hq, d, ctx)
    sink, window = head_class_arrays(hkv) if hc else (jnp.zeros((hkv,), jnp.int32),) * 2
    name = f"{'headclass' if hc else 'uniform'} ctx={ctx // 1024}K page={page} B={b}"
    nbytes = 2 * b * hkv * ctx * d * 2
    full = jax.jit(lambda q, kp, vp, pos, pt, lens: pa.paged_attention(
        q, kp, vp, pos, pt, lens, q_seq, q_pos, sink, window, scale=0.088, implementation="pallas",
        ordered=True))
    t_full = timeit(full, q, kp, vp, pos, pt, lens, iters=it)
    prep = jax.jit(lambda pos, pt, lens: pa.paged_attention_plan(pos, pt, lens, q_seq, q_pos, sink, window,
                                                                  num_q_heads=hq, ordered=True))
    t_prep = timeit(prep, pos, pt, lens, iters=it)
    plan = prep(pos, pt, lens)
    meta, qpr = plan.meta, plan.qpos_rows
    qr = jnp.pad(q.reshape(b, hkv, hq // hkv, d), ((0, 0), (0, 0), (0, plan.rows - hq // hkv), (0, 0)))
    cfg = pa.default_config(b, b, hkv, pt.shape[-1], page)
    log(f"PROFILE {name}: full api {t_full:.3f} ms ({nbytes / t_full / 1e6:.0f} GB/s dense-equiv), "
        f"metadata {t_prep:.3f} ms, auto cfg {cfg}")
    ptf = pt.reshape(-1)

    def split_meta(ns, ppb):   # the plan's per-unit split sizes for this (splits, pages per block)
        return meta.at[..., 7].set(pk.unit_split_pages(meta[..., 4], ns, ppb, pa.SPLIT_PROGRAMS))

    def kern(ns, ppb, w, st):
        return jax.jit(lambda meta, qpr, qr, kp, vp, pos: pk.paged_attention_blocks(
            meta, qpr, qr, ptf, kp, vp, pos, scale=0.088, num_splits=ns, pages_per_block=ppb,
            max_pages=pt.shape[-1], num_warps=w, num_stages=st))

    def tk(ns, ppb, w, st):
        try:
            return timeit(kern(ns, ppb, w, st), split_meta(ns, ppb), qpr, qr, kp, vp, pos, iters=it)
        except Exception as e:  # noqa: BLE001
            log(f"  cfg {(ns, ppb, w, st)} failed: {repr(e)[:200]}")
            return float("nan")

    res = {}
    if sweep in ("full", "small"):
        keys = (64, 128, 256) if sweep == "full" else (64, 128, 256)
        stages = (2, 3, 4) if sweep == "full" else (2, 3)
        for kb in keys:
            for w in (4, 8):
                for st in stages:
                    res[(16, max(1, kb // page), w, st)] = tk(16, max(1, kb // page), w, st)
    best = min((v, k) for k, v in res.items() if v == v)[1] if res else (16, cfg[2], *pa.DECODE_LAUNCH)
    for ns in (4, 8, 16, 32, 64):
        if ns <= pt.shape[-1] // best[1]:
            res[(ns, *best[1:])] = tk(ns, *best[1:])
    for k_, v in sorted(res.items(), key=lambda kv: kv[1]):
        log(f"  kernel (splits, ppb, warps, stages)={k_}: {v:.3f} ms ({nbytes / v / 1e6:.0f} GB/s)")
    ns = max(2, cfg[1])
    m = split_meta(ns, best[1])
    o_p, l_p = kern(ns, *best[1:])(m, qpr, qr, kp, vp, pos)
    mg = jax.jit(lambda meta, o, l_: pk.merge_splits(meta, o, l_, out_dtype=jnp.bfloat16))
    log(f"  merge (splits={ns}): {timeit(mg, m, o_p, l_p, iters=it):.3f} ms")


def profile(args):
    """Where decode/prefill time goes: full API vs metadata vs kernel vs merge, and launch-config sweeps."""
    from pallas_kernels.paged_attention import api as pa

    hq, hkv, d = 32, 8, 128
    it = args.iters
    for ctx, page, b, hc, sweep in [(32768, 16, 32, False, "full"), (32768, 64, 32, False, "small"),
                                    (8192, 16, 32, False, "splits"), (32768, 16, 32, True, "splits"),
                                    (131072, 16, 8, True, "splits"), (131072, 64, 8, True, "splits")]:
        _profile_decode(ctx, page, b, hc, sweep, args.iters)
    # prefill: block_q x keys per block x warps
    ctx = 32768
    kp, vp, pos, pt, lens = uniform_pool(jax.random.key(12), 1, hkv, ctx, 16, d)
    q = jax.random.normal(jax.random.key(8), (ctx, hq, d), jnp.bfloat16)
    q_seq = jnp.zeros((ctx,), jnp.int32)
    q_pos = jnp.arange(ctx, dtype=jnp.int32)
    sink, window = head_class_arrays(hkv)
    res = {}
    for bq in (16, 32):
        for kb in (32, 64, 128):
            for w in (4, 8):
                for st in (2, 3):
                    f = jax.jit(functools.partial(
                        pa.paged_attention_pallas, q_seq=q_seq, q_pos=q_pos, sink=sink, window=window,
                        scale=0.088, ordered=True, block_q=bq, num_splits=1, pages_per_block=kb // 16,
                        num_warps=w, num_stages=st))
                    try:
                        res[(bq, kb, w, st)] = timeit(f, q, kp, vp, pos, pt, lens, iters=max(3, it // 2))
                    except Exception as e:  # noqa: BLE001
                        log(f"  prefill {(bq, kb, w, st)} failed: {repr(e)[:200]}")
    for k_, v in sorted(res.items(), key=lambda kv: kv[1]):
        log(f"  prefill 32K (block_q, keys, warps, stages)={k_}: {v:.3f} ms")


def engine_check():
    """The engine on this device: Pallas attention gives the twin's greedy tokens (tiny Mistral)."""
    import tempfile

    import jaxkv
    from jaxkv.sampling import SamplingParams
    from tests.hf_tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = jaxkv.load(make_tiny_checkpoint("mistral", tmp))
        prompts = [list(range(3, 9)), list(range(5, 24)), list(range(7, 40))]
        sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        kw = dict(page_size=4, max_step_tokens=16)
        a = jaxkv.generate(model, prompts, sp, attn_impl="pallas", **kw)
        r = jaxkv.generate(model, prompts, sp, attn_impl="reference", **kw)
        ok = [o.token_ids for o in a] == [o.token_ids for o in r]
        log(f"ENGINE {'PASS' if ok else 'FAIL'}: pallas {[o.token_ids for o in a]} "
            f"reference {[o.token_ids for o in r]}")
        return ok


def write_table(args, command, check_ok):
    lines = [f"Command: `{command}`", "",
             f"{describe_device()} Timing: {timing_note(args.iters)}. "
             "Ratio = anchor time / jaxkv time (higher is better for jaxkv).",
             f"Check mode (Pallas vs jnp twin on this GPU): {check_ok}.", ""]
    lines += [f"{h}" for h in HEADER_NOTES] + ([""] if HEADER_NOTES else [])
    lines.append(markdown_table(["row", "jaxkv", "anchor", "ratio", "target", "met"], ROWS))
    body = "\n".join(lines) + "\n"
    if args.out:
        write_section(args.out, "Kernels", body, keep_subsections=False)
    return "## Kernels\n\n" + body


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare every kernel with its twin first")
    ap.add_argument("--profile", action="store_true", help="decode/prefill time breakdown + config sweeps")
    ap.add_argument("--engine", action="store_true", help="engine greedy tokens: Pallas vs twin, tiny model")
    ap.add_argument("--quick", action="store_true", help="8K contexts only")
    ap.add_argument("--small", action="store_true",
                    help="tiny sizes so the whole script runs on CPU (Pallas interpret mode) in < 2 min: "
                         "checks the script's logic, the numbers mean nothing")
    ap.add_argument("--iters", type=int, default=None, help="calls per timing (default 50; 3 with --small)")
    ap.add_argument("--timing", choices=("device", "host"), default="device",
                    help="device: back-to-back async calls, one block (default); host: per-call host clock")
    ap.add_argument("--rounds", type=int, default=None, help="device timing: median of this many rounds")
    ap.add_argument("--only", default="decode,headclass,step,prefill,rope,rewrite")
    ap.add_argument("--rewrite-layers", type=int, default=4, help="36 needs ~97 GB; default scaled to 4")
    ap.add_argument("--out", default=None, help="Markdown file whose 'Kernels' section is replaced")
    ap.add_argument("--splits", default="auto,8,32",
                    help="split-K values swept for decode (auto = heuristic)")
    ap.add_argument("--schedules", default="grid,compact",
                    help="paged-attention launch schedules swept for the head-class decode rows")
    ap.add_argument("--floor", action="store_true",
                    help="also time the deprecated Pallas-Triton paged attention (jax.experimental ops)")
    ap.add_argument("--rope-blocks", default="1,2,4", help="rope_shift pages per program swept")
    ap.add_argument("--prefill-block-q", default="16", help="block_q swept for the paged prefill row")
    ap.add_argument("--prefill-local-launch", default="",
                    help="local heads' num_warps x num_stages swept (with each --prefill-local-tiles), "
                         "e.g. 8x3")
    ap.add_argument("--prefill-local-tiles", default="",
                    help="local heads' block_q x pages_per_block swept for head_class_prefill, "
                         "e.g. 32x2,64x4")
    ap.add_argument("--step-all-contexts", action="store_true",
                    help="whole-step head-class rows at every context (default: the target contexts)")
    ap.add_argument("--step-global-keep", type=float, default=0.125,
                    help="also time the whole-step head-class row at 128K with the global heads "
                         "compressed to "
                         "this fraction of the context (0 = skip)")
    ap.add_argument("--contexts", default="", help="decode contexts to run, e.g. 131072 (default: all)")
    ap.add_argument("--pages", default="", help="page sizes to run, e.g. 16 (default: 16,64)")
    ap.add_argument("--deadline-min", type=float, default=0.0,
                    help="skip the remaining benchmark groups once this many minutes have passed since start "
                         "(0 = none); the table is written either way")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    args.splits = [None if x == "auto" else int(x) for x in args.splits.split(",")]
    args.schedules = args.schedules.split(",")
    args.rope_blocks = [int(x) for x in args.rope_blocks.split(",")]
    args.prefill_block_q = [int(x) for x in args.prefill_block_q.split(",")]
    if args.iters is None:
        args.iters = 3 if args.small else 50
    TIMING["method"] = args.timing
    TIMING["rounds"] = args.rounds or (1 if args.small else 3)
    if args.small:
        args.hq, args.hkv, args.d = 16, 8, 64
        contexts, prefill_ctx = [1024], [256]
        args.rope_pages, args.rewrite_seqs, args.rewrite_len = 64, 2, (256, 32)
        args.rewrite_layers = min(args.rewrite_layers, 2)
        args.copy_bytes = 1 << 22
        pages = (16,)
        batch = lambda ctx: 2
    else:
        args.hq, args.hkv, args.d = 32, 8, 128
        # contexts with targets first, so a --deadline cuts the least important rows
        contexts = [8192] if args.quick else [32768, 131072, 8192]
        prefill_ctx = [c for c in (32768, 8192) if c in contexts]
        args.rope_pages, args.rewrite_seqs, args.rewrite_len = 65536, 32, (20480, 2048)
        args.copy_bytes = 2 << 30
        pages = (16, 64)
        batch = lambda ctx: 32 if ctx <= 32768 else 8
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
        prefill_ctx = [c for c in prefill_ctx if c in contexts]
    if args.pages:
        pages = tuple(int(p) for p in args.pages.split(","))
    command = command_line("benchmarks.kernels", argv)
    log("devices:", jax.devices(), "jax", jax.__version__)
    log("timing:", timing_note(args.iters))
    check_ok = "not run"
    if args.check:
        try:
            check_ok = "all PASS" if check(args) else "FAILURES (see log)"
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            check_ok = "crashed (see log)"
    if args.engine:
        try:
            ok = engine_check()
            HEADER_NOTES.append(f"Engine check (tiny Mistral, Pallas vs twin greedy tokens): "
                                f"{'PASS' if ok else 'FAIL'}.")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            HEADER_NOTES.append("Engine check: crashed (see log).")
    if args.profile:
        profile(args)
        return
    only = set(args.only.split(","))
    skipped = []

    def group(name, fn, *fargs):
        """Run fn(*fargs); past --deadline-min it is skipped (and listed above the table)."""
        el = (time.perf_counter() - t_start) / 60
        if args.deadline_min and el > args.deadline_min:
            log(f"SKIP {name}: deadline ({el:.1f} > {args.deadline_min} min)")
            skipped.append(name)
            return None
        t0 = time.perf_counter()
        try:
            return fn(*fargs)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            return None
        finally:
            now = time.perf_counter()
            log(f"[{name}: {now - t0:.0f} s; {(now - t_start) / 60:.1f} min total]")

    def decode_groups(ctxs):
        for ctx in ctxs:
            b = batch(ctx)
            for page in pages:
                tag = f"ctx={fmt_ctx(ctx)} page={page}"
                t_c = group(f"uniform decode {tag}", bench_uniform_decode, ctx, page, b, args) \
                    if "decode" in only else None
                if t_c is None:
                    continue
                cfgs = group(f"head-class decode {tag}", bench_headclass_decode, ctx, page, b, t_c, args) \
                    if "headclass" in only else None
                if "step" in only and (ctx in TARGETS_HC or args.small or args.step_all_contexts):
                    cfgs = cfgs or [(s_, None) for s_ in args.schedules]
                    group(f"head-class step {tag}", bench_headclass_step, ctx, page, b, t_c, cfgs, args)
                if "step" in only and args.step_global_keep and (ctx in TARGETS_HC_COMPRESSED or args.small):
                    cfgs = cfgs or [(s_, None) for s_ in args.schedules]
                    group(f"head-class step {tag}, global heads at {args.step_global_keep}",
                          bench_headclass_step, ctx, page, b, t_c, cfgs, args, args.step_global_keep)

    # order: rows with targets first, so a --deadline-min cut loses the least
    decode_groups([c for c in contexts if c in TARGETS_HC or args.small])
    if "rope" in only:
        group("copy ceiling", bench_copy_ceiling, args)
        group("rope", bench_rope, args)
    if "prefill" in only:
        for c in prefill_ctx:
            group(f"prefill T={fmt_ctx(c)}", bench_headclass_prefill, c, args)
    decode_groups([c for c in contexts if not (c in TARGETS_HC or args.small)])
    if "rewrite" in only:
        group("rewrite", bench_rewrite, args)
    if skipped:
        HEADER_NOTES.append(f"Skipped at the --deadline-min {args.deadline_min}: {', '.join(skipped)}.")
    text = write_table(args, command, check_ok)
    log("\n" + text)
    log(f"total {(time.perf_counter() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main()
