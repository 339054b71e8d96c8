"""Glue from a loaded model + engine to a running uvicorn server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import threading
import time
from pathlib import Path

import uvicorn

from jaxkv.serve.app import ServeLimits, ServerState, build_app
from jaxkv.serve.engine_loop import EngineLoop
from jaxkv.serve.metrics import ServeMetrics

log = logging.getLogger("jaxkv.serve")

_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


def sampling_defaults(generation_config: dict | None) -> dict:
    """The checkpoint's generation_config.json values used when a request leaves them out.

    Checked like request values (a default passes no API check later): ValueError when out of range.
    """
    from jaxkv.serve.protocol import INT32_MAX

    gc = generation_config or {}
    if gc.get("do_sample") is False:  # Hugging Face semantics: the checkpoint decodes greedily
        return {"temperature": 0.0}
    out = {k: gc[k] for k in _SAMPLING_DEFAULT_KEYS if gc.get(k) is not None}
    ok = {"temperature": lambda v: isinstance(v, (int, float)) and 0 <= v <= 2,
          "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
          "top_k": lambda v: isinstance(v, int) and 0 <= v <= INT32_MAX}
    for k, v in out.items():
        if isinstance(v, bool) or not ok[k](v):
            raise ValueError(f"generation_config.json: {k} = {v!r} is out of range (--no-generation-config "
                             "ignores the file)")
    return out


def load_api_keys(keys: list[str] | None, keys_file: str | None) -> dict[str, str]:
    """API key -> tenant namespace.

    `--api-key KEY` (repeatable): each key is its own tenant, named by a hash of the key so the key itself
    never reaches logs or cache keys. `--api-keys-file`: a JSON object {"key": "namespace"}; keys that
    map to one namespace share its prefix cache.
    """
    out = {k: "key-" + hashlib.sha256(k.encode()).hexdigest()[:16] for k in keys or []}
    if keys_file:
        data = json.loads(Path(keys_file).read_text())
        if not isinstance(data, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                                 for k, v in data.items()):
            raise ValueError(f"{keys_file}: expected a JSON object of non-empty strings {{\"key\": "
                             "\"namespace\"}")
        out.update(data)
    if any(not k.strip() or k != k.strip() for k in out):
        raise ValueError("API keys must be non-empty and have no surrounding whitespace")
    return out


def build_state(model, engine, served_model_name: str, use_generation_config: bool = True,
                limits: ServeLimits | None = None, api_keys: dict[str, str] | None = None) -> ServerState:
    from jaxkv.sampling import SamplingParams

    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.path} has no tokenizer.json; the server needs a tokenizer")
    check_servable(engine)
    metrics = ServeMetrics(served_model_name)
    limits = limits or ServeLimits()
    limits.max_num_seqs = engine.scheduler.max_num_seqs
    return ServerState(
        model_name=served_model_name,
        max_model_len=engine.max_model_len,
        vocab_size=model.config.vocab_size,
        encode=lambda text, special: tok.encode(text, add_special_tokens=special),
        decode=tok.decode,
        chat_text=lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
        eos_token_ids=tuple(tok.eos_token_ids),
        loop=EngineLoop(engine, metrics),
        metrics=metrics,
        make_sampling=SamplingParams,
        sampling_defaults=sampling_defaults(model.generation_config) if use_generation_config else {},
        limits=limits,
        api_keys=api_keys or {},
        kv_policy=engine.kv_policy,
        reuse_enabled=not bool(engine.tables.local.any()),
        kv_merge=bool(getattr(engine, "kv_merge", False)),
        info={"page_size": engine.page_size, "pages_per_head": engine.max_pages_per_head,
              "max_num_seqs": engine.scheduler.max_num_seqs,
              "retrieval_max_seqs": engine.retriever.max_rows,
              "prefix_caching": engine.prefix is not None,
              "head_classes": {k: n for k, n in engine.head_classes.counts().items() if n}},
    )


def _smallest_request_pages(engine) -> int:
    """KV pages a request of one prompt token and one generated token holds: a page per (layer, KV head)."""
    cfg = engine.model.config
    return cfg.num_layers * cfg.num_kv_heads * -(-2 // engine.page_size)


def check_servable(engine) -> None:
    """Refuses, at startup, sizes with which no request could ever be answered (a ValueError naming the
    flag to change), instead of a server that fails every request."""
    if engine.max_model_len < 2:
        raise ValueError(f"--max-model-len {engine.max_model_len} leaves no room for a prompt token and a "
                         "generated one; it must be at least 2")
    need = _smallest_request_pages(engine)
    if engine.allocator.num_pages < need:
        cfg = engine.model.config
        raise ValueError(f"--num-pages {engine.allocator.num_pages} is less than one page per (layer, KV "
                         f"head) ({cfg.num_layers} x {cfg.num_kv_heads} = {need}), so no request fits; "
                         f"raise --num-pages to at least {need} (more to serve longer requests)")


def warm_up(engine, prompt_len: int = 8) -> None:
    """Run one tiny request through the engine so the first client does not pay for compilation; sized
    to fit a small context or pool (check_servable guarantees room for 2 tokens)."""
    from jaxkv.sampling import SamplingParams

    cfg = engine.model.config
    fit = engine.allocator.num_pages // (cfg.num_layers * cfg.num_kv_heads) * engine.page_size  # per head
    total = max(2, min(prompt_len + 2, engine.max_model_len, fit))
    prompt_len = total - min(2, total - 1)
    rid = engine.add_request(list(range(1, prompt_len + 1)),
                             SamplingParams(max_tokens=total - prompt_len, temperature=0.0),
                             request_id="jaxkv-serve-warmup")
    while engine.has_unfinished():
        engine.step()
    engine.abort(rid)


def precompile(engine, progress: bool = True, logprobs: bool = False, retrieval=(),
               reuse=()) -> tuple[int, float]:
    """`Engine.precompile()`: every step variant compiled (or found in the step cache) before the server
    accepts requests, so no request waits on a compile (`logprobs`: the logprob variants too; `retrieval`:
    names of the retrieval methods requests may ask for, whose variants compile too; `reuse`: names of the
    segment-reuse methods whose passes compile in the same pool run). Programs
    found in the step cache load in the background while the server serves (a request that needs one first
    waits for its load, never a compile). Returns (variants, seconds)."""
    t0 = time.perf_counter()
    n = engine.precompile(progress=progress, logprobs=logprobs, background=True,
                          retrieval=[retrieval_policy(spec) for spec in retrieval], reuse=reuse)
    loader = engine.program_loader
    if loader is not None:
        print(f"jaxkv: {engine.step_cache_hits} programs from the step cache load in the background",
              flush=True)

        def report():
            loader.join()
            print(f"jaxkv: kept programs loaded {time.perf_counter() - t0:.1f}s after precompile began",
                  flush=True)

        threading.Thread(target=report, daemon=True, name="jaxkv-loader-report").start()
    return n, time.perf_counter() - t0


def retrieval_policy(spec: str):
    """`NAME` or `NAME@TOKENS` (a `--precompile-retrieval` entry) -> the retrieval policy a request naming
    that method and budget resolves to. The budget is a shape (top-k), so each budget has its own programs."""
    from jaxkv.engine.engine import _retrieves
    from jaxkv.policies import POLICIES, get_policy

    name, _, budget = spec.partition("@")
    if not _retrieves(POLICIES.get(name)):
        known = sorted(n for n, c in POLICIES.items() if _retrieves(c))
        raise ValueError(f"--precompile-retrieval: {name!r} is not a retrieval method "
                         f"(known: {', '.join(known)})")
    if not budget:
        return get_policy(name)
    if not budget.isdigit() or int(budget) < 1:
        raise ValueError(f"--precompile-retrieval: the budget of {spec!r} must be a positive number of "
                         "tokens per KV head (e.g. quest@256)")
    return get_policy(name, budget=int(budget))


def serve(state: ServerState, host: str, port: int, log_level: str = "info", access_log: bool = False,
          started_at: float | None = None) -> None:
    """Run the app until interrupted; prints one line with the URL once the socket is bound."""
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)

    async def main():
        state.loop.start()
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1]
            shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
            took = f" (startup {time.perf_counter() - started_at:.1f}s)" if started_at is not None else ""
            print(f"jaxkv serving '{state.model_name}' at http://{shown}:{bound}/v1{took}", flush=True)
        await task

    try:
        asyncio.run(main())
    finally:
        state.loop.stop()
    sys.stdout.flush()
