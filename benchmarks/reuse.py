"""Segment-reuse TTFT: every reuse method against `full` dense prefill, same engine, same run.

One engine per shape (every head full-history, as segment reuse requires; prefix caching off). Eight
segments of `--segment-len` random tokens are registered first (the engine's own prefill, untimed, frozen),
then each method answers the prompt ``prefix | segments | suffix`` with greedy tokens (two asked for, the
first timed):

* TTFT = wall clock from `Engine.add_request` / `Engine.add_reuse_request` to the first generated token on
  the host (the engine steps until it returns it: layout, page copies + RoPE delta, the method's
  recompute, sampling, the device-to-host sync), segments already cached; not the request's teardown (it
  asks for two tokens, so the first comes back while it still runs).
* `full` (the anchor): the same prompt through `Engine.add_request`, the ordinary dense prefill a server
  runs without reuse (on a GPU the fresh-prompt path, one `head_class_prefill` step).
* `reuse_full`: the same prompt through the reuse pass with the `full` policy (every token recomputed,
  no segment read); it isolates the reuse pass's own cost from what the methods skip.
* Each method runs once untimed (compiles its variant), then `--repeats` timed runs; the median is reported
  with the recompute shares from the engine's `ReuseStats`.

`--tiers device,host,store` times every reuse method with its segments starting in each tier (placed there
before every run, untimed; the request promotes the heads its method reads, which is timed) and reports
the bytes each request moved and the programs its pass ran in (segments promoted: one per layer group,
`--layer-groups`, each beside the next group's transfer; on the device: one), and the store read's speed
(bytes / seconds from its start to its last layer checked); `--drop-page-cache` drops the store's files
from the page cache before every timed run, so they come from the disk. `--restart` then starts a
second engine on the same store and times restart -> first reused token (no segment prefilled again).

RedKnot reads the reuse head-class map next to the model: random-weight shapes get a synthetic one (KV head
0 of every layer global, the rest sink 64 + window 256), the embedded model its profiled
`head_classes.json`. Random-weight checkpoints are saved by transformers in bf16 (cached in `--ckpt-dir`).

    python -m benchmarks.reuse --shape 8b --out results.md --log reuse_8b.json     # GPU
    python -m benchmarks.reuse --shape embedded --out results.md                   # GPU
    python -m benchmarks.reuse --shape 8b --tiers device,host,store --restart              # GPU, tiers
    python -m benchmarks.reuse --small                                                     # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (
    SHAPES,
    cached_checkpoint,
    command_line,
    describe_device,
    head_class_map,
    markdown_table,
    write_json,
    write_section,
)

SECTION = "Segment reuse TTFT"
DEFAULT_METHODS = "full,redknot,sparsex,cacheblend,epic,naive,reuse_full"
ENGINE_PATHS = {"full"}  # methods through Engine.add_request; every other name is a reuse method
CKPT_MAX_LEN = 131072  # max_position_embeddings of random checkpoints (Llama 3.1's): one fits every run
TITLES = {"8b": "8B shape (random weights)", "1b": "1B shape (random weights)", "embedded": "Embedded model",
          "small": "Small random model (CPU smoke)",
          "8b-layout": "8B page layout, tiny hidden sizes (host-side costs on the CPU)"}
HEADER = ["method", "TTFT (s)", "speed-up vs full", "speed-up vs reuse_full", "recomputed K/V",
          "query rows", "FFN rows", "notes"]
TIER_HEADER = ["method", "segments in", "TTFT (s)", "speed-up vs full", "share of the device speed-up",
               "moved to the device (MB)", "read from the store (MB)", "store read (GB/s)", "pass programs",
               "host before the first program (ms)"]
TIER_INDEPENDENT = {"full", "reuse_full"}  # read no segment: timed once, in the first tier


@dataclasses.dataclass(frozen=True)
class Workload:
    """Prompt = prefix | `segments` x `segment_len` | suffix, laid out in pages of `page_size`."""

    segments: int
    segment_len: int
    prefix_len: int
    suffix_len: int
    page_size: int

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_len + self.segments * self.segment_len + self.suffix_len

    @property
    def layout_pages(self) -> int:
        """Pages per (layer, KV head) of the reuse layout: every segment starts on a page boundary."""
        ps = self.page_size
        slots = -(-self.prefix_len // ps) * ps + (self.segments - 1) * -(-self.segment_len // ps) * ps
        return -(-(slots + self.segment_len + self.suffix_len) // ps)

    @property
    def max_model_len(self) -> int:
        """Room for the laid-out prompt plus the generated token (and a page of slack)."""
        return (self.layout_pages + 2) * self.page_size

    def pool_pages(self, layers: int, kv_heads: int) -> int:
        """Cached segments + one request (reuse layout or dense), per (layer, KV head), plus slack."""
        per_head = self.segments * -(-self.segment_len // self.page_size) + self.layout_pages + 8
        return layers * kv_heads * per_head


def fit_workload(w: Workload, max_positions: int) -> Workload:
    """`w` with the longest segments (whole pages, at most the requested length) whose prompt fits a model of
    `max_positions` positions: the embedded model holds 32K, a token short of 8 x 4K + 256."""
    while w.max_model_len > max_positions:
        shorter = (w.segment_len - 1) // w.page_size * w.page_size
        if shorter < w.page_size:
            raise ValueError(f"{w.segments} segments + {w.prefix_len + w.suffix_len} tokens do not fit "
                             f"{max_positions} positions")
        w = dataclasses.replace(w, segment_len=shorter)
    return w


# ------------------------------------------------------------------------------------------- checkpoint

def ensure_checkpoint(shape: str, ckpt_dir: Path, log) -> Path:
    """A transformers checkpoint of `shape` in `ckpt_dir` (reused when one of that shape is there) with the
    synthetic reuse head-class map next to it. Run before JAX touches the GPU (`harness.make_checkpoint`)."""
    cached_checkpoint(shape, ckpt_dir, CKPT_MAX_LEN, log)
    f = SHAPES[shape]
    head_class_map("1of8", f["num_layers"], f["num_kv_heads"]).save(ckpt_dir / "head_classes.json")
    return ckpt_dir


def model_dir(shape: str, args, log) -> Path:
    if shape == "embedded":
        from jaxkv.eval.__main__ import DEFAULT_MODEL

        return Path(DEFAULT_MODEL)
    base = Path(args.ckpt_dir) if args.ckpt_dir else Path(tempfile.gettempdir()) / "jaxkv-bench-reuse"
    return ensure_checkpoint(shape, base / f"{shape}-bf16", log)


# ------------------------------------------------------------------------------------------------ engine

def make_engine(model, w: Workload, max_step_tokens: int, log, store: str | None = None,
                as_steps: bool = True, max_num_seqs: int = 1):
    """All heads global (segment reuse needs full history), `max_num_seqs` sequences (one: the reuse pass
    alone), pool sized from the workload; host memory for every segment, and the segment store `store`
    when given. `as_steps`: methods that can run as the engine's ragged steps do
    (`SegmentConfig.as_steps`)."""
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine

    cfg = model.config
    num_pages = w.pool_pages(cfg.num_layers, cfg.num_kv_heads)
    itemsize = np.dtype(model.params["embed"].dtype).itemsize
    gb = num_pages * w.page_size * (2 * cfg.head_dim * itemsize + 4) / 2 ** 30
    log(f"  engine: {num_pages:,} pages of {w.page_size} ({gb:.2f} GiB), max_model_len {w.max_model_len}")
    host = int(2 * gb * 2 ** 30)  # every segment fits host memory (the pool holds them once, plus a request)
    return Engine(model, num_pages=num_pages, page_size=w.page_size, max_num_seqs=max_num_seqs,
                  max_model_len=w.max_model_len, max_step_tokens=max_step_tokens,
                  head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), enable_prefix_caching=False,
                  segment_store=store, segment_host_bytes=host, segment_as_steps=as_steps)


@dataclasses.dataclass(frozen=True)
class Prompt:
    prefix: list[int]
    segment_ids: list[str]
    suffix: list[int]
    ids: list[int]  # the whole prompt as `full` sees it


def insert_unprefilled(eng, tokens: list[int]) -> str:
    """A segment entered in the segment store on freshly allocated pages, not prefilled (its K/V are whatever
    those pages held): for timings of host-side work, which do not depend on the values."""
    ru, cfg = eng.reuser, eng.model.config
    L, H, npg = cfg.num_layers, cfg.num_kv_heads, -(-len(tokens) // eng.page_size)
    heads = np.broadcast_to(np.arange(H, dtype=np.int32)[None, :, None], (L, H, npg)).ravel()
    ids = ru._allocate(L * H * npg, heads).reshape(L, H, npg)
    return ru.store.insert(tokens, None, ids, start=ru.start).segment_id


def register_segments(eng, w: Workload, rng, log, frozen: bool = True, prefill: bool = True) -> Prompt:
    """Registers the segments (frozen: they stay on the device; not frozen when they are to move between
    tiers; `prefill` False: inserted unprefilled) and returns the prompt around them."""
    vocab = eng.model.config.vocab_size
    draw = lambda n: rng.integers(3, vocab, size=n).tolist()  # noqa: E731 (3..: clear of pad/BOS/EOS)
    segments, seg_ids = [], []
    for i in range(w.segments):
        t0 = time.perf_counter()
        segments.append(draw(w.segment_len))
        seg_ids.append(eng.register_segment(segments[-1], frozen=frozen) if prefill
                       else insert_unprefilled(eng, segments[-1]))
        log(f"  segment {i + 1}/{w.segments} registered in {time.perf_counter() - t0:.2f} s")
    prefix, suffix = draw(w.prefix_len), draw(w.suffix_len)
    return Prompt(prefix, seg_ids, suffix, prefix + [t for s in segments for t in s] + suffix)


def policy_for(spec: str):
    """``name`` or ``name:field=value;field=value`` (eval_reuse's method specs) -> ReusePolicy."""
    from jaxkv.eval.__main__ import _parse_opts
    from jaxkv.policies.reuse import get_reuse_policy

    name, _, opts = spec.partition(":")
    name = "full" if name == "reuse_full" else name
    return get_reuse_policy(name, **_parse_opts(opts.replace(";", ",")))


def ttft_once(eng, policy, prompt: Prompt) -> tuple[float, object]:
    """Seconds from queuing the request (`policy` None: dense `add_request`) to its first token on the host;
    the reuse stats (None for the dense path). The request asks for two tokens, so the step that returns the
    first one does not also tear the request down (freeing a 33K-token prompt's pages at the 8B shape took
    ~17 ms of host time inside that step: a cost of finishing, not of the first token)."""
    from jaxkv.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    t0 = time.perf_counter()
    if policy is None:
        rid = eng.add_request(prompt.ids, sp)
    else:
        rid = eng.add_reuse_request(prompt.prefix, prompt.segment_ids, prompt.suffix, reuse=policy,
                                    sampling=sp)
    first = None
    while first is None and eng.has_unfinished():
        first = next((o for o in eng.step() if o.request_id == rid and o.new_token_ids), None)
    elapsed = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"request {rid} finished without a token")
    # the second token and the teardown, untimed: the engine idles for the next run
    while eng.has_unfinished():
        eng.step()
    return elapsed, eng.reuser.stats.pop(rid, None)


