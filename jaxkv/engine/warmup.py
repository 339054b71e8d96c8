"""Compile every device-step variant an engine can hit before it serves (no compile stall mid-request).

A variant is one bucket combination: (tokens, page-table width, greedy or sampled, fresh prompt) for a
ragged step and (sequences, page-table width, greedy or sampled) for a multi-step decode; with logprobs,
each also with the top-alternatives extras (and steps with prompt logprobs). Each is run once
on an all-padding batch (every slot -1: nothing is written, the pool comes back unchanged). With the JAX
persistent compilation cache on (`jaxkv.engine.engine.enable_compilation_cache`), a restart loads them
from disk instead of compiling again.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from tqdm.auto import tqdm

from jaxkv.engine import code_maps, compilations
from jaxkv.engine.runner import DecodeBatch, StepBatch
from jaxkv.sampling import MAX_LOGPROBS

log = logging.getLogger("jaxkv.engine")

STOP_BUCKET = 4  # stop-id bucket warmed (requests with more than 4 stop ids compile their own variant)


def variants(engine, logprobs: bool = False) -> list[tuple]:
    """Every (kind, S, T, P, greedy, fresh, top_width, prompt_lp) the engine's buckets allow (kind "step" or
    "decode"). A ragged step's rows follow its tokens (`Engine.step_rows`) and a fresh prompt's page-table
    width its length, so steps are tokens x widths, decodes sequences x widths, each greedy and sampled.
    `logprobs`: also the OpenAI logprob variants (alternatives of every row; steps also with prompt logprobs
    for `echo`)."""
    from jaxkv.engine.engine import FRESH_MIN_TOKENS

    shapes = []
    fresh_ok = engine.runner.use_plan
    for t in engine._token_buckets:
        s = engine.step_rows(t)
        shapes += [("step", s, t, p, False) for p in engine._page_buckets]
        if fresh_ok and t >= FRESH_MIN_TOKENS:
            shapes.append(("step", s, t, engine.fresh_pages(t), True))
    for t in engine._fresh_buckets:  # fresh prompts longer than a step prefill alone (head_class_prefill)
        shapes.append(("step", engine.step_rows(t), t, engine.fresh_pages(t), True))
    if engine.decode_steps > 1:
        shapes += [("decode", s, 0, p, False) for s in engine._seq_buckets for p in engine._page_buckets]
    extras = [(0, False)] + ([(MAX_LOGPROBS, False), (MAX_LOGPROBS, True)] if logprobs else [])
    return [(kind, s, t, p, greedy, fresh, top, lp) for kind, s, t, p, fresh in shapes
            for top, lp in extras if kind == "step" or not lp for greedy in sampler_forms(engine)]


def sampler_forms(engine) -> tuple[bool, ...]:
    """The greedy flags a shape compiles with: (True, False) where greedy batches run their own programs
    (`EngineConfig.greedy_programs`), else (False,): one program samples every row."""
    return (True, False) if engine.runner.greedy_programs else (False,)


def press_programs(engine, presses=None) -> list[tuple]:
    """(policy, rows, page-table width) of every compression program the presses can run
    (`jaxkv.engine.compression`). `presses`: policies or their names; default every registered press this
    engine can run on an accelerator, the engine-wide press (if any) on the CPU, where each program takes
    seconds."""
    import jax

    from jaxkv.engine.compression import ROW_BUCKETS
    from jaxkv.policies.base import CompressPolicy

    if presses is None:
        if jax.default_backend() != "cpu":
            presses = engine.compressor.precompile_policies()
        else:
            presses = [engine.kv_policy] if isinstance(engine.kv_policy, CompressPolicy) else []
    if any(isinstance(pol, str) for pol in presses):  # names (jaxkv.policies.POLICIES) with their defaults
        from jaxkv.engine.engine import _resolve_policy

        presses = [_resolve_policy(p, None, engine.model) if isinstance(p, str) else p for p in presses]
    rows = [r for r in ROW_BUCKETS if r <= max(engine.scheduler.max_num_seqs, 1)]
    unique = {pol.device_form(): pol for pol in presses}.values()  # one per program, whatever the budget
    return [(pol, s, width) for pol in unique for s in rows for width in engine._page_buckets]


def precompile(engine, progress: bool = True, workers: int | None = None, logprobs: bool = False,
               presses=None, step_cache=None, background: bool = False, retrieval=(), reuse=()) -> int:
    """Compiles (or loads from the persistent cache) every step variant, every compression program of
    `presses` (`press_programs`), every retrieval program of the `retrieval` policies (`Retriever.calls`)
    and every pass of the `reuse` methods (`Reuser.calls`); returns how many. Logs one line.

    Each program is traced and lowered here, one after another (tracing holds the GIL), and its XLA
    compilation runs on a pool of `workers` threads (default: `JAXKV_COMPILE_WORKERS`, else the host's
    cores up to 16), where XLA works without the GIL; the compiled programs are installed in their
    owner's `compiled` (`jaxkv.engine.programs`: the runner, the compressor, the retriever, the reuser),
    whose calls run them directly. Programs kept
    by an earlier start in the step cache (`jaxkv.engine.step_cache`; `step_cache`: its directory, False:
    off, None: the default) are loaded instead, nothing traced; the others are written there once
    compiled. `background`: kept programs load on a background thread after this returns
    (`engine.program_loader`; a step that needs one first loads it itself), so a server is ready before
    every program is loaded."""
    runner, compressor, retriever = engine.runner, engine.compressor, engine.retriever
    # A retrieval method with a device state taps every plain step (`Retriever.tap_every_step`): its tap
    # programs are the steps', and the runner keeps only those asking logprob extras.
    taps = any(retriever.tap_every_step(pol) for pol in retrieval)
    # (variant, its call, the programs of its owner: the runner, the compressor or the retriever)
    jobs = [(v, lambda v=v: runner.call(_batch(engine, *v)), runner.compiled)
            for v in variants(engine, logprobs) if not (taps and v[0] == "step" and not v[6] and not v[7])]
    jobs += [(("compress", s, 0, p, pol.name), lambda j=(pol, s, p): compressor.call(*j), compressor.compiled)
             for pol, s, p in press_programs(engine, presses)]
    jobs += [((f"retrieval {kind}", *rest, pol.name), call, retriever.compiled)
             for pol in retrieval for (kind, *rest), call in retriever.calls(pol)]
    jobs += _reuse_jobs(engine, reuse)
    if _backend() == "gpu":  # on XLA:CPU the step variants go first: the mapping cap may stop the run early
        jobs = lowering_order(jobs)
    engine.device_tables.warm()
    done, hits, largest, took, workers, cached = compile_programs(
        engine, jobs, "jaxkv: compiling step variants", progress, workers, step_cache, background)
    engine.largest_step_scratch = largest
    engine.step_cache_hits = hits
    note = f", {hits} from the step cache" if cached else ""
    log.info("jaxkv: %d step variants ready in %.1f s (%d compile threads%s); the largest needs %.2f GiB of "
             "scratch", done, took, workers, note, largest[0] / 2**30)
    check_fits(largest[0], largest[1])
    return done


def precompile_reuse(engine, reuse, progress: bool = True, workers: int | None = None, step_cache=None,
                     background: bool = False) -> int:
    """Every program of the `reuse` methods (policies; `Reuser.calls`: each pass shape, and its layer-group
    programs where segments may come up from a lower tier) as `precompile` does the step variants: lowered
    here, compiled on the warm-up pool, installed in the reuser's `compiled`, kept in (or loaded from) the
    step cache; returns how many (each distinct program once). The largest program's scratch is checked
    against the free device memory (`check_fits`), and counted in the engine's `largest_step_scratch` and
    `step_cache_hits`."""
    jobs = _reuse_jobs(engine, reuse)
    names = ", ".join(dict.fromkeys(pol.name for pol in reuse))
    done, hits, largest, took, workers, cached = compile_programs(
        engine, jobs, f"jaxkv: compiling reuse passes ({names})", progress, workers, step_cache, background)
    engine.largest_step_scratch = max(engine.largest_step_scratch, largest, key=lambda x: x[0])
    engine.step_cache_hits += hits
    note = f", {hits} from the step cache" if cached else ""
    what = "passes and their layer groups" if any(len(v) > 4 for v, _, _ in jobs) else "passes"  # (l0, l1)
    log.info("jaxkv: %d reuse programs (%s: %s) ready in %.1f s (%d compile threads%s); the largest needs "
             "%.2f GiB of scratch", done, names, what, took, workers, note, largest[0] / 2**30)
    check_fits(largest[0], largest[1])
    return done


def _reuse_jobs(engine, reuse) -> list[tuple]:
    """Every program of the `reuse` methods, the largest first (tokens, then rows), so the last ones lowered
    are the quickest to compile: on an H100 the RedKnot passes went smallest first, and the compiles of the
    largest, lowered last, took the start 69 s past the end of lowering (30-45 s each beside the others).
    On a GPU `lowering_order` then places them among the other kinds."""
    from jaxkv.engine.reuse_steps import share_selections

    reuser = engine.reuser
    share_selections(reuser, reuse)  # CacheBlend and SparseX: one selection program per token bucket
    jobs = [(v, call, reuser.compiled) for pol in reuse for v, call in reuser.calls(pol)]
    return sorted(jobs, key=lambda job: (-int(job[0][2]), -int(job[0][1])))


def compile_programs(engine, jobs, desc: str, progress: bool = True, workers: int | None = None,
                     step_cache=None, background: bool = False, leaders: bool | None = None) -> tuple:
    """Lowers, compiles and installs `jobs` ((variant, call, owner's programs); a call returns (signature,
    function, arguments, static arguments), nothing traced) as `precompile` describes; returns (programs
    ready, step cache hits, (largest scratch bytes, its variant), seconds, compile threads, whether the step
    cache was on).

    `leaders` (default `leaders_first()`): the first program of each GEMM group (`gemm_group`: programs whose
    matrix products have the same rows) compiles first, and the group's other programs start once it is
    done. XLA keeps the GEMM tilings it timed in a process-wide cache, so the followers find them there
    instead of each timing the same candidates on the device at the same time."""
    from jaxkv.engine.step_cache import StepCache

    workers = workers or int(os.environ.get("JAXKV_COMPILE_WORKERS", 0)) or min(os.cpu_count() or 1, 16)
    cache = None if step_cache is False else StepCache.for_engine(engine, step_cache)
    xla_loads = compilations.xla_programs()["persistent_cache"]
    t0 = time.perf_counter()
    bar = tqdm(total=len(jobs), desc=desc, disable=not progress)
    largest = (0, None)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxkv-compile") as pool:
        calls, seen = [], set()
        for variant, call, programs in jobs:
            if stop_near_map_cap(len(calls), len(jobs)):
                break
            signature, fn, args, static = call()
            if (id(programs), signature) in seen:  # e.g. two reuse methods of one device pass (naive, EPIC)
                continue
            seen.add((id(programs), signature))
            key = cache.key(fn, args, static, compile_options(engine, variant)) if cache is not None else None
            calls.append((variant, programs, signature, fn, args, static, key))
        done = len(calls)
        # distinct programs per owner kind ("runner", "reuser", ...): a program two methods share counts once
        engine.precompiled_by_kind = dict(Counter(c[1].kind for c in calls))
        # and per variant kind ("step", "retrieval tap", "reuse redknot", ...), over every precompile
        for kind, n in Counter(str(c[0][0]) for c in calls).items():
            engine.precompiled_by_variant[kind] = engine.precompiled_by_variant.get(kind, 0) + n
        # programs kept by an earlier start load here (or later, `background`), one at a time
        # (`programs._LOAD_LOCK`); nothing traced
        if cache is not None and background:
            kept = [True if cache.has(c[-1]) else None for c in calls]
            for (variant, programs, signature, *_, key), later in zip(calls, kept):
                if later:
                    programs.keep(signature, cache, key)
                    largest = max(largest, (cache.scratch(key), variant), key=lambda x: x[0])
                    bar.update()
        else:
            kept = [cache.load(c[-1]) for c in calls] if cache is not None else [None] * done
        futures, built = [], []
        todo = []
        for call, compiled in zip(calls, kept):
            if compiled is True:  # loads later
                continue
            if compiled is not None:
                variant, programs, signature = call[:3]
                programs.install(signature, compiled)
                largest = max(largest, (scratch_bytes(compiled), variant), key=lambda x: x[0])
                bar.update()
                continue
            todo.append(call)
        leads = leaders_first() if leaders is None else leaders
        first: dict = {}  # GEMM group -> the compile of its first program
        timeline = engine.compile_timeline = CompileTimeline(t0)
        for variant, programs, signature, fn, args, static, key in (_leaders_first(todo) if leads else todo):
            began = time.perf_counter()
            lowered = fn.lower(*args, **static)
            timeline.lowered(variant, began)
            options, group = compile_options(engine, variant), gemm_group(variant)
            run = functools.partial(timeline.compile, variant, lowered, options)
            if leads and group in first:  # compiled once its group's first program has tuned the GEMMs
                fut = _after(first[group], pool, run)
            else:
                fut = first[group] = pool.submit(run)
            fut.add_done_callback(lambda _: bar.update())  # the bar counts finished compiles
            futures.append((variant, programs, signature, lowered, fut, key))
            bar.set_postfix_str(f"traced {len(futures)}", refresh=False)
        failed = []
        for variant, programs, signature, lowered, fut, key in futures:
            try:
                compiled = fut.result()
            except Exception as e:  # noqa: BLE001 - e.g. no ptxas process, or device memory for autotuning
                log.warning("jaxkv: compiling step variant %s failed on a compile thread (%s); compiling it "
                            "again alone once the others are done", variant,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                failed.append((variant, programs, signature, lowered, key))
                continue
            programs.install(signature, compiled)
            built.append((key, compiled))
            largest = max(largest, (scratch_bytes(compiled), variant), key=lambda x: x[0])
        # Every other compile has ended: XLA's autotuning of 16 programs at once can exhaust the device
        # memory the pool leaves (8B shape, H100), and one program alone then finds enough.
        for variant, programs, signature, lowered, key in failed:
            try:
                compiled = lowered.compile(compile_options(engine, variant))
            except Exception as e:  # XLA's autotuning could not get device memory even alone
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                raise MemoryError(
                    f"compiling the {variant[0]} variant {variant[1:]} ran out of device memory with no "
                    f"other compile running ({str(e).splitlines()[0]}): give the KV pool less memory "
                    f"(--memory-utilization, --num-pages), or lower --max-num-seqs, --max-step-tokens, "
                    f"--max-model-len or --retrieval-max-seqs") from e
            programs.install(signature, compiled)
            built.append((key, compiled))
            largest = max(largest, (scratch_bytes(compiled), variant), key=lambda x: x[0])
    bar.close()
    if cache is not None and built:
        import jax

        if jax.default_backend() == "cpu" and compilations.xla_programs()["persistent_cache"] > xla_loads:
            log.info("jaxkv: step cache not written: XLA:CPU loaded programs from its persistent cache")
        elif background:
            _keep_in_background(engine, cache, built)
        else:
            for key, compiled in built:
                cache.save(key, compiled, scratch_bytes(compiled))
    if cache is not None and background:
        holders = list({id(c[1]): c[1] for c in calls}.values())
        pending = sum(len(programs.pending) for programs in holders)
        started, before = time.perf_counter(), engine.program_loader

        def load_all():
            if before is not None:  # one loader at a time; joining this one waits for every earlier one
                before.join()
            for programs in holders:
                programs.load_all()
            log.info("jaxkv: %d kept programs loaded in %.1f s", pending, time.perf_counter() - started)

        engine.program_loader = threading.Thread(target=load_all, daemon=True, name="jaxkv-program-loader")
        engine.program_loader.start()
        log.info("jaxkv: %d kept programs load in the background", pending)
    hits = 0 if cache is None else cache.hits + sum(k is True for k in kept)
    return done, hits, largest, time.perf_counter() - t0, workers, cache is not None


def _keep_in_background(engine, cache, built: list) -> None:
    """Writes the programs just compiled to the step cache on a thread of its own (`engine.program_writer`),
    so precompile returns without serializing them: on an H100 the 101 programs of the 1B serving
    configuration took 25 s to keep, after the last compile and before ready. Not a daemon: a process that
    ends soon after still keeps every program."""
    before = getattr(engine, "program_writer", None)

    def keep():
        if before is not None:  # one writer at a time
            before.join()
        started = time.perf_counter()
        for key, compiled in built:
            cache.save(key, compiled, scratch_bytes(compiled))
        log.info("jaxkv: %d compiled programs kept in the step cache in %.1f s", len(built),
                 time.perf_counter() - started)

    engine.program_writer = threading.Thread(target=keep, name="jaxkv-step-cache-writer")
    engine.program_writer.start()


class CompileTimeline:
    """When each precompiled program was lowered and compiled, in seconds from the start of its run: what
    says whether a cold start waits on the main thread's lowering, on the compile threads, or on the last
    few programs (`benchmarks.startup` writes its `summary`)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.lowering: list[tuple[str, float, float]] = []  # (kind, lowering began, ended)
        self.compiles: list[tuple[str, float, float]] = []  # (kind, start, end); list.append is atomic

    def lowered(self, variant, began: float) -> None:
        self.lowering.append((str(variant[0]), began - self.t0, time.perf_counter() - self.t0))

    def compile(self, variant, lowered, options):
        start = time.perf_counter() - self.t0
        try:
            return lowered.compile(options)
        finally:
            self.compiles.append((str(variant[0]), start, time.perf_counter() - self.t0))

    def summary(self, window: float = 10.0, last: int = 5) -> dict:
        """Lowering's end, the mean number of programs compiling in each `window` seconds, and the `last`
        compiles to finish (kind, start, end)."""
        if not self.compiles:
            return {}
        end = max(e for _, _, e in self.compiles)
        bins = [0.0] * (int(end // window) + 1)
        for _, a, b in self.compiles:
            for i in range(int(a // window), int(b // window) + 1):
                lo, hi = max(a, i * window), min(b, (i + 1) * window)
                bins[i] += max(hi - lo, 0.0) / window
        tail = sorted(self.compiles, key=lambda c: c[2])[-last:]
        lowering: dict[str, float] = {}
        for kind, a, b in self.lowering:
            lowering[kind] = lowering.get(kind, 0.0) + b - a
        return {"lowering_done_s": round(self.lowering[-1][2], 1) if self.lowering else 0.0,
                "lowering_s": {k: round(v, 1) for k, v in sorted(lowering.items(), key=lambda kv: -kv[1])},
                "compiles_done_s": round(end, 1),
                "compiling_per_window": [round(b, 1) for b in bins], "window_s": window,
                "last": [[k, round(a, 1), round(b, 1)] for k, a, b in tail]}


def leaders_first() -> bool:
    """Whether precompile compiles each GEMM group's first program before the rest (`compile_programs`);
    `JAXKV_COMPILE_LEADERS=0` compiles every program as soon as it is lowered."""
    return os.environ.get("JAXKV_COMPILE_LEADERS", "1") != "0"


def gemm_group(variant: tuple):
    """Programs whose matrix products see the same rows, so share XLA's GEMM tunings: a step's or a
    retrieval tap's tokens, a decode's sequences, a reuse pass's rows (`program_rows`); a compression
    program's rows, apart from the others (its products are the observation window's)."""
    kind = variant[0]
    if kind == "retrieval tap":
        return int(variant[2])
    if kind == "retrieval decode":
        return int(variant[1])
    rows = program_rows(variant)
    return rows if rows is not None else (kind, variant[1])


def _leaders_first(calls: list) -> list:
    """`calls` with the first of each GEMM group first (in their order), then the rest (in theirs)."""
    seen, leads, rest = set(), [], []
    for c in calls:
        group = gemm_group(c[0])
        (rest if group in seen else leads).append(c)
        seen.add(group)
    return leads + rest


def _after(leader, pool, fn, *args):
    """A future of `fn(*args)` submitted to `pool` once `leader` is done (whatever its outcome)."""
    out = Future()

    def settle(inner):
        if inner.exception() is not None:
            out.set_exception(inner.exception())
        else:
            out.set_result(inner.result())

    def start(_):
        pool.submit(fn, *args).add_done_callback(settle)

    leader.add_done_callback(start)
    return out


# Median seconds an H100 took to compile a program of each kind at a cold every-method start of the 1B
# serving configuration, 16 compiling at once (docs/benchmarks.md, "Startup and compilation"); a kind not
# listed counts as the quickest.
COMPILE_SECONDS = {"retrieval decode": 44.8, "reuse": 38.3, "decode": 31.4, "retrieval tap": 31.2,
                   "step": 28.5, "compress": 8.1, "reuse pages": 7.4}


def _backend() -> str:
    import jax

    return jax.default_backend()


def lowering_order(jobs: list) -> list:
    """`jobs` (variant first) with the slowest kinds to compile first (`COMPILE_SECONDS`), the most rows
    first within a kind, else in their order. The main thread lowers in this order while the pool compiles,
    and the last programs lowered set how long the pool runs past the lowering: on an H100 the retrieval
    decodes, taps and reuse passes lowered last kept it compiling 63-84 s after lowering ended."""
    def seconds(variant) -> float:
        kind = variant[0]
        if kind == "reuse steps":  # ragged steps from a selecting method's selection layer
            kind = "step"
        elif kind.startswith("reuse ") and kind != "reuse pages":  # a pass, or the pass up to its selection
            kind = "reuse"
        return COMPILE_SECONDS.get(kind, 0.0)

    def rows(variant) -> int:
        group = gemm_group(variant)
        return group if isinstance(group, int) else 0

    return sorted(jobs, key=lambda job: (-seconds(job[0]), -rows(job[0])))


def program_rows(variant: tuple) -> int | None:
    """The rows a program's GEMMs see: a step's tokens, a decode's sequences, a reuse pass's rows (None:
    programs without large GEMMs, the compression and retrieval programs)."""
    kind = variant[0]
    if kind == "step":
        return int(variant[2])
    if kind == "decode" or kind.startswith("reuse"):
        return int(variant[1])
    return None


# XLA options of a program above `EngineConfig.autotune_max_rows`: its GEMMs go to cuBLAS, whose algorithm
# choice takes no Triton kernel search. (Autotuning off altogether, `xla_gpu_autotune_level=0`, leaves them
# in Triton with an untuned tiling: on an H100 an 8K-token prefill step took 1.14 s against 0.048 s.)
LARGE_ROW_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def compile_options(engine, variant: tuple) -> dict | None:
    """XLA options of one precompiled program: `LARGE_ROW_OPTIONS` above the engine's `autotune_max_rows`
    (on a GPU; elsewhere there is no Triton GEMM to leave)."""
    import jax

    limit = getattr(getattr(engine, "config", None), "autotune_max_rows", None)
    rows = program_rows(variant)
    if limit is None or rows is None or rows <= limit or jax.default_backend() != "gpu":
        return None
    return dict(LARGE_ROW_OPTIONS)


def scratch_bytes(compiled) -> int:
    """Device memory a compiled program needs beyond its arguments (XLA's temporaries and outputs that do not
    alias an input); 0 where the backend reports no memory analysis."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - backends without an analysis
        return 0
    if ma is None:
        return 0
    out = max(0, int(getattr(ma, "output_size_in_bytes", 0)) - int(getattr(ma, "alias_size_in_bytes", 0)))
    return int(getattr(ma, "temp_size_in_bytes", 0)) + out


def check_fits(need: int, variant, free: int | None = None) -> None:
    """Refuses a configuration whose largest step variant needs more device memory than is free beside the
    weights and the KV pool (`free`: default the first device's allocator limit less what is in use; no
    check where the backend reports none), naming the variant and what to change."""
    if free is None:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if need > free:
        kind, s, t, p = variant[:4]
        # a reuse pass: (kind, rows, tokens, pages per head); "reuse steps" are ragged steps
        reuse = kind.startswith("reuse") and kind != "reuse steps"
        tokens = reuse or kind in ("step", "retrieval tap", "reuse steps")  # else a decode or a compression
        shape = f"{t} tokens" if tokens else f"{s} sequences"
        lower = "--max-model-len" if reuse else "--max-step-tokens or --max-num-seqs"
        raise MemoryError(
            f"the {kind} variant of {shape} and a {p}-page table needs {need / 2**30:.2f} GiB of device "
            f"memory for its temporaries but only {free / 2**30:.2f} GiB is free beside the weights and "
            f"the KV pool; lower {lower}, or give the pool less memory (--memory-utilization, --num-pages)")


def _batch(engine, kind, s, t, p, greedy, fresh, top_width=0, prompt_lp=False) -> StepBatch | DecodeBatch:
    """An all-padding batch of one variant, its metadata as the engine passes it (device arrays from the
    device tables): every slot -1, so running it writes nothing."""
    dt = engine.device_tables
    temp = np.zeros(s, np.float32)
    if not greedy:
        temp[0] = 1.0
    common = dict(temperature=temp, top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
                  seeds=np.zeros(s, np.uint32), counters=np.zeros(s, np.int32))
    if kind == "step":
        q_seq = np.full(t, -1, np.int32)
        page_table, lengths, slots = dt.step_meta([], [], s, p, q_seq, np.zeros(t, np.int32))
        return StepBatch(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), q_seq=q_seq,
                         slots=slots, page_table=page_table, lengths=lengths,
                         logits_index=np.zeros(s, np.int32), fresh=fresh, top_width=top_width,
                         prompt_next=np.full(t, -1, np.int32) if prompt_lp else None, **common)
    page_table, slots, lengths, prev_lengths, active = dt.decode_meta([], [], s, p, engine.decode_steps)
    return DecodeBatch(tokens=np.zeros(s, np.int32), positions=np.zeros(s, np.int32), slots=slots,
                       lengths=lengths, prev_lengths=prev_lengths, active=active, page_table=page_table,
                       stop_ids=np.full((s, STOP_BUCKET), -1, np.int32), top_width=top_width, **common)


def stop_near_map_cap(done: int, total: int) -> bool:
    """True (and a warning) when an XLA:CPU process nears the host's memory-mapping cap: compiling the
    remaining variants would crash it (jaxkv/engine/code_maps.py); they compile on first use instead."""
    hit = code_maps.near_cap(0.75)
    if hit is not None:
        log.warning("jaxkv: precompiled %d of %d variants; stopped at %d of %d memory mappings "
                    "(vm.max_map_count, XLA:CPU code); the rest compile on first use", done, total, *hit)
    return hit is not None
