"""Load, fuzz and fault suite for `python -m jaxkv.serve`; writes one table.

Starts the server itself (the synthetic test model unless --model) on loopback and runs, bounded in count
and time:
  (a) N concurrent mixed requests (completions / chat, streamed or not, n 1-2, prompts up to ~400
      tokens) over a KV pool far too small to hold them: completed / explicit errors / hung / 5xx, the
      server's RSS before and after, pages in use afterwards (must be 0);
  (b) >= 1,000 malformed requests (invalid JSON and UTF-8, wrong types, NaN / inf / negative / huge
      numbers, empty or unknown roles, prompts beyond the context, a 10 MB body, huge n and stop lists,
      out-of-range logprobs, unknown model), counted by status;
  (c) streams aborted mid-way: aborted requests and pages leaked;
  (d) kill -9 and a restart on the same port: time to ready against the first start;
  (e) schemathesis against the app's OpenAPI schema (no 5xx), on a server with a short request timeout.

    python -m benchmarks.stress_serve               # full run (--short: the test suite's version)
    python -m benchmarks.stress_serve --write-docs  # also replace its table in docs/benchmarks.md

Prints a markdown table; `--json FILE` writes the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import command_line, cpu_name, markdown_table, repo_root, write_json, write_section
from jaxkv.serve.launch import ServerProcess

WORDS = ("the king and the queen walked along the river to the old house where a small light was burning "
         "in the window while the music of the city began").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def wait_idle(s: ServerProcess, timeout: float) -> bool:
    """Until nothing is in flight (pages should then be back); False at the timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = await asyncio.to_thread(s.metrics)
        busy = sum(v for k, v in m.items() if k.startswith(("jaxkv_num_requests_running",
                                                              "jaxkv_num_requests_waiting",
                                                              "jaxkv_num_requests_in_flight")))
        if busy == 0:
            return True
        await asyncio.sleep(0.2)
    return False


def pages_in_use(s: ServerProcess) -> int:
    return int(s.metric("jaxkv_kv_pages_allocated"))  # everything taken from the pool


# ------------------------------------------------------------------------------------ (a) load


