"""Where the host's threads spend a stretch of work, from a `jax.profiler` trace: the self time of every
named host event (XLA's compiler passes, autotuning, ptxas, the engine's Python is not traced), summed
over the threads, and the process's CPU time beside the wall time.

A cold start is bound by the host CPU (docs/benchmarks.md, "Startup and compilation"); this says which
compiler stage the CPU goes to, so a change to the programs can be aimed at it and checked.

    python -m benchmarks.startup --shape 1b --trace /tmp/trace ...   # writes host_self_s into its row
    python -m benchmarks.host_trace /tmp/trace --top 20              # any trace directory or .xplane.pb
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import os
import re
import resource
import time


def cpu_seconds() -> float:
    """User + system CPU time of this process (every thread) and of the children it has waited for: XLA
    may compile PTX with the `ptxas` binary, a child process per program and a large share of a GPU
    compile."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def self_times(path: str) -> tuple[collections.Counter, collections.Counter]:
    """(self seconds, count) per event name over the host plane's threads of one `.xplane.pb`: an event's
    duration less its children's (events nest by time on a thread)."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    own, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            stack: list[tuple[str, int]] = []  # (name, end_ns) of the open events
            events = [e for e in line.events if not e.name.startswith("$")]  # Python tracer frames
            for ev in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
                end = ev.start_ns + ev.duration_ns
                while stack and stack[-1][1] < end:  # ended before this one, or overlaps it: not a parent
                    stack.pop()
                if stack:
                    own[stack[-1][0]] -= ev.duration_ns / 1e9
                own[ev.name] += ev.duration_ns / 1e9
                count[ev.name] += 1
                stack.append((ev.name, end))
    return own, count


def stage(name: str) -> str:
    """An event name without its module or fusion suffix, so per-program events add up by stage."""
    for sep in (" for ", "("):
        name = name.split(sep, 1)[0]
    return re.split(r"(?<!:):(?!:)", name, maxsplit=1)[0].strip()[:80]  # "a:b", not "A::B"


@contextlib.contextmanager
def traced(log_dir: str | None, top: int = 30):
    """Traces the block's host threads under `log_dir` (None: CPU and wall time only). Yields a dict that
    gets `wall_s`, `cpu_s`, `cores_busy` and, traced, `host_self_s`: the `top` stages by self time."""
    import jax

    out: dict = {}
    if log_dir:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        options.host_tracer_level = 2
        jax.profiler.start_trace(log_dir, profiler_options=options)
    t0, c0 = time.perf_counter(), cpu_seconds()
    try:
        yield out
    finally:
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        out.update(wall_s=round(wall, 1), cpu_s=round(cpu, 1), cores_busy=round(cpu / max(wall, 1e-9), 2))
        if log_dir:
            jax.profiler.stop_trace()
            path = latest_trace(log_dir)
            if path is not None:
                out["host_self_s"] = {k: round(v, 1) for k, v in stages(path).most_common(top)}


def latest_trace(path: str) -> str | None:
    """`path` if it is a file, else the newest `.xplane.pb` under it (None: none)."""
    if os.path.isfile(path):
        return path
    files = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    return files[-1] if files else None


def stages(path: str) -> collections.Counter:
    """Self seconds per stage (`stage`) of one trace file."""
    own, _ = self_times(path)
    by_stage = collections.Counter()
    for name, s in own.items():
        by_stage[stage(name)] += s
    return by_stage


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a jax.profiler trace directory (its newest .xplane.pb) or the file")
    ap.add_argument("--top", type=int, default=30, help="stages to print (default 30)")
    args = ap.parse_args(argv)
    path = latest_trace(args.trace)
    if path is None:
        raise SystemExit(f"no .xplane.pb under {args.trace}")
    print("| stage | self seconds |\n|---|---:|")
    for name, s in stages(path).most_common(args.top):
        print(f"| {name} | {s:.1f} |")


if __name__ == "__main__":
    main()
