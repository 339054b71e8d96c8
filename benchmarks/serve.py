"""Serving benchmark: start `python -m jaxkv.serve`, measure with the official openai client.

Measures startup (process start to "serving" line, including model load and the warm-up step), the
first request's time to first token (cold: it compiles its step shapes), then warm time to first token,
single-stream decode speed and aggregate and steady-state throughput with concurrent streams (each run
once unmeasured first so compilation is excluded). The streams of a batch are spread over client
processes that each open their connections first and then start together (a barrier), so the aggregate
measures the server, not the clients' ramp. With --offline the same requests also run through an
in-process engine, given all at once and timed the same way (the anchor for the server's overhead).
Prints the table, a short server / engine table last, and the exact command; --out writes them into a
"## Serving (CPU)" (or the backend's name) section of a Markdown file.

    python -m benchmarks.serve                       # the default model (SmolLM2)
    python -m benchmarks.serve --model DIR --concurrency 1 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import time
from pathlib import Path

import openai

from benchmarks.harness import command_line, cpu_name, markdown_table, write_section
from jaxkv.serve.launch import ServerProcess

PROMPT = ("You are a helpful assistant. Read the following notes about the river, the old house and the "
          "music school, then write a short story about the king and the queen who lived by the water.")


async def one(ac, model: str, max_tokens: int, seed: int) -> tuple:
    """One streamed chat request: (sent, first token, end) as time.monotonic() (one clock for every client
    process), its completion tokens, and (time, completion tokens so far) per chunk when the server reports
    usage in every chunk (vLLM's `continuous_usage_stats`; None when it does not): events may carry
    several tokens, so counting events would not count tokens."""
    sent = time.monotonic()
    first, usage, timeline = None, None, []
    stream = await ac.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, temperature=0.8, seed=seed,
        extra_body={"ignore_eos": True})
    async for ch in stream:
        now = time.monotonic()
        if first is None and ch.choices and ch.choices[0].delta.content:
            first = now
        if ch.usage is not None:
            usage = ch.usage
            if ch.choices and usage.completion_tokens:
                timeline.append((now, usage.completion_tokens))
    end = time.monotonic()
    return sent, (first if first is not None else end), end, usage.completion_tokens, (timeline or None)


def _client_share(url: str, model: str, seeds: list[int], max_tokens: int, barrier) -> tuple:
    """One client process's streams: it opens one connection per stream first (so no stream pays a
    connect), waits on `barrier` until every client process is as far, then sends all its requests at
    once. (per-stream results, CPU seconds this process spent from the barrier on)."""

    async def go():
        ac = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        try:
            await asyncio.gather(*(ac.models.list() for _ in seeds))  # one kept-alive connection each
            barrier.wait()
            cpu = time.process_time()
            res = await asyncio.gather(*(one(ac, model, max_tokens, s) for s in seeds))
            return res, time.process_time() - cpu
        finally:
            await ac.close()

    return asyncio.run(go())


def run_batch(pool, manager, procs: int, url: str, model: str, concurrency: int, max_tokens: int,
              seed0: int = 0, at_start=lambda: None):
    """`concurrency` streams at once, spread over the client processes of `pool` (one Python process
    parsing every SSE stream through openai/httpx would measure the client, not the server, once streams
    are many), all released together by a barrier that this process joins too: (per-stream (sent, first,
    end, tokens, timeline), client CPU seconds, what `at_start()` returned at the release, after the
    connections were opened)."""
    shares = [list(range(seed0 + i, seed0 + concurrency, procs)) for i in range(min(procs, concurrency))]
    barrier = manager.Barrier(len(shares) + 1, timeout=600)
    futures = [pool.submit(_client_share, url, model, share, max_tokens, barrier) for share in shares]
    barrier.wait()
    started = at_start()
    res, cpu = [], 0.0
    for f in futures:
        r, c = f.result()
        res += r
        cpu += c
    return res, cpu, started


def rates(streams) -> dict:
    """Throughput of one batch from its streams' (sent, first token, end, tokens, timeline) (`one`).

    aggregate: every output token over the first request sent to the last stream's end (what the offline
    engine's tokens / wall time measures, all requests given at once). steady: the output rate while every
    stream decodes, tokens that arrived from the last first token to the first finish over that window
    (from the timelines; without them each stream's tokens after its first are taken as even over its
    decode); None when that window is under a tenth of the batch's wall time (a stream ended before another
    began, or a few events arrived at once). decode: per stream,
    tokens after its first event over the time to its last."""
    start, stop = min(s[0] for s in streams), max(s[2] for s in streams)
    out = dict(tokens=sum(s[3] for s in streams), wall=stop - start, decode=[])
    out["agg"] = out["tokens"] / out["wall"]
    exact = all(s[4] for s in streams)
    firsts = [s[4][0][0] if exact else s[1] for s in streams]
    lasts = [s[4][-1][0] if exact else s[2] for s in streams]
    lo, hi = max(firsts), min(lasts)
    out["window"] = max(0.0, hi - lo)  # short against the gaps between a stream's events: a noisy rate
    for (*_, n, timeline), t0, t1 in zip(streams, firsts, lasts):
        later = n - (timeline[0][1] if exact else 1)
        if later > 0 and t1 > t0:
            out["decode"].append(later / (t1 - t0))
    if hi - lo < 0.1 * out["wall"]:  # (almost) no time with every stream decoding: no steady state
        out["steady"] = None
    elif exact:
        def upto(timeline, t):
            return max((k for when, k in timeline if when <= t), default=0)
        out["steady"] = sum(upto(s[4], hi) - upto(s[4], lo) for s in streams) / (hi - lo)
    else:
        out["steady"] = sum(out["decode"])
    return out


def proc_cpu_seconds(pid: int, tid: int | None = None) -> float | None:
    """User + system CPU seconds of a process (or of its thread `tid`) so far (Linux /proc; None
    elsewhere)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(pid: int) -> tuple[float | None, float | None]:
    """(the whole server process, its main thread) CPU seconds so far. The main thread runs the event loop
    (HTTP, detokenization, SSE), not the engine thread or XLA's: its time is the server's own streaming
    work, which an engine on a GPU would not hide."""
    return proc_cpu_seconds(pid), proc_cpu_seconds(pid, pid)