def place_segments(eng, prompt: Prompt, tier: str | None) -> None:
    """Every segment of the prompt wholly in `tier` (None: wherever it is), finished before any timing."""
    import jax

    if tier is None:
        return
    for sid in prompt.segment_ids:
        eng.reuser.tiers.place(eng.reuser.store.get(sid), tier)
    jax.block_until_ready(eng.runner.pool.k)


def drop_page_cache(store: str | None) -> int:
    """Asks the kernel to drop the cached pages of every file of a local segment store (flushed first:
    dirty pages stay cached), so the next read comes from the disk; returns the files. A no-op for stores
    that are not a local directory."""
    import os

    if not store or ("://" in store and not store.startswith("file://")):
        return 0
    n = 0
    for path in Path(store.removeprefix("file://")).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def store_read_span(eng) -> float | None:
    """Seconds from the start of the last promotion's first store read to the end of its last (None when it
    read nothing from the store)."""
    reads = eng.reuser.tiers.last_reads
    if not reads or any(r.finished is None for r in reads):
        return None
    return max(r.finished for r in reads) - min(r.started for r in reads)


def moved_bytes(eng) -> tuple[int, int]:
    """(bytes promoted to the device, bytes read from the store) so far."""
    persist = eng.reuser.persist
    return eng.reuser.tiers.bytes_promoted, (persist.bytes_read if persist is not None else 0)


