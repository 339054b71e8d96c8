"""Glue from a loaded model + engine to a running uvicorn server."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import uvicorn

from jaxkv.serve.app import ServerState, build_app
from jaxkv.serve.engine_loop import EngineLoop
from jaxkv.serve.metrics import ServeMetrics

log = logging.getLogger("jaxkv.serve")

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "default_model"
_SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k")


def sampling_defaults(generation_config: dict | None) -> dict:
    """The checkpoint's generation_config.json values used when a request leaves them out."""
    gc = generation_config or {}
    return {k: gc[k] for k in _SAMPLING_DEFAULT_KEYS if gc.get(k) is not None}


def build_state(model, engine, served_model_name: str, use_generation_config: bool = True) -> ServerState:
    from jaxkv.sampling import SamplingParams

    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.path} has no tokenizer.json; the server needs a tokenizer")
    metrics = ServeMetrics(served_model_name)
    return ServerState(
        model_name=served_model_name,
        max_model_len=engine.max_model_len,
        vocab_size=model.config.vocab_size,
        encode=tok.encode,
        decode=tok.decode,
        chat_ids=lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True),
        eos_token_ids=tuple(tok.eos_token_ids),
        loop=EngineLoop(engine, metrics),
        metrics=metrics,
        make_sampling=SamplingParams,
        sampling_defaults=sampling_defaults(model.generation_config) if use_generation_config else {},
    )


def warm_up(engine, prompt_len: int = 8) -> None:
    """Run one tiny request through the engine so the first client does not pay for compilation."""
    from jaxkv.sampling import SamplingParams

    rid = engine.add_request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=2, temperature=0.0),
                             request_id="jaxkv-serve-warmup")
    while engine.has_unfinished():
        engine.step()
    engine.abort(rid)


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
