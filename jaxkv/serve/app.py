"""The FastAPI app: OpenAI routes over an `EngineLoop`.

One HTTP request becomes one engine request per (prompt, choice); their outputs share one queue. Text
comes from a per-choice `TextStream` (incremental detokenization with prompt context, stop strings);
the engine decides when a request ends. Every client error is an HTTP 400 with an OpenAI error body,
never a 422 or a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxkv.engine.detok import TextStream
from jaxkv.serve import protocol as P
from jaxkv.serve.engine_loop import EngineDeadError, EngineLoop
from jaxkv.serve.metrics import CONTENT_TYPE, ServeMetrics

log = logging.getLogger("jaxkv.serve")


@dataclass
class ServerState:
    """What the routes need; built by `jaxkv.serve.server.build_state` from a model and an engine."""

    model_name: str
    max_model_len: int
    vocab_size: int
    encode: Callable[[str], list[int]]  # text -> ids, special tokens (BOS) as the model expects
    decode: Callable[[Sequence[int]], str]  # ids -> text, special tokens skipped
    chat_ids: Callable[[list[dict]], list[int]]  # messages -> prompt ids (chat template + gen prompt)
    eos_token_ids: tuple[int, ...]
    loop: EngineLoop
    metrics: ServeMetrics
    make_sampling: Callable[..., object]  # SamplingParams(**kwargs), raises ValueError
    sampling_defaults: dict = field(default_factory=dict)  # temperature / top_p / top_k of the model
    created: int = field(default_factory=P.now)


@dataclass
class _Job:
    """One engine request: one choice of one prompt."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    sampling: object
    stop_ids: frozenset[int]
    text: TextStream
    echo: str = ""
    request_id: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    finished: bool = False
    finish_reason: str | None = None


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.jaxkv = state

    def error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        state.metrics.observe_error(status)
        return JSONResponse(P.error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(P.RequestError)
    async def _request_error(_, e: P.RequestError):
        return error(e.status, e.message, param=e.param, code=e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        return error(400, f"Invalid request: {first.get('msg', 'validation failed')}.",
                     param=".".join(str(x) for x in first.get("loc", ())[1:]) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        type_ = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return error(e.status_code, str(e.detail), type_, code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return error(503, str(e), "internal_error", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("internal error")
        return error(500, f"Internal server error: {type(e).__name__}.", "internal_error")

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse({"status": "error", "error": "engine thread died"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card():
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "jaxkv",
                "root": state.model_name, "parent": None, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise P.RequestError(f"The model '{model_id}' does not exist.", "model", "model_not_found", 404)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse(P.CompletionRequest, await request.body())
        P.check_model(req, state.model_name)
        P.check_common(req)
        P.check_completion_extras(req)
        prompts = _completion_prompts(req.prompt, state)
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        jobs = []
        for pi, (text, ids) in enumerate(prompts):
            max_tokens = P.resolve_max_tokens(req.max_tokens, explicit, len(ids), state.max_model_len)
            echo = (text if text is not None else state.decode(ids)) if req.echo else ""
            jobs += _jobs(state, req, pi, ids, max_tokens, echo, len(jobs))
        return await _serve(state, request, req, jobs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = P.parse(P.ChatCompletionRequest, await request.body())
        P.check_model(req, state.model_name)
        P.check_common(req)
        P.check_chat_extras(req)
        messages = P.chat_messages(req)
        try:
            ids = list(state.chat_ids(messages))
        except Exception as e:  # jinja2 raise_exception (e.g. roles must alternate) and template errors
            raise P.RequestError(f"Could not apply the chat template: {e}", "messages") from None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = P.resolve_max_tokens(requested, requested is not None, len(ids), state.max_model_len,
                                          param, "messages")
        return await _serve(state, request, req, _jobs(state, req, 0, ids, max_tokens, "", 0), chat=True)

    return app


def _completion_prompts(prompt, state: ServerState) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt of a completion request."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    out = []
    for i, p in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(p, str):
            ids = list(state.encode(p))
            if not ids:
                raise P.RequestError("prompt is empty after tokenization.", param)
            out.append((p, ids))
        else:
            bad = [t for t in p if not 0 <= t < state.vocab_size]
            if bad:
                raise P.RequestError(f"prompt token ids must lie in [0, {state.vocab_size}) (got {bad[0]}).",
                                     param)
            out.append((None, list(p)))
    return out


def _jobs(state: ServerState, req, prompt_index: int, ids: list[int], max_tokens: int, echo: str,
          first_index: int) -> list[_Job]:
    stop = P.stop_list(req)
    stop_token_ids = tuple(req.stop_token_ids or ())
    bad = [t for t in stop_token_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise P.RequestError(f"stop_token_ids must lie in [0, {state.vocab_size}) (got {bad[0]}).",
                             "stop_token_ids")
    d = state.sampling_defaults
    pick = lambda value, name, fallback: value if value is not None else d.get(name, fallback)
    ignore_eos = bool(req.ignore_eos)
    stop_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(state.eos_token_ids))
    jobs = []
    for i in range(req.n or 1):
        kwargs = dict(temperature=float(pick(req.temperature, "temperature", 1.0)),
                      top_p=float(pick(req.top_p, "top_p", 1.0)), top_k=int(pick(req.top_k, "top_k", 0)),
                      max_tokens=max_tokens, stop=tuple(stop), stop_token_ids=stop_token_ids,
                      seed=P.engine_seed(req.seed, i), ignore_eos=ignore_eos)
        try:
            sampling = state.make_sampling(**kwargs)
        except ValueError as e:
            raise P.RequestError(str(e)) from None
        jobs.append(_Job(first_index + i, prompt_index, ids, sampling, stop_ids,
                         TextStream(state.decode, ids, stop), echo))
    return jobs


# ------------------------------------------------------------------------------------------ running


async def _submit(state: ServerState, jobs: list[_Job], q: asyncio.Queue) -> None:
    try:
        for job in jobs:
            job.request_id = await state.loop.add(job.prompt_ids, job.sampling, q, job.index)
    except ValueError as e:  # the engine refused (pool too small for this request, ...)
        _abort(state, jobs)
        raise P.RequestError(str(e)) from None
    except BaseException:
        _abort(state, jobs)
        raise


def _abort(state: ServerState, jobs: list[_Job]) -> None:
    for job in jobs:
        if job.request_id is not None and not job.finished:
            state.loop.abort(job.request_id)
            job.finished = True


def _apply(state: ServerState, job: _Job, out) -> None:
    """Feed one engine output into its choice; ends the choice on finish or a matched stop string."""
    new = list(out.new_token_ids)
    job.output_tokens += len(new)
    job.cached_tokens = max(job.cached_tokens, getattr(out, "num_cached_tokens", 0))
    if out.finished and out.finish_reason == "stop" and new and new[-1] in job.stop_ids:
        new = new[:-1]  # the stop token itself is not part of the text
    job.text.add(new, final=out.finished)
    if out.finished:
        job.finished = True
        job.output_tokens = max(job.output_tokens, out.num_output_tokens)
        job.finish_reason = "stop" if job.text.stopped else out.finish_reason
    elif job.text.stopped:  # the stop string matched here first; the engine need not go on
        state.loop.abort(job.request_id)
        job.finished, job.finish_reason = True, "stop"


async def _events(state: ServerState, jobs: list[_Job], q: asyncio.Queue) -> AsyncIterator[_Job]:
    """Yield the job each output belongs to, until every job finished."""
    by_index = {j.index: j for j in jobs}
    while not all(j.finished for j in jobs):
        index, out = await q.get()
        job = by_index[index]
        if job.finished:
            continue  # output that raced our own abort
        if isinstance(out, BaseException):
            raise out
        _apply(state, job, out)
        yield job


def _usage(jobs: list[_Job]) -> dict:
    prompt = {j.prompt_index: len(j.prompt_ids) for j in jobs}
    cached = {j.prompt_index: j.cached_tokens for j in jobs}
    return P.usage(sum(prompt.values()), sum(j.output_tokens for j in jobs), sum(cached.values()))


async def _serve(state: ServerState, request: Request, req, jobs: list[_Job], chat: bool):
    q: asyncio.Queue = asyncio.Queue()
    await _submit(state, jobs, q)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, jobs, q, rid, chat, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    collect = asyncio.ensure_future(_collect(state, jobs, q))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # client went away (or we are being cancelled): free the pages
            collect.cancel()
            _abort(state, jobs)
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    collect.result()
    created = P.now()
    choices = []
    for j in jobs:
        text = j.echo + j.text.text
        if chat:
            choices.append({"index": j.index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": j.finish_reason})
        else:
            choices.append({"index": j.index, "text": text, "logprobs": None,
                            "finish_reason": j.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name, "system_fingerprint": None, "choices": choices, "usage": _usage(jobs)}


async def _collect(state: ServerState, jobs: list[_Job], q: asyncio.Queue) -> None:
    async for _ in _events(state, jobs, q):
        pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(state: ServerState, req, jobs: list[_Job], q: asyncio.Queue, rid: str, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    created = P.now()
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict], usage=None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                "system_fingerprint": None, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"  # ASCII: no U+2028 etc. inside an SSE line

    def choice(job: _Job, text: str, finish: str | None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": job.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": job.index, "text": text, "logprobs": None, "finish_reason": finish}

    try:
        if chat:
            yield chunk([choice(j, "", None, first=True) for j in jobs])
        elif any(j.echo for j in jobs):
            yield chunk([choice(j, j.echo, None) for j in jobs if j.echo])
        async for job in _events(state, jobs, q):
            text = job.text.take(final=job.finished)
            if job.finished:
                yield chunk([choice(job, text, job.finish_reason)])
            elif text:
                yield chunk([choice(job, text, None)])
        if include_usage:
            yield chunk([], _usage(jobs))
        yield "data: [DONE]\n\n"
    except EngineDeadError as e:
        yield f"data: {json.dumps(P.error_body(str(e), 'internal_error', code='engine_dead'))}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # the client disconnected (generator closed) or we finished: free what is still running
        _abort(state, jobs)