def bench_method(eng, spec: str, prompt: Prompt, w: Workload, repeats: int, remaining, log,
                 tier: str | None = None, drop_cache: str | None = None) -> dict:
    """Warm-up (compile) run, then up to `repeats` timed runs (fewer when `remaining()` seconds would not hold
    another); one row dict. With `tier`, the segments start every run there (placed untimed); with
    `drop_cache` (a store directory), the store's files leave the page cache before every run (untimed)."""
    policy = None if spec in ENGINE_PATHS else policy_for(spec)
    place_segments(eng, prompt, tier)
    t0 = time.perf_counter()
    ttft_once(eng, policy, prompt)
    warm = time.perf_counter() - t0
    times, stats, moved, before_program, read_s = [], None, [], [], []
    for _ in range(repeats):
        if times and remaining() < times[-1]:
            log(f"  {spec}: deadline, {len(times)} timed run(s)")
            break
        place_segments(eng, prompt, tier)
        if drop_cache and tier == "store":
            drop_page_cache(drop_cache)
        eng.reuser.tiers.last_reads = []
        before = moved_bytes(eng)
        s, stats = ttft_once(eng, policy, prompt)
        times.append(s)
        moved.append([a - b for a, b in zip(moved_bytes(eng), before)])
        if (span := store_read_span(eng)) is not None:
            read_s.append(span)
        if stats is not None:
            before_program.append(stats.host_before_program_s)
    expected = w.segments * w.segment_len if policy is not None and policy.reuses else 0
    if stats is not None and stats.reused_tokens != expected:
        raise RuntimeError(f"{spec}: reused {stats.reused_tokens} tokens, expected {expected}: segments lost")
    row = {"method": spec, "ttft_s": float(np.median(times)), "runs_s": times, "warm_s": warm,
           "path": "engine prefill" if policy is None else "reuse prefill", "tier": tier or "device",
           "promoted_bytes": int(np.median([m[0] for m in moved])),
           "store_read_bytes": int(np.median([m[1] for m in moved]))}
    if read_s:
        row["store_read_s"] = float(np.median(read_s))
    if stats is not None:
        n = stats.prompt_tokens
        row |= {"recompute_kv": stats.recompute_fraction,
                "query_rows": float(np.mean(stats.recomputed_rows)) / n,
                "ffn_rows": float(np.mean(stats.ffn_rows)) / n, "prefill_s": stats.prefill_s,
                "promoted_heads": int(np.sum(stats.promoted_heads)),
                "pass_programs": stats.layer_groups, "fields": dataclasses.asdict(policy),
                "host_before_program_s": float(np.median(before_program))}
    log(f"  {spec}{'' if tier is None else ' @ ' + tier}: warm-up (compile) {warm:.2f} s, "
        f"timed {', '.join(f'{t:.4f}' for t in times)} s "
        f"-> median {row['ttft_s']:.4f} s"
        + (f"; store read {row['store_read_bytes'] / row['store_read_s'] / 1e9:.2f} GB/s "
           f"({row['store_read_s']:.4f} s)" if "store_read_s" in row else "")
        + (f" (reuse pass {stats.prefill_s:.4f} s in {stats.layer_groups} "
                                              "program(s); host before the first program "
                                              f"{1e3 * row['host_before_program_s']:.1f} ms)"
                                              if stats else ""))
    return row


