"""Where a decode step's device time goes: trace a few engine steps and rank the GPU kernels.

    python -m benchmarks.profile_decode --batch 1 --prompt 8192      # 1B shape, random weights (GPU)
    python -m benchmarks.profile_decode --small                      # tiny model, CPU smoke run
    python -m benchmarks.profile_decode --batch 16 --prompt 16384 --kv-policy specontext --kv-budget 1024
    python -m benchmarks.profile_decode --batch 16 --prompt 32768 --kv-policy specontext:key_dtype=bfloat16 \\
        --kv-budget 1024
    python -m benchmarks.profile_decode --prefill --prompt 8192      # time to first token of one fresh prompt

Builds a random-weight checkpoint (`benchmarks.harness.make_checkpoint`), warms the engine (compiles), then
records `--steps` engine steps with `jax.profiler` (perfetto trace) and prints the kernels by total time,
their call counts and their share of the traced device time, plus the device-busy fraction of the wall time.
`--prefill` traces the first token of a fresh prompt instead (an earlier prompt of the same length compiled
it; `--steps` prompts are traced one after another, each from `add_request` to its first token).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import tempfile
import time
from pathlib import Path

from benchmarks.harness import command_line, describe_device, make_checkpoint


def kernel_table(trace_dir: Path, top: int, host: bool = False
                 ) -> tuple[list[tuple[str, float, int]], float, float]:
    """(name, total ms, count) of device events, device ms in all, traced span ms. `host`: the host's
    Python and runtime events instead (nested, so their totals overlap)."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
    events = json.load(gzip.open(files[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = [e for e in events if e.get("ph") == "X" and "dur" in e
           and ("gpu" in pids.get(e["pid"], "").lower() or "/device:" in pids.get(e["pid"], "").lower())]
    print("trace processes:", sorted(set(pids.values()))[:12])
    if host or not dev:   # CPU runs: no device lane, rank host ops instead
        lanes = {id(e) for e in dev}
        dev = [e for e in events if e.get("ph") == "X" and "dur" in e and id(e) not in lanes]
    agg = collections.defaultdict(lambda: [0.0, 0])
    for e in dev:
        a = agg[e["name"][:90]]
        a[0] += e["dur"] / 1e3
        a[1] += 1
    span = (max(e["ts"] + e["dur"] for e in dev) - min(e["ts"] for e in dev)) / 1e3
    rows = sorted(((n, t, c) for n, (t, c) in agg.items()), key=lambda r: -r[1])
    return rows[:top], sum(t for _, t, _ in rows), span


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_decode", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4, help="engine steps traced (each: decode_steps tokens)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--max-step-tokens", type=int, default=8192, help="as benchmarks.e2e's batch row")
    ap.add_argument("--warm", type=int, default=3,
                    help="untimed decode engine steps after the prefill (compiles)")
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--kv-policy", default=None,
                    help="engine-wide KV policy "
                         "(e.g. specontext: a random retrieval head is saved beside the "
                         "random checkpoint), all heads global")
    ap.add_argument("--kv-budget", type=float, default=None)
    ap.add_argument("--prefill", action="store_true", help="trace time to first token, not decode steps")
    args = ap.parse_args(argv)
    import jax
    import numpy as np

    import jaxkv
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    shape = "small" if args.small else args.shape
    prompt = 64 if args.small else args.prompt
    new = 64 * (args.steps + 4)
    tmpdir = tempfile.TemporaryDirectory()  # kept until exit: the retrieval head loads on first use
    tmp = tmpdir.name
    make_checkpoint(shape, Path(tmp) / shape, prompt + new)
    model = jaxkv.load(Path(tmp) / shape, dtype="float32" if args.small else "bfloat16")
    cfg = model.config
    pol = {}
    if args.kv_policy:
        from benchmarks.retrieval import policy_of, random_head_beside
        from jaxkv.cache.head_classes import all_global

        if args.kv_policy.split(":")[0] == "specontext":
            random_head_beside(model)
        budget = int(args.kv_budget) if args.kv_budget and args.kv_budget >= 1 else args.kv_budget
        pol = dict(kv_policy=policy_of(args.kv_policy), kv_budget=budget,
                   head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))
    pages = args.batch * cfg.num_layers * cfg.num_kv_heads * -(-(prompt + new) // 16)  # no preemption
    eng = Engine(model, page_size=16, max_num_seqs=args.batch, max_model_len=prompt + new, num_pages=pages,
                 max_step_tokens=min(args.max_step_tokens, prompt * args.batch), enable_prefix_caching=False,
                 **pol)
    rng = np.random.default_rng(0)
    print(f"{command_line('benchmarks.profile_decode', argv)}\n{describe_device()}")
    if args.prefill:
        return profile_prefill(eng, rng, prompt, args)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for _ in range(args.batch):
        eng.add_request(rng.integers(10, model.config.vocab_size - 10, prompt).tolist(), sp)
    started = set()
    while len(started) < args.batch and eng.has_unfinished():  # the whole prefill, so only decode is traced
        started |= {o.request_id for o in eng.step() if o.new_token_ids}
    for _ in range(args.warm):   # first decode calls: compiles
        eng.step()
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxkv-trace-"))
    t0 = time.perf_counter()
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.steps):
            eng.step()
    wall = (time.perf_counter() - t0) * 1e3
    rows, busy, span = kernel_table(trace_dir, args.top)
    tokens = args.steps * eng.decode_steps
    print(f"{args.steps} engine steps ({tokens} decode tokens x batch {args.batch}) in {wall:.1f} ms wall; "
          f"device events {busy:.1f} ms over a {span:.1f} ms span ({busy / tokens:.3f} ms per token step)")
    if eng.scheduler.num_preemptions:
        print(f"WARNING: {eng.scheduler.num_preemptions} preemptions: the trace holds re-prefill work")
    print("| kernel | total ms | calls | per token step (us) | share |")
    print("|---|---|---|---|---|")
    for name, t, c in rows:
        print(f"| `{name}` | {t:.2f} | {c} | {1e3 * t / tokens:.1f} | {t / busy:.1%} |")


HOST_MARKS = ("$engine.py", "$runner.py", "$device_tables.py", "$scheduler.py", "$tables.py", "PjitFunction",
              "$reuse", "$programs.py", "cond.", "device_get",
              "command_buffer", "np.asarray")


def timeline(trace_dir: Path, frame: str, min_gap_us: float = 100.0) -> None:
    """Where the device waits within the last traced call of `frame`: the device's idle gaps and the
    host events (engine, runner, tables, dispatch) in time order, as ms from the call's start."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    events = json.load(gzip.open(files[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    pids = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    dev = sorted((e for e in xs if "/device:" in pids.get(e["pid"], "").lower()), key=lambda e: e["ts"])
    on_dev = {id(e) for e in dev}
    calls = [e for e in xs if frame in e["name"] and id(e) not in on_dev]
    if not calls or not dev:
        return
    top = max(calls, key=lambda e: e["ts"])
    t0, t1 = top["ts"], top["ts"] + top["dur"]
    dev = [e for e in dev if t0 <= e["ts"] <= t1]
    print(f"timeline of the last `{frame}` ({(t1 - t0) / 1e3:.2f} ms); ms from its start")
    busy_from, busy_to, last = None, None, None
    gaps = []
    for e in dev:
        if busy_to is not None and e["ts"] - busy_to >= min_gap_us:
            gaps.append((busy_to, e["ts"], last, e["name"]))
        if busy_from is None:
            busy_from = e["ts"]
        busy_to = max(busy_to or 0, e["ts"] + e["dur"])
        last = e["name"]
    if busy_from is not None:
        print(f"device: first kernel at {(busy_from - t0) / 1e3:.2f}, "
              f"last ends at {(busy_to - t0) / 1e3:.2f}")
    for a, b, x, y in gaps:
        print(f"  device idle {(a - t0) / 1e3:7.2f} .. {(b - t0) / 1e3:7.2f} ({(b - a) / 1e3:.2f} ms) "
              f"after `{x[:40]}` before `{y[:40]}`")
    host = sorted((e for e in xs if id(e) not in on_dev and t0 <= e["ts"] <= t1 and e["dur"] >= 50
                   and any(m in e["name"] for m in HOST_MARKS)), key=lambda e: e["ts"])
    for e in host[:60]:
        print(f"  host {(e['ts'] - t0) / 1e3:7.2f} +{e['dur'] / 1e3:6.2f}  {e['name'][:70]}")


def profile_prefill(eng, rng, prompt: int, args) -> None:
    """Trace `args.steps` fresh prompts, each from `add_request` to its first token on the host."""
    import jax

    from jaxkv.sampling import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = eng.model.config.vocab_size

    def first_token() -> float:
        t0 = time.perf_counter()
        rid = eng.add_request(rng.integers(10, vocab - 10, prompt).tolist(), sp)
        while not any(o.request_id == rid and o.new_token_ids for o in eng.step()):
            pass
        while eng.has_unfinished():
            eng.step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(max(1, args.warm)):   # compiles
        first_token()
    untraced = sorted(first_token() for _ in range(3))
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxkv-trace-"))
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        traced = [first_token() for _ in range(args.steps)]
    rows, busy, span = kernel_table(trace_dir, args.top)
    n = args.steps
    print(f"time to first token, {prompt} tokens: untraced median {untraced[1]:.2f} ms; traced "
          f"{sum(traced) / n:.2f} ms; device events {busy / n:.2f} ms per prompt over a {span:.1f} ms span")
    print("| kernel | total ms | calls | per prompt (ms) | share |")
    print("|---|---|---|---|---|")
    for name, t, c in rows:
        print(f"| `{name}` | {t:.2f} | {c} | {t / n:.3f} | {t / busy:.1%} |")
    if jax.default_backend() == "gpu":
        timeline(trace_dir, "first_token")
        host_rows, _, _ = kernel_table(trace_dir, args.top, host=True)
        print("host events (nested: totals overlap)")
        print("| event | total ms | calls | per prompt (ms) |\n|---|---|---|---|")
        for name, t, c in host_rows:
            print(f"| `{name}` | {t:.2f} | {c} | {t / n:.3f} |")


if __name__ == "__main__":
    main()