def measure(url: str, model: str, concurrency: list[int], max_tokens: int, repeats: int,
            client_procs: int, server_cpu=lambda: (None, None)) -> dict:
    """`server_cpu()`: the server process's and its event loop's CPU seconds so far (or None), read around
    each measured batch: CPU time per token is steadier than wall time on a shared machine."""
    out = {}
    ctx = mp.get_context("spawn")
    with (ctx.Manager() as manager,
          concurrent.futures.ProcessPoolExecutor(client_procs, mp_context=ctx) as pool):
        def batch(c, seed0=0, at_start=lambda: None):
            return run_batch(pool, manager, client_procs, url, model, c, max_tokens, seed0, at_start)

        [(sent, first, *_)], _, _ = batch(1)
        out["cold_ttft"] = first - sent
        for c in concurrency:
            batch(c, seed0=1000)  # compile this concurrency's shapes; every client process started
            ttfts, tps_single, agg, steady, cpu, server_us, loop_us, window = [], [], [], [], [], [], [], []
            for r in range(repeats):
                res, client_cpu, cpu0 = batch(c, seed0=100 * r, at_start=server_cpu)  # from the release on
                cpu1 = server_cpu()
                rate = rates(res)
                ttfts += [s[1] - s[0] for s in res]
                tps_single += rate["decode"]
                agg.append(rate["agg"])
                if rate["steady"] is not None:
                    steady.append(rate["steady"])
                window.append(rate["window"])
                cpu.append(client_cpu / rate["wall"])
                for out_us, c0, c1 in zip((server_us, loop_us), cpu0, cpu1):
                    if c0 is not None and c1 is not None:
                        out_us.append((c1 - c0) / rate["tokens"] * 1e6)
            out[c] = dict(ttft=statistics.median(ttfts), decode_tps=statistics.median(tps_single),
                          agg_tps=statistics.median(agg), steady_tps=_median(steady),
                          window=statistics.median(window),
                          client_cores=statistics.median(cpu), server_us=_median(server_us),
                          loop_us=_median(loop_us))
    return out


def _median(values):
    return statistics.median(values) if values else None


