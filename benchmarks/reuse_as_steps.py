"""Reuse TTFT: a method's own reuse pass against the engine's ragged steps (naive, EPIC; CacheBlend and
SparseX after their selection program), on one engine.

The two paths alternate request by request on the same engine and the same segments (frozen on the device),
so the host, the pool and the segments' pages are the same for both; each path runs once untimed first (its
compiles). The 1B shape with 8 x 4K segments is the serving case the engine's default was chosen on
(docs/segments.md, "Reuse as steps").

    python -m benchmarks.reuse_as_steps --shape 1b --repeats 4 --methods naive,epic,cacheblend,sparsex
    python -m benchmarks.reuse_as_steps --small --repeats 1        # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

from benchmarks.harness import command_line, describe_device, random_model
from benchmarks.reuse import Workload, make_engine, policy_for, register_segments, ttft_once


def _as_steps(eng, on: bool) -> None:
    segments = dataclasses.replace(eng.config.segments, as_steps=on)
    eng.config = dataclasses.replace(eng.config, segments=segments)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reuse_as_steps", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", help="random-weight model shape (benchmarks.harness)")
    ap.add_argument("--small", action="store_true", help="tiny float32 model, 2 x 64-token segments (CPU)")
    ap.add_argument("--methods", default="naive,epic,cacheblend,sparsex")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=1,
                    help="the engine's sequences: a step's rows (256: a GPU server's default)")
    ap.add_argument("--max-step-tokens", type=int, default=4096)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after timing, trace one request of each path per method under DIR (jax.profiler) "
                         "and print its kernels by device time")
    args = ap.parse_args(argv)
    w = (Workload(segments=2, segment_len=64, prefix_len=8, suffix_len=32, page_size=16) if args.small else
         Workload(segments=8, segment_len=4096, prefix_len=16, suffix_len=256, page_size=16))
    t0 = time.perf_counter()
    model = random_model("small" if args.small else args.shape, "float32" if args.small else "bfloat16",
                         w.max_model_len)
    eng = make_engine(model, w, args.max_step_tokens, print, max_num_seqs=args.max_num_seqs)
    prompt = register_segments(eng, w, np.random.default_rng(0), print)
    print(f"setup {time.perf_counter() - t0:.1f} s", flush=True)
    times: dict[tuple[str, bool], list[float]] = {}
    for spec in args.methods.split(","):
        policy = policy_for(spec)
        for on in (False, True):  # compiles
            _as_steps(eng, on)
            ttft_once(eng, policy, prompt)
        for _ in range(args.repeats):
            for on in (False, True):
                _as_steps(eng, on)
                times.setdefault((spec, on), []).append(ttft_once(eng, policy, prompt)[0])
    print(f"\n{command_line('benchmarks.reuse_as_steps', argv)}\n{describe_device().rstrip('.')}; "
          f"{w.prompt_tokens:,}-token prompt\n")
    print("| method | reuse pass (ms) | ragged steps (ms) | steps / pass |\n|---|---:|---:|---:|")
    rows = {}
    for spec in args.methods.split(","):
        p, s = (statistics.median(times[spec, on]) * 1e3 for on in (False, True))
        rows[spec] = {"pass_ms": p, "steps_ms": s}
        print(f"| {spec} | {p:.2f} | {s:.2f} | {s / p:.2f} |")
    if args.profile:
        _profile(eng, args, prompt)
    return {"prompt_tokens": w.prompt_tokens, "rows": rows}


def _profile(eng, args, prompt) -> None:
    """One traced request per (method, path), its GPU kernels ranked (`profile_decode.kernel_table`)."""
    from pathlib import Path

    import jax

    from benchmarks.profile_decode import kernel_table, timeline

    for spec in args.methods.split(","):
        policy = policy_for(spec)
        for on in (False, True):
            _as_steps(eng, on)
            where = Path(args.profile) / f"{spec}-{'steps' if on else 'pass'}"
            with jax.profiler.trace(str(where), create_perfetto_trace=True):
                took = ttft_once(eng, policy, prompt)[0]
            rows, device_ms, span_ms = kernel_table(where, top=14)
            print(f"\n{spec}, {'ragged steps' if on else 'reuse pass'}: {took * 1e3:.1f} ms, device "
                  f"{device_ms:.1f} ms of a {span_ms:.1f} ms trace")
            for name, ms, count in rows:
                print(f"  {ms:8.2f} ms {count:5d}x  {name}")
            timeline(where, "ttft_once", min_gap_us=200.0)


if __name__ == "__main__":
    main()