def notes(row: dict, layers: int) -> str:
    if row["path"] == "engine prefill":
        return "anchor: `Engine.add_request`, dense prefill of the whole prompt"
    if row["method"].partition(":")[0] == "reuse_full":
        return "reuse pass, every token recomputed, no segment read"
    text = ", ".join(f"{k}={v}" for k, v in row["fields"].items()) + f" ({layers} layers)"
    if row.get("promoted_heads"):
        text += f"; edge-mass restore promoted {row['promoted_heads']} (layer, KV head) pairs"
    return text


def table(rows: list[dict], layers: int) -> str:
    base = {r["method"]: r["ttft_s"] for r in rows if "ttft_s" in r}
    ratio = lambda ref, r: f"{base[ref] / r['ttft_s']:.2f}x" if ref in base else "—"  # noqa: E731
    frac = lambda r, k: f"{r[k]:.3f}" if k in r else "1 (dense)"  # noqa: E731
    out = []
    for r in rows:
        if "ttft_s" not in r:
            out.append([r["method"], f"not run ({r['skipped']})"] + [""] * (len(HEADER) - 2))
            continue
        out.append([r["method"], f"{r['ttft_s']:.4f}", ratio("full", r), ratio("reuse_full", r),
                    frac(r, "recompute_kv"), frac(r, "query_rows"), frac(r, "ffn_rows"), notes(r, layers)])
    return markdown_table(HEADER, out)