def offline_throughput(model_dir, engine_kwargs: dict, concurrency: list[int], max_tokens: int,
                       repeats: int) -> dict[int, dict]:
    """The same chat prompt, `c` copies given at once to an in-process Engine stepped in a loop (no HTTP,
    no server loop): the anchor the server is read against. Per concurrency: output tok/s (tokens / wall),
    steady-state tok/s (as `rates`, from each request's first-token and finish times) and CPU us per
    token."""
    import jax

    import jaxkv
    from jaxkv.engine.engine import Engine
    from jaxkv.models.catalog import default_model
    from jaxkv.sampling import SamplingParams

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"  # as the server's --dtype auto
    model = jaxkv.load(model_dir or default_model()[0], dtype=dtype)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True)
    engine = Engine(model, **engine_kwargs)

    def run(c: int):
        sent = time.monotonic()
        times: dict[str, list] = {}  # request id -> [sent, first token, end, tokens, timeline]
        for i in range(c):
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
            times[engine.add_request(ids, sp)] = [sent, None, None, 0, []]
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.monotonic()
            for o in outputs:
                t = times[o.request_id]
                if o.new_token_ids:
                    t[1] = t[1] or now
                    t[3] += len(o.new_token_ids)
                    if t[4] and t[4][-1][0] == now:  # one step's tokens arrive together
                        t[4][-1] = (now, t[3])
                    else:
                        t[4].append((now, t[3]))
                if o.finished:
                    t[2] = now
        return rates([tuple(t) for t in times.values()])

    out = {}
    for c in concurrency:
        for _ in range(2):  # compiles this concurrency's shapes (the second run's prefix-cache hits too)
            run(c)
        agg, steady, cpu_us = [], [], []
        for _ in range(repeats):
            cpu0 = time.process_time()
            rate = run(c)
            cpu_us.append((time.process_time() - cpu0) / rate["tokens"] * 1e6)
            agg.append(rate["agg"])
            if rate["steady"] is not None:
                steady.append(rate["steady"])
        out[c] = dict(tps=statistics.median(agg), steady=_median(steady), us=statistics.median(cpu_us))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes the streams are spread over (default: one per 32 streams of the "
                        "largest concurrency, at most the cores less one)")
    p.add_argument("--server-args", default="", help="extra flags for python -m jaxkv.serve (quoted)")
    p.add_argument("--out", default=None, help="Markdown file whose 'Serving' section is replaced")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--offline", default=None, metavar="JSON",
                   help="also time the same requests through an in-process Engine built with these "
                        "keyword arguments (match the server's sizes, e.g. '{\"max_num_seqs\": 128}'), after "
                        "the server stops: the serving overhead side by side")
    p.add_argument("--wait-loaded", action="store_true",
                   help="measure only once the server's background loads of kept programs are done (the "
                        "step cache's 'kept programs loaded' line; a warm start) and report when that was")
    p.add_argument("--server-log", default=None, help="write the server's output to this file")
    args = p.parse_args(argv)

    load_before = os.getloadavg()[0]
    procs = args.client_procs or max(1, min(-(-max(args.concurrency) // 32), (os.cpu_count() or 2) - 1))
    server_args = (["--model", args.model] if args.model else []) + shlex.split(args.server_args)
    # The offline anchor compiles as the server does (XLA autotuning on unless --no-xla-autotune), before
    # this process's backend starts; the server inherits the same XLA_FLAGS.
    from jaxkv.serve.__main__ import xla_flags

    autotune = "--no-xla-autotune" not in server_args
    os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""), autotune)
    # The server runs where this process would (ServerProcess alone pins the CPU, as the tests want).
    platforms = os.environ.get("JAX_PLATFORMS", "")
    server = ServerProcess(server_args, timeout=1800, env={"JAX_PLATFORMS": platforms})
    try:
        ready = [line for line in server.log if line.startswith("jaxkv: ") and " on " in line]
        backend = ready[0].split(" on ")[1].split(" ")[0] if ready else "?"
        if args.wait_loaded:
            t0 = time.perf_counter()
            while (not any("kept programs loaded" in line for line in server.log)
                   and any("load in the background" in line for line in server.log)
                   and time.perf_counter() - t0 < 600):
                time.sleep(0.2)
            print(f"background loads done {time.perf_counter() - t0:.1f} s after ready", flush=True)
        res = measure(server.url, server.name, args.concurrency, args.max_tokens, args.repeats, procs,
                      server_cpu=lambda: server_cpu_seconds(server.proc.pid))
    finally:
        server.stop()
        if args.server_log:
            Path(args.server_log).write_text("".join(server.log))
    if args.offline is not None:
        offline = offline_throughput(args.model, json.loads(args.offline), args.concurrency, args.max_tokens,
                                     args.repeats)
        for c in args.concurrency:
            res[c]["offline"] = offline[c]

    cmd = command_line("benchmarks.serve", argv)

    def num(v, fmt=".1f"):
        return "?" if v is None else format(v, fmt)

    def ratio(a, b):
        return "?" if a is None or not b else f"{a / b:.2f}"

    header = ["concurrent streams", "TTFT median (s)", "decode tok/s per stream", "aggregate output tok/s",
              "steady-state tok/s", "steady window (s)", "client CPU (cores)", "server CPU us/token",
              "event loop CPU us/token"]
    rows = [[c, f"{r['ttft']:.3f}", f"{r['decode_tps']:.1f}", f"{r['agg_tps']:.1f}", num(r["steady_tps"]),
             f"{r['window']:.2f}",
             f"{r['client_cores']:.2f}", num(r["server_us"], ".0f"), num(r["loop_us"], ".0f")]
            for c, r in ((c, res[c]) for c in args.concurrency)]
    short = None
    if args.offline is not None:
        header += ["engine offline tok/s", "engine steady-state tok/s", "engine CPU us/token",
                   "server / engine", "steady server / engine"]
        short_rows = []
        for row, c in zip(rows, args.concurrency):
            r, o = res[c], res[c]["offline"]
            row += [f"{o['tps']:.1f}", num(o["steady"]), num(o["us"], ".0f"), ratio(r["agg_tps"], o["tps"]),
                    ratio(r["steady_tps"], o["steady"])]
            short_rows.append([c, f"{r['agg_tps']:.0f}", f"{o['tps']:.0f}", ratio(r["agg_tps"], o["tps"]),
                               num(r["steady_tps"], ".0f"), num(o["steady"], ".0f"),
                               ratio(r["steady_tps"], o["steady"])])
        short = markdown_table(["streams", "server tok/s", "engine tok/s", "server / engine",
                                "server steady", "engine steady", "steady server / engine"], short_rows)
    table = markdown_table(header, rows)
    body = "\n".join([
        f"Command: `{cmd}`",
        "",
        f"Model `{server.name}`, backend {backend}, host {cpu_name()} ({os.cpu_count()} cores), "
        f"Python {platform.python_version()}; chat prompt of ~40 tokens, {args.max_tokens} output tokens "
        f"(ignore_eos), streamed through the official `openai` client from {procs} client process(es), "
        "each with one open connection per stream, all released together by a barrier. Aggregate: output "
        "tokens / (last stream's end - first request sent); steady state: the rate from the last first token "
        "to the first finish (all streams decoding); the offline engine gets the same requests at once and "
        "is timed the same way (client CPU: their CPU seconds per wall second; server CPU: the server "
        "process's CPU time per output token, event loop: its main thread's, engine CPU: the offline "
        "process's); medians over "
        f"{args.repeats} runs after one unmeasured run per concurrency (compilation excluded). 1-minute load "
        f"average before the run: {load_before:.1f} (a shared machine makes these numbers noisy).",
        "",
        f"- startup (process start to ready, incl. load + warm-up compile): **{server.startup_s:.1f} s**",
        f"- first request after startup, time to first token (compiles its shapes): "
        f"**{res['cold_ttft']:.2f} s**",
        "",
        table,
    ] + (["", short] if short else []))
    if args.out and not args.no_write:
        title = "Serving (CPU)" if backend == "cpu" else f"Serving ({backend.upper()})"
        write_section(Path(args.out), title, body, keep_subsections=False)
        print(f"wrote {title!r} in {args.out}\n")
    print(body)  # the short server / engine table (with --offline) last
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