def mixed_request(rng: random.Random, name: str, i: int, short: bool) -> tuple[str, dict]:
    chat = i % 3 == 1
    max_tokens = [4, 8, 16] if short else [8, 16, 32, 64, 96]
    body = {"model": name, "max_tokens": rng.choice(max_tokens), "temperature": rng.choice([0, 0.8]),
            "seed": i, "ignore_eos": rng.random() < 0.7, "n": 2 if i % 7 == 0 else 1,
            "stream": i % 4 == 0}
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    words = rng.choice([4, 12, 40] if short else [4, 20, 80, 300])
    if chat:
        body["messages"] = [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": text(rng, words)}]
    else:
        body["prompt"] = text(rng, words)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return ("chat/completions" if chat else "completions"), body


async def one_mixed(c: httpx.AsyncClient, s: ServerProcess, route: str, body: dict, cap: float) -> str:
    """'ok' | 'error <status>' | 'hung' | '5xx <status>' (a stream's error event counts by its code)."""
    try:
        async with asyncio.timeout(cap):
            if body.get("stream"):
                async with c.stream("POST", f"{s.url}/{route}", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return ("5xx " if r.status_code >= 500 else "error ") + str(r.status_code)
                    last = ""
                    async for line in r.aiter_lines():
                        if line.startswith('data: {"error"'):
                            code = json.loads(line[6:])["error"]["code"]
                            return ("5xx " if code in ("engine_error", "engine_dead") else "error ") + code
                        last = line or last
                    return "ok" if last == "data: [DONE]" else "error truncated"
            r = await c.post(f"{s.url}/{route}", json=body)
            if r.status_code == 200:
                return "ok"
            return ("5xx " if r.status_code >= 500 else "error ") + str(r.status_code)
    except TimeoutError:
        return "hung"
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}"


async def load_phase(s: ServerProcess, n: int, cap: float, short: bool, bursts: int = 2) -> dict:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as c:
        # A first burst of the same mix compiles the step shapes (once per bucket), so RSS "before"
        # holds the compiled steps and the growth measures what the load itself leaves behind.
        warm = [mixed_request(rng, s.name, i, short) for i in range(4 if short else n // 4)]
        await asyncio.gather(*(one_mixed(c, s, r, b, cap) for r, b in warm))
        await wait_idle(s, 60)
        before = rss_mb(s.proc.pid)
        t0 = time.perf_counter()
        reqs = [mixed_request(rng, s.name, i, short) for i in range(n)]
        results = await asyncio.gather(*(one_mixed(c, s, r, b, cap) for r, b in reqs))
        wall = time.perf_counter() - t0
        idle = await wait_idle(s, 60)
        after = rss_mb(s.proc.pid)
        pages = pages_in_use(s) if idle else -1
        # Identical bursts again tell a leak (grows every time) from first-touch high-water (allocator arenas,
        # executables of step shapes the warm-up did not reach), which a repeated burst does not redo.
        series = [after]
        for _ in range(bursts - 1):
            await asyncio.gather(*(one_mixed(c, s, r, b, cap) for r, b in reqs))
            await wait_idle(s, 60)
            series.append(rss_mb(s.proc.pid))
    idle2 = await wait_idle(s, 60)
    out = {"requests": n, "completed": results.count("ok"),
           "explicit_errors": sum(r.startswith("error") for r in results), "hung": results.count("hung"),
           "5xx": sum(r.startswith("5xx") for r in results), "wall_s": round(wall, 1),
           "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
           "rss_after_second_mb": round(series[-1], 1), "rss_after_bursts_mb": [round(x, 1) for x in series],
           "pages_in_use_after": pages, "pages_in_use_after_second": pages_in_use(s) if idle2 else -1,
           "preemptions": int(s.metric("jaxkv_preemptions_total")),
           "errors_by_kind": {k: results.count(k) for k in sorted(set(results)) if k != "ok"}}
    out["rss_growth_pct"] = round(100 * (after / before - 1), 1)
    out["rss_growth_second_pct"] = round(100 * (series[1] / after - 1), 1) if len(series) > 1 else 0.0
    return out


# ------------------------------------------------------------------------------------ (b) malformed


def malformed_cases(name: str, max_model_len: int, count: int) -> list[tuple[str, str, bytes]]:
    """(category, route, raw body) cases, deterministic, at least `count` of them."""
    rng = random.Random(1)
    ok_c = {"model": name, "prompt": "hello", "max_tokens": 1}
    ok_m = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    j = lambda d: json.dumps(d).encode()
    bad_numbers = [-1, -(2**63), 2**31, 2**63, 2**64, 10**30, 10**400, 1e308, -1e308, 0.5, 1.5, -0.0,
                   "NaN", "Infinity", "-Infinity", "1e999", True, "3", None, [], {}]
    fields = ["max_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs", "presence_penalty",
              "frequency_penalty", "best_of", "stop_token_ids", "stream", "echo"]
    out: list[tuple[str, str, bytes]] = []

    def number_body(base: dict, field: str, v) -> bytes:
        if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity", "1e999"):
            return j({**base, field: 0}).replace(f'"{field}": 0'.encode(), f'"{field}": {v}'.encode())
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**300:
            return j({**base, field: 0}).replace(f'"{field}": 0'.encode(), f'"{field}": {v}'.encode())
        return j({**base, field: v})

    for field in fields:
        for v in bad_numbers:
            out.append(("numbers", "completions", number_body(ok_c, field, v)))
            if field not in ("logprobs", "best_of", "echo"):
                out.append(("numbers", "chat/completions", number_body(ok_m, field, v)))
    for v in bad_numbers:
        out.append(("numbers", "chat/completions", number_body(ok_m, "top_logprobs", v)))
        out.append(("numbers", "chat/completions", number_body(ok_m, "max_completion_tokens", v)))
    for role in ["", " ", "root", "USER", "function", None, 5, ["user"], "user\x00"]:
        out.append(("roles", "chat/completions", j({**ok_m, "messages": [{"role": role, "content": "x"}]})))
    for msgs in [[], "hi", [{}], [{"role": "user"}], [{"role": "user", "content": 5}], [None],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                 [{"role": "user", "content": [{"type": "text"}]}]]:
        out.append(("messages", "chat/completions", j({**ok_m, "messages": msgs})))
    long_text = "hello world " * (max_model_len * 2)
    for route, body in [("completions", {**ok_c, "prompt": long_text}),
                        ("completions", {**ok_c, "prompt": list(range(1, max_model_len + 5))}),
                        ("completions", {**ok_c, "prompt": "hi", "max_tokens": max_model_len}),
                        ("chat/completions", {**ok_m, "messages": [{"role": "user", "content": long_text}]})]:
        out.append(("context", route, j(body)))
    for prompt in [[-1], [10**12], [[1], []], [], [[]], {"a": 1}, 5, None, [1.5], ["a", 1]]:
        out.append(("prompt", "completions", j({**ok_c, "prompt": prompt})))
    for stop in [["x"] * 10_000, [""], "x" * 5000, 5, [5], [None]]:
        out.append(("stop", "completions", j({**ok_c, "stop": stop})))
    out.append(("stop", "completions", j({**ok_c, "stop_token_ids": list(range(100_000))})))
    for n in [0, 17, 10**6, 10**30]:
        out.append(("n", "completions", j({**ok_c, "n": n})))
    for model in ["", "gpt-4", name + " ", None, 5]:
        out.append(("model", "completions", j({**ok_c, "model": model})))
    for raw in [b"", b"{", b"[]", b"null", b"1", b'"x"', b"{'a': 1}", b'{"model": }', b"\x00" * 10,
                b'{"model": "' + name.encode() + b'", "prompt": "\xff\xfe"}',
                b'{"model": "' + name.encode() + b'", "prompt": "\\ud800"}',
                b'{"model": "' + name.encode() + b'", "prompt": "\xc3\x28"}',
                b"[" * 50_000 + b"]" * 50_000]:
        out.append(("json/utf8", "completions", raw))
    out.append(("10MB body", "completions", j({**ok_c, "prompt": "a " * 5_000_000})))
    # Fill to `count` with truncations and byte flips of valid bodies (mostly invalid JSON).
    valid = [j(ok_c), j(ok_m), j({**ok_c, "stop": ["a"], "n": 2, "temperature": 0.5})]
    while len(out) < count:
        b = bytearray(rng.choice(valid))
        if rng.random() < 0.5:
            b = b[: rng.randrange(1, len(b))]
        else:
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        out.append(("mutated", "completions" if b.startswith(b'{"model": "' + name.encode() + b'", "prompt"')
                    else rng.choice(["completions", "chat/completions"]), bytes(b)))
    return out


async def malformed_phase(s: ServerProcess, count: int) -> dict:
    cases = malformed_cases(s.name, int(s.max_model_len), count)
    if len(cases) > count:  # --short: an even sample of every category, plus the 10 MB body
        step = len(cases) / count
        cases = [cases[int(i * step)] for i in range(count)] + [c for c in cases if c[0] == "10MB body"]
    by_status: dict[str, int] = {}
    unnamed = 0  # 400s whose error names neither a field nor the body
    sem = asyncio.Semaphore(16)
    big_s = None

    async def one(c, cat, route, raw):
        nonlocal unnamed, big_s
        async with sem:
            t0 = time.perf_counter()
            try:
                r = await c.post(f"{s.url}/{route}", content=raw,
                                 headers={"content-type": "application/json"})
                key = str(r.status_code)
                if r.status_code >= 400 and not r.json()["error"]["message"]:
                    unnamed += 1
            except httpx.HTTPError as e:
                key = type(e).__name__
            if cat == "10MB body":
                big_s = time.perf_counter() - t0
            by_status[key] = by_status.get(key, 0) + 1

    async with httpx.AsyncClient(timeout=120) as c:
        await asyncio.gather(*(one(c, *case) for case in cases))
    await wait_idle(s, 60)
    return {"requests": len(cases), "by_status": dict(sorted(by_status.items())),
            "5xx": sum(v for k, v in by_status.items() if k.startswith("5")),
            "other": sum(v for k, v in by_status.items() if not k[0].isdigit()),
            "errors_without_message": unnamed, "10MB_refused_s": round(big_s, 2),
            "pages_in_use_after": pages_in_use(s)}


# ------------------------------------------------------------------------------------ (c) aborts


async def abort_phase(s: ServerProcess, n: int, max_tokens: int) -> dict:
    before = s.metric("jaxkv_requests_aborted_total", reason="client")
    sem = asyncio.Semaphore(10)

    async def one(c, i):
        body = {"model": s.name, "prompt": f"story {i} of the river", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}
        async with sem, c.stream("POST", f"{s.url}/completions", json=body) as r:
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 2:
                        return True  # leaving the block closes the connection mid-stream
        return False

    async with httpx.AsyncClient(timeout=120) as c:
        cut = await asyncio.gather(*(one(c, i) for i in range(n)))
    idle = await wait_idle(s, 60)
    return {"streams": n, "cut_mid_way": sum(cut),
            "aborted": int(s.metric("jaxkv_requests_aborted_total", reason="client") - before),
            "pages_in_use_after": pages_in_use(s) if idle else -1}


# ------------------------------------------------------------------------------------ (d) restart


def restart_phase(s: ServerProcess, args: list[str], port: int) -> tuple[dict, ServerProcess]:
    s.proc.kill()  # SIGKILL: no shutdown handler runs
    s.proc.wait()
    t0 = time.perf_counter()
    s2 = ServerProcess([*args, "--port", str(port)], timeout=1200 if "--precompile" in args else 240)
    ready = time.perf_counter() - t0
    r = httpx.post(f"{s2.url}/completions", json={"model": s2.name, "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    return {"same_port": s2.base.endswith(f":{port}"), "first_start_s": round(s.startup_s, 1),
            "restart_ready_s": round(ready, 1), "serves_after": r.status_code == 200}, s2


# ------------------------------------------------------------------------------------ (e) schemathesis


def schemathesis_phase(s: ServerProcess, max_examples: int, time_limit: float) -> dict:
    local = Path(sys.executable).parent / "st"  # the running venv's, even when it is not activated
    exe = str(local) if local.exists() else shutil.which("st")
    if exe is None:
        return {"ran": False, "note": "schemathesis not installed (pip install -e '.[test]')"}
    cmd = [exe, "run", s.base + "/openapi.json", "--checks", "not_a_server_error", "-n", str(max_examples),
           "--seed", "0", "--generation-database", "none", "--request-timeout", "60", "--workers", "1"]
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as cwd:  # schemathesis keeps a .schemathesis/ cache in its cwd
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit, cwd=cwd)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    m = s.metrics()
    server_errors = sum(v for k, v in m.items() if k.startswith("jaxkv_http_request_errors_total")
                        and 'status="5' in k)
    requests = sum(v for k, v in m.items() if k.startswith("jaxkv_http_request_errors_total"))
    summary = [line.strip() for line in out.splitlines()
               if ("passed" in line or "failed" in line) and len(line) < 200][-3:]
    return {"ran": True, "exit_code": rc, "server_5xx": int(server_errors), "errors_answered": int(requests),
            "wall_s": round(time.perf_counter() - t0, 1), "summary": summary,
            "tail": out[-3000:] if rc not in (0,) else ""}


# ------------------------------------------------------------------------------------ main


def table(r: dict) -> str:
    a, b, c, d, e = r["load"], r["malformed"], r["aborts"], r["restart"], r["schemathesis"]
    rows = [
        ("(a) load", f"{a['requests']} concurrent mixed requests, KV pool {r['num_pages']} pages",
         f"{a['completed']} completed, {a['explicit_errors']} explicit errors "
         f"({', '.join(f'{k}: {v}' for k, v in a['errors_by_kind'].items()) or 'none'}), {a['hung']} hung, "
         f"{a['5xx']} 5xx; {a['preemptions']} preemptions; {a['wall_s']} s"),
        ("", "RSS before / after, pages in use after",
         f"{a['rss_before_mb']} / {a['rss_after_mb']} MB ({a['rss_growth_pct']:+.1f} %); "
         "after each identical "
         f"burst {' / '.join(str(x) for x in a['rss_after_bursts_mb'])} MB, "
         f"{a['pages_in_use_after']} pages"),
        ("(b) malformed", f"{b['requests']} requests",
         ", ".join(f"{k}: {v}" for k, v in b["by_status"].items()) + f"; {b['5xx']} 5xx; 10 MB body refused "
         f"in {b['10MB_refused_s']} s; {b['pages_in_use_after']} pages in use after"),
        ("(c) aborts", f"{c['streams']} streams closed after 2 chunks",
         f"{c['cut_mid_way']} cut mid-way, {c['aborted']} aborted by the server, "
         f"{c['pages_in_use_after']} pages in use after"),
        ("(d) kill -9", "restart on the same port",
         f"ready in {d['restart_ready_s']} s (first start {d['first_start_s']} s), same port: "
         f"{d['same_port']}, serves: {d['serves_after']}"),
        ("(e) schemathesis", "OpenAPI schema, check not_a_server_error",
         (f"exit {e['exit_code']}, {e['server_5xx']} 5xx of {e['errors_answered']} error answers; "
          f"{' / '.join(e['summary'])}") if e.get("ran") else e.get("note", "")),
    ]
    return markdown_table(["phase", "what", "result"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.stress_serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="small counts, for the test suite")
    ap.add_argument("--model", default="synthetic",
                    help="checkpoint directory, .gguf file or model name (default: the synthetic test model)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    ap.add_argument("--write-docs", action="store_true", help="replace the table in docs/benchmarks.md")
    ap.add_argument("--precompile", action="store_true",
                    help="start the server with --precompile (every step variant compiled before serving)")
    ap.add_argument("--bursts", type=int, default=None,
                    help="identical load bursts (RSS after each: a leak grows every time); "
                         "default 2, --short 1")
    a = ap.parse_args(argv)
    short = a.short
    # Short: what the test suite can afford on 2 cores (one fuzz server is the restarted one).
    n_load, n_bad, n_abort = (16, 200, 8) if short else (256, 1200, 50)
    timeout = 20 if short else 120
    max_model_len = 128 if short else 512
    # Any one request fits (32 KV heads x its pages), a few at once do, the burst never does.
    num_pages = 512 if short else 2048
    base = ["--max-model-len", str(max_model_len), "--num-pages", str(num_pages), "--max-num-seqs", "8",
            "--max-step-tokens", "256", "--max-queued-requests", "8" if short else "128",
            "--request-timeout", str(timeout)]
    if a.model:
        base = ["--model", a.model, *base]
    if a.precompile:
        base = ["--precompile", *base]
    port = free_port()
    started = time.perf_counter()
    s = ServerProcess([*base, "--port", str(port)], timeout=1200 if a.precompile else 240)
    s.max_model_len = max_model_len
    result = {"short": short, "num_pages": num_pages, "phase_s": {}}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        result["phase_s"][name] = round(time.perf_counter() - t0, 1)
        return out

    try:
        bursts = a.bursts or (1 if short else 2)
        result["load"] = timed("load",
                               lambda: asyncio.run(load_phase(s, n_load, timeout + 30, short, bursts)))
        result["malformed"] = timed("malformed", lambda: asyncio.run(malformed_phase(s, n_bad)))
        result["aborts"] = timed("aborts", lambda: asyncio.run(abort_phase(s, n_abort, max_model_len - 16)))
        result["restart"], s = timed("restart", lambda: restart_phase(s, base, port))
        if short:
            result["schemathesis"] = timed("schemathesis", lambda: schemathesis_phase(s, 3, 120))
    finally:
        s.stop()
    if not short:
        # Schemathesis sends valid bodies too (n up to 16, max_tokens up to the context): a short timeout.
        fuzz = ServerProcess([*base[:-2], "--request-timeout", "3", "--max-model-len", "128"])
        try:
            result["schemathesis"] = timed("schemathesis", lambda: schemathesis_phase(fuzz, 30, 500))
        finally:
            fuzz.stop()
    result["wall_s"] = round(time.perf_counter() - started, 1)
    md = table(result)
    print(md)
    print(f"\nwall {result['wall_s']} s, phases {result['phase_s']}")
    if result["schemathesis"].get("tail"):
        print(result["schemathesis"]["tail"], file=sys.stderr)
    command = command_line("benchmarks.stress_serve", [x for x in (sys.argv[1:] if argv is None else argv)
                                                       if x != "--write-docs"])
    if a.json:
        write_json(a.json, result | {"command": command})
    if a.write_docs:
        write_docs(md, command, result)
    return 0


def write_docs(md: str, command: str, result: dict) -> None:
    section = (f"CPU ({cpu_name()}, {os.cpu_count()} cores), embedded default model. Command: `{command}` "
               f"(wall {result['wall_s']} s).\n\n{md}\n")
    write_section(repo_root() / "docs" / "benchmarks.md", "Serving under load, faults and hostile input",
                  section, keep_subsections=False)


if __name__ == "__main__":
    sys.exit(main())