def tier_table(rows: list[dict]) -> str:
    """TTFT per (method, starting tier); a tier's speed-up over `full` as a share of the device tier's."""
    timed = [r for r in rows if "ttft_s" in r]
    full = next((r["ttft_s"] for r in timed if r["method"] == "full"), None)
    on_device = {r["method"]: r["ttft_s"] for r in timed if r["tier"] == "device"}
    out = []
    for r in timed:
        if r["method"] in TIER_INDEPENDENT:
            continue
        speedup = f"{full / r['ttft_s']:.2f}x" if full else "—"
        dev = on_device.get(r["method"])
        share = f"{dev / r['ttft_s']:.0%}" if dev and r["tier"] != "device" else ""
        out.append([r["method"], r["tier"], f"{r['ttft_s']:.4f}", speedup, share,
                    f"{r['promoted_bytes'] / 1e6:,.3g}", f"{r['store_read_bytes'] / 1e6:,.3g}",
                    f"{r['store_read_bytes'] / r['store_read_s'] / 1e9:.2f}" if r.get("store_read_s") else "",
                    str(r.get("pass_programs", "")),
                    f"{1e3 * r['host_before_program_s']:.1f}" if "host_before_program_s" in r else ""])
    return markdown_table(TIER_HEADER, out)


def restart_row(model, w: Workload, args, store: str, prompt: Prompt, spec: str, log) -> dict:
    """A second engine on the store the first wrote: seconds from `Engine(...)` to its first reused token
    (segments restored from the store, none prefilled again; compiles included: a cold process)."""
    t0 = time.perf_counter()
    eng = make_engine(model, w, args.max_step_tokens, log, store=store, as_steps=args.as_steps)
    ready = time.perf_counter() - t0
    restored = len(eng.reuser.store)
    s, stats = ttft_once(eng, policy_for(spec), prompt)
    if stats is None or stats.reused_tokens != w.segments * w.segment_len:
        raise RuntimeError(f"restart: {spec} did not reuse every segment")
    total = time.perf_counter() - t0
    log(f"  restart: engine ready in {ready:.2f} s with {restored} segments restored; first {spec} token "
        f"{s:.3f} s later ({total:.2f} s from the start, compiles included)")
    del eng
    return {"method": spec, "engine_s": ready, "first_token_s": s, "total_s": total, "restored": restored}


# ------------------------------------------------------------------------------------------------ driver

def profile_method(eng, spec: str, prompt: Prompt, log, tier: str | None = None,
                   trace_dir: str | None = None) -> None:
    """One more TTFT of ``spec`` (compiled by then) under jax.profiler, the segments starting in `tier`: the
    device's idle gaps and the host events in time order, then the kernels by time
    (`benchmarks.profile_decode`'s tables)."""
    import tempfile as tf

    import jax

    from benchmarks.profile_decode import kernel_table, timeline

    policy = None if spec in ENGINE_PATHS else policy_for(spec)
    place_segments(eng, prompt, tier)
    ttft_once(eng, policy, prompt)
    place_segments(eng, prompt, tier)
    trace_dir = Path(trace_dir or tf.mkdtemp(prefix="jaxkv-reuse-trace-")) / f"{spec}-{tier or 'device'}"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        s, _ = ttft_once(eng, policy, prompt)
    log(f"  profile of {spec}: TTFT {s * 1e3:.2f} ms (traced)")
    timeline(trace_dir, "ttft_once")
    rows, busy, _ = kernel_table(trace_dir, 12)
    print(f"device events {busy:.2f} ms\n| kernel | ms | calls |\n|---|---|---|")
    for name, t, c in rows:
        print(f"| `{name}` | {t:.3f} | {c} |")


