"""Serving benchmark: start `python -m jaxkv.serve`, measure with the official openai client.

Measures startup (process start to "serving" line, including model load and the warm-up step), the
first request's time to first token (cold: it compiles its step shapes), then warm time to first token,
single-stream decode speed and aggregate throughput with concurrent streams (each run once unmeasured
first so compilation is excluded). With --offline the same requests also run through an in-process engine
(the anchor for the server's overhead). Prints the table and the exact command; --out writes them into a
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


async def one(ac, model: str, max_tokens: int, seed: int) -> tuple[float, float, int]:
    """(ttft, total seconds, completion tokens) of one streamed chat request."""
    t0 = time.perf_counter()
    ttft, usage = None, None
    stream = await ac.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, temperature=0.8, seed=seed, extra_body={"ignore_eos": True})
    async for ch in stream:
        if ttft is None and ch.choices and ch.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        usage = ch.usage or usage
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, usage.completion_tokens


def _client_share(url: str, model: str, seeds: list[int], max_tokens: int, start_at: float) -> tuple:
    """One client process's streams, started at `start_at` (time.monotonic, shared by all processes):
    (results, end time, CPU seconds this process spent)."""

    async def go():
        ac = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
        try:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            cpu = time.process_time()
            res = await asyncio.gather(*(one(ac, model, max_tokens, s) for s in seeds))
            return res, time.monotonic(), time.process_time() - cpu
        finally:
            await ac.close()

    return asyncio.run(go())


def run_batch(pool, procs: int, url: str, model: str, concurrency: int, max_tokens: int, seed0: int = 0):
    """`concurrency` streams at once, spread over the client processes of `pool`: (results, wall seconds,
    client CPU seconds). One Python process parsing every SSE stream through openai/httpx would measure
    the client, not the server, once streams are many."""
    shares = [list(range(seed0 + i, seed0 + concurrency, procs)) for i in range(min(procs, concurrency))]
    start_at = time.monotonic() + 0.2 + 0.01 * len(shares)
    futures = [pool.submit(_client_share, url, model, share, max_tokens, start_at) for share in shares]
    res, end, cpu = [], start_at, 0.0
    for f in futures:
        r, e, c = f.result()
        res += r
        end, cpu = max(end, e), cpu + c
    return res, end - start_at, cpu


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, model: str, concurrency: list[int], max_tokens: int, repeats: int,
            client_procs: int, server_cpu=lambda: None) -> dict:
    """`server_cpu()`: the server process's CPU seconds so far (or None), read around each measured batch:
    CPU time per token is steadier than wall time on a shared machine."""
    out = {}
    with concurrent.futures.ProcessPoolExecutor(client_procs, mp_context=mp.get_context("spawn")) as pool:
        def batch(c, seed0=0):
            return run_batch(pool, client_procs, url, model, c, max_tokens, seed0)

        (cold,), _, _ = batch(1)
        out["cold_ttft"] = cold[0]
        for c in concurrency:
            batch(c, seed0=1000)  # compile this concurrency's shapes
            ttfts, tps_single, agg, cpu, server_us = [], [], [], [], []
            for r in range(repeats):
                cpu0 = server_cpu()
                res, wall, client_cpu = batch(c, seed0=100 * r)
                cpu1 = server_cpu()
                tokens = sum(n for _, _, n in res)
                ttfts += [t for t, _, _ in res]
                tps_single += [(n - 1) / (total - t) for t, total, n in res if n > 1 and total > t]
                agg.append(tokens / wall)
                cpu.append(client_cpu / wall)
                if cpu0 is not None and cpu1 is not None:
                    server_us.append((cpu1 - cpu0) / tokens * 1e6)
            out[c] = dict(ttft=statistics.median(ttfts), decode_tps=statistics.median(tps_single),
                          agg_tps=statistics.median(agg), client_cores=statistics.median(cpu),
                          server_us=statistics.median(server_us) if server_us else None)
    return out


def offline_throughput(model_dir, engine_kwargs: dict, concurrency: list[int], max_tokens: int,
                       repeats: int) -> dict[int, tuple[float, float]]:
    """(output tok/s, CPU us per token) of the same chat prompt, `c` copies at once, through
    `jaxkv.generate` in this process (no HTTP, no server loop): the anchor the server is read against."""
    import jax

    import jaxkv
    from jaxkv.engine.engine import Engine
    from jaxkv.models.catalog import default_model
    from jaxkv.sampling import SamplingParams

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"  # as the server's --dtype auto
    model = jaxkv.load(model_dir or default_model()[0], dtype=dtype)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=True)
    engine = Engine(model, **engine_kwargs)
    out = {}
    for c in concurrency:
        sp = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(c)]
        for _ in range(2):  # compiles this concurrency's shapes (the second run's prefix-cache hits too)
            jaxkv.generate(model, [ids] * c, sp, engine=engine)
        rates, cpu_us = [], []
        for _ in range(repeats):
            t0, cpu0 = time.perf_counter(), time.process_time()
            done = jaxkv.generate(model, [ids] * c, sp, engine=engine)
            tokens = sum(len(d.token_ids) for d in done)
            rates.append(tokens / (time.perf_counter() - t0))
            cpu_us.append((time.process_time() - cpu0) / tokens * 1e6)
        out[c] = (statistics.median(rates), statistics.median(cpu_us))
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
                      server_cpu=lambda: proc_cpu_seconds(server.proc.pid))
    finally:
        server.stop()
        if args.server_log:
            Path(args.server_log).write_text("".join(server.log))
    if args.offline is not None:
        offline = offline_throughput(args.model, json.loads(args.offline), args.concurrency, args.max_tokens,
                                     args.repeats)
        for c in args.concurrency:
            res[c]["offline_tps"], res[c]["offline_us"] = offline[c]

    cmd = command_line("benchmarks.serve", argv)
    def us(v):
        return "?" if v is None else f"{v:.0f}"

    header = ["concurrent streams", "TTFT median (s)", "decode tok/s per stream", "aggregate output tok/s",
              "client CPU (cores)", "server CPU us/token"]
    rows = [[c, f"{r['ttft']:.3f}", f"{r['decode_tps']:.1f}", f"{r['agg_tps']:.1f}",
             f"{r['client_cores']:.2f}", us(r["server_us"])]
            for c, r in ((c, res[c]) for c in args.concurrency)]
    if args.offline is not None:
        header += ["engine offline tok/s", "engine CPU us/token", "server / engine"]
        for row, c in zip(rows, args.concurrency):
            row += [f"{res[c]['offline_tps']:.1f}", us(res[c]["offline_us"]),
                    f"{res[c]['agg_tps'] / res[c]['offline_tps']:.2f}"]
    table = markdown_table(header, rows)
    body = "\n".join([
        f"Command: `{cmd}`",
        "",
        f"Model `{server.name}`, backend {backend}, host {cpu_name()} ({os.cpu_count()} cores), "
        f"Python {platform.python_version()}; chat prompt of ~40 tokens, {args.max_tokens} output tokens "
        f"(ignore_eos), streamed through the official `openai` client from {procs} client process(es) "
        "(client CPU: their CPU seconds per wall second; server CPU: the server process's CPU time per "
        f"output token, engine CPU: the offline process's); medians over {args.repeats} runs "
        "after one unmeasured run per concurrency (compilation excluded). 1-minute load average before the "
        f"run: {load_before:.1f} (a shared machine makes these numbers noisy).",
        "",
        f"- startup (process start to ready, incl. load + warm-up compile): **{server.startup_s:.1f} s**",
        f"- first request after startup, time to first token (compiles its shapes): "
        f"**{res['cold_ttft']:.2f} s**",
        "",
        table,
    ])
    print(body)
    if args.out and not args.no_write:
        title = "Serving (CPU)" if backend == "cpu" else f"Serving ({backend.upper()})"
        write_section(Path(args.out), title, body, keep_subsections=False)
        print(f"\nwrote {title!r} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