def bench_shape(shape: str, path: Path, args, remaining, log, emit) -> dict:
    """One engine, the segments cached, every method timed; `emit(result)` after each method (partial
    results survive a killed run). A method is skipped when the previous one's cost (compile + runs) no longer
    fits in `remaining()` seconds."""
    import jax

    import jaxkv

    t0 = time.perf_counter()
    dtype = args.dtype or ("float32" if shape == "small" else "bfloat16")
    model = jaxkv.load(path, dtype=dtype)
    cfg = model.config
    log(f"[{shape}] loaded {path} ({dtype}) in {time.perf_counter() - t0:.1f} s: {cfg.num_layers} layers, "
        f"{cfg.num_heads} q / {cfg.num_kv_heads} KV heads, hidden {cfg.hidden_size}")
    w = fit_workload(Workload(args.segments, args.segment_len, args.prefix_len, args.suffix_len,
                              args.page_size), cfg.max_position_embeddings)
    if w.segment_len != args.segment_len:
        log(f"  segments shortened to {w.segment_len} tokens: the model holds {cfg.max_position_embeddings}")
    tiers = args.tier_list
    store = args.store or (tempfile.mkdtemp(prefix="jaxkv-bench-store-")
                           if "store" in tiers or args.restart else None)
    eng = make_engine(model, w, args.max_step_tokens, log, store=store, as_steps=args.as_steps)
    if args.pinned_host:
        eng.reuser.tiers.memory_kinds = True
    from jaxkv.engine import segment_tiers

    if args.layer_groups is not None:
        eng.reuser.layer_groups = args.layer_groups
    if args.promote_ahead is not None:
        eng.reuser.promote_ahead = args.promote_ahead
    if args.host_block_layers is not None:
        segment_tiers.HOST_BLOCK_LAYERS = args.host_block_layers
    t0 = time.perf_counter()
    prompt = register_segments(eng, w, np.random.default_rng(args.seed), log, frozen=tiers == ["device"],
                               prefill=not args.unprefilled_segments)
    result = {"shape": shape, "model": str(path), "dtype": dtype, "workload": dataclasses.asdict(w),
              "prompt_tokens": w.prompt_tokens, "layers": cfg.num_layers, "tiers": tiers,
              "layer_groups": eng.reuser.layer_groups, "promote_ahead": eng.reuser.promote_ahead,
              "host_block_layers": segment_tiers.HOST_BLOCK_LAYERS,
              "register_s": time.perf_counter() - t0,
              "reuse_heads": describe_heads(eng.reuser.heads, shape), "rows": []}
    last_cost = 0.0
    methods = [m for m in args.methods.split(",") if m]
    for tier in tiers:
        for spec in methods:
            if tier != tiers[0] and spec in TIER_INDEPENDENT:
                continue
            if remaining() < last_cost:
                log(f"  {spec}: skipped (deadline: the last method took {last_cost:.0f} s)")
                result["rows"].append({"method": spec, "tier": tier, "skipped": "deadline"})
                continue
            t0 = time.perf_counter()
            place = None if tiers == ["device"] else tier
            result["rows"].append(bench_method(eng, spec, prompt, w, args.repeats, remaining, log, place,
                                               store if args.drop_page_cache else None))
            last_cost = time.perf_counter() - t0
            emit(result)
    for spec in [m for m in (args.profile or "").split(",") if m]:
        profile_method(eng, spec, prompt, log, None if tiers == ["device"] else tiers[-1], args.trace_dir)
    if args.read_floor:
        from benchmarks.segment_tiers import read_floor

        floor = read_floor(eng.reuser.persist.disk, store, 1)
        log(f"  store read floor: {json.dumps(floor)}")
        result["read_floor"] = floor
    if tiers == ["device"] and eng.reuser.tiers.demotions:  # timings would include copies to the device
        raise RuntimeError(f"{eng.reuser.tiers.demotions} segments left the device: the pool is too small")
    del eng
    jax.clear_caches()
    if args.restart:
        spec = next((m for m in methods if m not in TIER_INDEPENDENT), "naive")
        result["restart"] = restart_row(model, w, args, store, prompt, spec, log)
        emit(result)
        jax.clear_caches()
    del model
    return result


def describe_heads(heads: dict, shape: str) -> str:
    """The reuse head-class map RedKnot reads, in words (from the engine's own arrays)."""
    g = heads["is_global"]
    local = sorted({(int(s), int(w)) for s, w in zip(heads["sink"][~g], heads["window"][~g])})
    rest = ", ".join(f"sink {s} + window {w}" for s, w in local) or "none"
    source = "the model's profiled head_classes.json" if shape == "embedded" else (
        "synthetic (random weights): KV head 0 of every layer global")
    return f"{int(g.sum())} of {g.size} (layer, KV head) global, the others {rest}; {source}"


def shape_section(result: dict, cmd: str, device: str) -> str:
    w = result["workload"]
    return (f"### {TITLES.get(result['shape'], result['shape'])}\n\n"
            f"Command: `{cmd}`\n\n{device}\n\n"
            f"Prompt: {w['prefix_len']}-token prefix | {w['segments']} segments x {w['segment_len']} tokens "
            f"(cached) | {w['suffix_len']}-token suffix = {result['prompt_tokens']:,} tokens; "
            f"{result['dtype']}, page size {w['page_size']}. Reuse head classes: {result['reuse_heads']}. "
            f"Median of the timed runs; the first run of each method compiles and is not timed.\n\n"
            f"{table([r for r in result['rows'] if r.get('tier', 'device') == 'device'], result['layers'])}\n"
            + tier_section(result))


def tier_section(result: dict) -> str:
    if result.get("tiers", ["device"]) == ["device"] and "restart" not in result:
        return ""
    text = ("\nSegments starting in each tier (placed there before every run; the request promotes the heads "
            "its method reads; share = this tier's speed-up over `full` / the device tier's):\n\n"
            f"{tier_table(result['rows'])}\n")
    r = result.get("restart")
    if r:
        text += (f"\nRestart: a second engine on the same store was ready in {r['engine_s']:.2f} s with "
                 f"{r['restored']} segments restored (none prefilled again); its first `{r['method']}` token "
                 f"came {r['first_token_s']:.2f} s later, compiles included ({r['total_s']:.2f} s in all).\n")
    return text


INTRO = """TTFT of every segment-reuse method against `full` dense prefill, in the same engine and the same
run (`python -m benchmarks.reuse`). The engine keeps every KV head's full history (segment reuse needs it),
prefix caching off, one sequence; the segments are registered (prefilled by the engine, frozen) before
anything is timed. TTFT = wall clock from `add_request` / `add_reuse_request` to the first generated token
on the host (greedy; two tokens asked for, so the request is still running when its first token returns and
its teardown is not timed): layout, page copies with their RoPE delta, the method's recompute, sampling and
the device-to-host sync. **Anchor: `full`** = the same prompt through `Engine.add_request`, the dense
prefill a server runs without reuse (on a GPU one fresh-prompt `head_class_prefill` step). `reuse_full` =
the reuse pass with every token recomputed (its own overhead, nothing skipped). Recomputed K/V = share of
the reused tokens' (layer, KV head) K/V rewritten; query / FFN rows = mean over layers of the prompt tokens
run through attention / the FFN. Random-weight shapes are transformers checkpoints (bf16); the selection
methods pick arbitrary tokens on them, so these are speed numbers only (quality: docs/eval.md, "Segment
reuse")."""


def merge_section(out: Path, subsections: list[str]) -> None:
    """Rewrites the section with `subsections` ("### title" texts) replaced or appended; other shapes'
    subsections stay, so shapes can be measured in separate runs."""
    text = out.read_text() if out.exists() else ""
    head = f"## {SECTION}\n"
    start = text.find(head)
    kept: dict[str, str] = {}
    if start >= 0:
        end = text.find("\n## ", start + len(head))
        body = text[start + len(head):end if end >= 0 else len(text)]
        for part in body.split("\n### ")[1:]:
            kept["### " + part.split("\n", 1)[0]] = "### " + part.rstrip() + "\n"
    for val in subsections:
        kept[val.split("\n", 1)[0]] = val
    write_section(out, SECTION, INTRO + "\n\n" + "\n".join(kept.values()))


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.reuse", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b",
                    help="comma list of 8b, 1b, embedded, 8b-layout (ignored with --small)")
    ap.add_argument("--small", action="store_true", help="tiny random model, 2 x 64-token segments (CPU)")
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma list: full (engine prefill), reuse_full, reuse specs name[:field=v;field=v]")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--segment-len", type=int, default=4096)
    ap.add_argument("--prefix-len", type=int, default=16)
    ap.add_argument("--suffix-len", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-step-tokens", type=int, default=4096, help="segment registration chunk")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default=None, help="where random checkpoints are kept (reused if present); "
                                                     "default $TMPDIR/jaxkv-bench-reuse")
    ap.add_argument("--deadline-min", type=float, default=0.0,
                    help="start no method or repeat that would not end before this many minutes (judged by "
                         "the previous one's time; 0: no limit)")
    ap.add_argument("--tiers", default="device",
                    help="comma list of device, host, store: where the segments start each run")
    ap.add_argument("--store", default=None, help="segment store directory or URL for the store tier and "
                                                  "--restart (default: a fresh temporary directory)")
    ap.add_argument("--drop-page-cache", action="store_true",
                    help="before every timed run with segments in the store tier, drop the store's files "
                         "from the page cache (posix_fadvise DONTNEED), so they are read from the disk")
    ap.add_argument("--as-steps", action=argparse.BooleanOptionalAction, default=True,
                    help="naive, EPIC and full run as the engine's ragged step programs (the engine's "
                         "default); --no-as-steps: their reuse pass")
    ap.add_argument("--layer-groups", type=int, default=None,
                    help="programs a reuse pass runs in when its segments come up from host memory or the "
                         "store (default: the engine's, jaxkv.engine.reuse.LAYER_GROUPS; 1 = one program)")
    ap.add_argument("--promote-ahead", type=int, default=None,
                    help="transfers of this many layer groups go out before the first program, each later "
                         "group's just before the program that many groups ahead of it (0: every group's "
                         "before the first program; default: the engine's, jaxkv.engine.reuse.PROMOTE_AHEAD)")
    ap.add_argument("--host-block-layers", type=int, default=None,
                    help="layers per pinned host array of a host copy (default: the engine's, "
                         "jaxkv.engine.segment_tiers.HOST_BLOCK_LAYERS)")
    ap.add_argument("--pinned-host", action="store_true",
                    help="host copies of segments as pinned host arrays (JAX's pinned_host memory kind) also "
                         "on the CPU: the host-side path a GPU's promotion takes")
    ap.add_argument("--unprefilled-segments", action="store_true",
                    help="segments enter the store on allocated pages, not prefilled (their K/V mean "
                         "nothing): host-side timings such as the host time before the first program, "
                         "without minutes of segment prefill on a CPU; not with the store tier")
    ap.add_argument("--restart", action="store_true",
                    help="then time a second engine on the store: restart -> first reused token")
    ap.add_argument("--out", default=None, help=f"markdown file whose '{SECTION}' section gets the tables")
    ap.add_argument("--log", default=None, help="JSON log (rewritten after every method)")
    ap.add_argument("--profile", default=None, help="comma list of methods to trace once more after timing "
                                                      "(segments in the last of --tiers; device idle gaps, "
                                                      "host events, kernels; GPU)")
    ap.add_argument("--trace-dir", default=None, help="keep --profile's traces here (one folder per method "
                                                        "and tier; default a temporary folder)")
    ap.add_argument("--read-floor", action="store_true",
                    help="after timing, what bounds a store read on this machine: the store's chunk files "
                         "read raw (16 threads), their checksums, SegmentStore.get; page cache and disk")
    args = ap.parse_args(argv)
    if args.read_floor and "store" not in args.tiers:
        ap.error("--read-floor needs the store tier (--tiers ...,store)")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.layer_groups is not None and args.layer_groups < 1:
        ap.error("--layer-groups must be >= 1")
    if args.host_block_layers is not None and args.host_block_layers < 1:
        ap.error("--host-block-layers must be >= 1")
    if args.promote_ahead is not None and args.promote_ahead < 0:
        ap.error("--promote-ahead must be >= 0")
    args.tier_list = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if args.unprefilled_segments and ("store" in args.tier_list or args.restart):
        ap.error("--unprefilled-segments: unprefilled segments are not written to a store (no store tier, "
                 "no --restart)")
    bad = [t for t in args.tier_list if t not in ("device", "host", "store")]
    if bad or not args.tier_list:
        ap.error(f"--tiers: unknown tier(s) {bad}; choose from device, host, store")
    if args.small:
        args.segments, args.segment_len, args.suffix_len, args.max_step_tokens = 2, 64, 16, 64
    return args


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - start:7.1f}s] {msg}", flush=True)

    def remaining() -> float:
        """Seconds left before --deadline-min."""
        return 60 * args.deadline_min - (time.perf_counter() - start) if args.deadline_min else float("inf")

    shapes = ["small"] if args.small else [s.strip() for s in args.shape.split(",") if s.strip()]
    paths = {s: model_dir(s, args, log) for s in shapes}  # before JAX touches the device (ensure_checkpoint)
    device = describe_device(("transformers",))
    cmd = command_line("benchmarks.reuse", argv)
    log(device)
    results: list[dict] = []

    def emit(result):
        done = [r for r in results if r is not result] + [result]
        if args.log:
            write_json(args.log, {"command": cmd, "device": device, "shapes": done})
        if args.out:
            merge_section(Path(args.out), [shape_section(r, cmd, device) for r in done])

    for shape in shapes:
        log(f"[{shape}] start")
        results.append(bench_shape(shape, paths[shape], args, remaining, log, emit))
    for r in results:
        print(f"\n{TITLES.get(r['shape'], r['shape'])}: {r['prompt_tokens']:,}-token prompt\n")
        print(table([x for x in r["rows"] if x.get("tier", "device") == "device"], r["layers"]), flush=True)
        print(tier_section(r), flush=True)
    return results


if __name__ == "__main__":
    main()
