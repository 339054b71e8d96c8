"""The FastAPI app: OpenAI routes over an `EngineLoop`.

One HTTP request becomes one engine request per (prompt, choice); their outputs share one queue. Text
comes from a per-choice `TextStream` (incremental detokenization with prompt context, stop strings);
the engine decides when a request ends. Every client error is a 4xx with an OpenAI error body naming
the field (never a 422 or a 500); the limits of `ServeLimits` (body size, in-flight requests, time)
answer 413 / 429 / 408, and a failed engine step answers 500 for the requests it ran, nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxkv.engine.detok import TextStream
from jaxkv.serve import kv as K
from jaxkv.serve import protocol as P
from jaxkv.serve.engine_loop import EngineDeadError, EngineLoop, EngineStepError, RequestFailed
from jaxkv.serve.metrics import CONTENT_TYPE, ServeMetrics

log = logging.getLogger("jaxkv.serve")


@dataclass
class ServeLimits:
    """What one client may cost the server (docs/serving.md, "Limits")."""

    max_body_bytes: int | None = 4 << 20  # refused with 413 before the body is read (Content-Length)
    request_timeout: float | None = None  # seconds from arrival to the last token; 408 after
    max_num_seqs: int = 8  # the engine's batch: these run, the queue is counted beyond them
    max_queued_requests: int | None = 256  # engine requests waiting beyond max_num_seqs; 429 above
    retry_after_s: int = 1

    @property
    def capacity(self) -> int | None:
        """Engine requests admitted at once (running + waiting), or None for no bound."""
        return None if self.max_queued_requests is None else self.max_num_seqs + self.max_queued_requests


@dataclass
class ServerState:
    """What the routes need; built by `jaxkv.serve.server.build_state` from a model and an engine."""

    model_name: str
    max_model_len: int
    vocab_size: int
    encode: Callable[[str, bool], list[int]]  # (text, add special tokens such as BOS) -> ids
    decode: Callable[[Sequence[int]], str]  # ids -> text, special tokens skipped
    chat_text: Callable[[list[dict]], str]  # messages -> prompt text (chat template + gen prompt)
    eos_token_ids: tuple[int, ...]
    loop: EngineLoop
    metrics: ServeMetrics
    make_sampling: Callable[..., object]  # SamplingParams(**kwargs), raises ValueError
    sampling_defaults: dict = field(default_factory=dict)  # temperature / top_p / top_k of the model
    limits: ServeLimits = field(default_factory=ServeLimits)
    api_keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant namespace; empty: no auth
    created: int = field(default_factory=P.now)
    kv_policy: object | None = None  # the engine's compression policy (a request may override it)
    reuse_enabled: bool = False  # segment reuse needs every head global (docs/serving.md)
    kv_merge: bool = False  # the pool holds a logit bias per slot: policies may merge (--kv-merge)
    info: dict = field(default_factory=dict)  # more for GET /info (page size, precompiled variants, ...)


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
    kv_policy: object = K.DEFAULT  # K.DEFAULT (the server's), None (full cache) or a CompressPolicy
    reuse: tuple | None = None  # (prefix ids, segment ids, suffix ids, ReusePolicy) of a reuse request
    want_logprobs: bool = False  # the request asked for the generated tokens' log-probabilities
    num_alternatives: int = 0  # completions `logprobs` / chat `top_logprobs`: alternatives per token
    echo_logprobs: bool = False  # completions echo + logprobs: the prompt tokens' logprobs come first
    no_output: bool = False  # completions max_tokens 0 (with echo): the engine's one token is dropped
    logprobs: list = field(default_factory=list)  # [(token text, logprob or None, alternatives)] so far
    logprobs_sent: int = 0  # of those, already streamed
    logprobs_offset: int = 0  # characters of text the streamed ones covered (completions text_offset)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.jaxkv = state
    app.openapi = lambda: _openapi(app)

    def error(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None,
              reason: str | None = None, headers: dict | None = None):
        state.metrics.observe_error(status, reason or code or f"http_{status}")
        return JSONResponse(P.error_body(message, type_, param, code), status_code=status, headers=headers)

    @app.exception_handler(P.RequestError)
    async def _request_error(_, e: P.RequestError):
        return error(e.status, e.message, _ERROR_TYPES.get(e.status, "invalid_request_error"), e.param,
                     e.code, e.reason, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        return error(400, f"Invalid request: {first.get('msg', 'validation failed')}.",
                     param=".".join(str(x) for x in first.get("loc", ())[1:]) or None,
                     reason="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        type_ = "invalid_request_error" if e.status_code < 500 else "internal_error"
        return error(e.status_code, str(e.detail), type_, code="not_found" if e.status_code == 404 else None,
                     headers=getattr(e, "headers", None))

    @app.exception_handler(EngineStepError)
    async def _engine_step(_, e: EngineStepError):
        return error(500, str(e), "internal_error", code="engine_error")

    @app.exception_handler(RequestFailed)
    async def _request_failed(_, e: RequestFailed):
        return error(400, _public(str(e)), code="request_failed")

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return error(503, str(e), "internal_error", code="engine_dead")

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        log.exception("internal error")
        return error(500, f"Internal server error: {type(e).__name__}: {e}", "internal_error",
                     reason="internal_error")

    @app.get("/health")
    async def health():
        if not state.loop.alive:
            return JSONResponse({"status": "error", "error": "engine thread died"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        state.metrics.set_compilations()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card():
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "jaxkv",
                "root": state.model_name, "parent": None, "max_model_len": state.max_model_len,
                "kv_policy": K.describe(state.kv_policy)}

    @app.get("/info")
    async def info():
        """What a client may want to know before sending extensions (no secrets: open like /health)."""
        return {"model": state.model_name, "max_model_len": state.max_model_len,
                "kv_policy": K.describe(state.kv_policy), "kv_policies": K.kv_policies(),
                "segment_reuse": state.reuse_enabled, "reuse_methods": K.reuse_methods(), **state.info}

    @app.get("/v1/models")
    async def models(request: Request):
        _tenant(state, request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        _tenant(state, request)
        if model_id != state.model_name:
            raise P.RequestError(f"The model '{model_id}' does not exist.", "model", "model_not_found", 404)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = asyncio.get_running_loop().time()
        tenant = _tenant(state, request)
        req = P.parse(P.CompletionRequest, await _read_body(request, state.limits.max_body_bytes))
        P.check_model(req, state.model_name)
        P.check_common(req)
        P.check_completion_extras(req)
        _check_choices(state, _num_prompts(req.prompt) * (req.n or 1))
        policy = K.request_policy(req, state.max_model_len, merge_ok=state.kv_merge)
        if (req.logprobs or (req.echo and req.logprobs is not None)) and req.reuse is None:
            _check_logprobs_policy(state, policy, "logprobs")  # (reuse requests decode the full cache)
        key = _extra_key(tenant, req.cache_salt)
        reuse = None
        if req.reuse is not None:
            method = K.request_reuse_method(req.reuse.method, state.max_model_len)
            reuse = (method, req.reuse.segments,
                     await _segment_tokens(state, req.reuse.segments, key, "reuse.segments"))
        # Tokenizing (up to a whole body's worth of text) runs off the event loop.
        jobs = await asyncio.to_thread(_completion_jobs, state, req, reuse)
        _set_policy(jobs, policy)
        return await _serve(state, request, req, jobs, False, key, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = asyncio.get_running_loop().time()
        tenant = _tenant(state, request)
        req = P.parse(P.ChatCompletionRequest, await _read_body(request, state.limits.max_body_bytes))
        P.check_model(req, state.model_name)
        P.check_common(req)
        P.check_chat_extras(req)
        _check_choices(state, req.n or 1)
        policy = K.request_policy(req, state.max_model_len, merge_ok=state.kv_merge)
        key = _extra_key(tenant, req.cache_salt)
        segments: list[str] = []
        marker = f"\x00{uuid.uuid4().hex}\x00"  # stands for a segment part in the rendered template
        messages = P.chat_messages(req, segments, marker)
        reuse = None
        if len(segments) > P.MAX_SEGMENTS:
            raise P.RequestError(f"At most {P.MAX_SEGMENTS} segment parts are allowed.", "messages")
        if segments:
            if "kv_policy" in req.model_fields_set and req.kv_policy is not None:
                raise P.RequestError("kv_policy cannot be combined with segment reuse (pass null or leave it "
                                     "out).", "kv_policy")
            method = K.request_reuse_method(req.reuse.method if req.reuse is not None else "naive",
                                            state.max_model_len)
            reuse = (method, segments, await _segment_tokens(state, segments, key, "messages"))
        elif req.reuse is not None:
            raise P.RequestError("reuse needs segment content parts ({'type': 'segment', 'id': ...}).",
                                 "reuse")
        if req.logprobs and req.top_logprobs and reuse is None:
            _check_logprobs_policy(state, policy, "top_logprobs")
        jobs = await asyncio.to_thread(_chat_jobs, state, req, messages, marker, reuse)
        _set_policy(jobs, policy)
        return await _serve(state, request, req, jobs, True, key, arrival)

    # ------------------------------------------------------------------------------ tokenizer routes
    # vLLM's shapes: lm-evaluation-harness (`local-completions`, tokenizer_backend=remote) tokenizes through
    # them, so an evaluation needs no tokenizer files of its own (docs/lm_eval.md).

    @app.post("/tokenize")
    async def tokenize(request: Request):
        _tenant(state, request)
        req = P.parse(P.TokenizeRequest, await _read_body(request, state.limits.max_body_bytes))
        ids = await asyncio.to_thread(_encode_within, state, req.prompt, req.add_special_tokens, "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        _tenant(state, request)
        req = P.parse(P.DetokenizeRequest, await _read_body(request, state.limits.max_body_bytes))
        return {"prompt": state.decode(_token_ids(state, req.tokens, "tokens"))}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        _tenant(state, request)

        def info(eng):
            tok = eng.tokenizer
            return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token, "pad_token": tok.pad_token,
                    "chat_template": tok.chat_template, "model_max_length": state.max_model_len}

        return await state.loop.call(info)

    # ------------------------------------------------------------------------------------ segments

    @app.post("/v1/segments")
    async def create_segment(request: Request):
        tenant = _tenant(state, request)
        req = P.parse(P.SegmentRequest, await _read_body(request, state.limits.max_body_bytes))
        P.check_cache_salt(req.cache_salt)
        _check_reuse_enabled(state)
        if (req.text is None) == (req.tokens is None):
            raise P.RequestError("Pass exactly one of 'text' and 'tokens'.", "text")
        if req.text is not None:
            tokens = await asyncio.to_thread(_encode_within, state, req.text, req.add_special_tokens, "text")
        else:
            tokens = _token_ids(state, req.tokens, "tokens")
        param = "text" if req.text is not None else "tokens"
        if not tokens:
            raise P.RequestError("The segment is empty (after tokenization).", param)
        if len(tokens) >= state.max_model_len:
            raise P.RequestError(f"The segment has {len(tokens)} tokens; a prompt holds at most "
                                 f"{state.max_model_len - 1}.", param, "context_length_exceeded")
        context = []
        if isinstance(req.context, str):
            context = await asyncio.to_thread(_encode_within, state, req.context, False, "context")
        elif req.context is not None:
            context = _token_ids(state, req.context, "context")
        if len(context) + len(tokens) >= state.max_model_len:
            raise P.RequestError(f"The segment and its context have {len(context) + len(tokens)} tokens; a "
                                 f"prompt holds at most {state.max_model_len - 1}.", "context",
                                 "context_length_exceeded")
        key = _extra_key(tenant, req.cache_salt)
        frozen, tier = req.frozen, req.tier
        if tier is not None and not frozen:
            raise P.RequestError("tier pins a frozen segment where it stays; pass \"frozen\": true with it.",
                                 "tier")

        def register(eng):
            from jaxkv.cache.allocator import OutOfPages
            from jaxkv.engine.segment_tiers import SegmentCapacityError

            try:
                e = eng.reuser.register(tokens, key, frozen, context=context, tier=tier)
                return _segment_card(eng, e)
            except OutOfPages as e:
                raise P.RequestError(f"The KV pool has no room for this segment now ({e}); retry later or "
                                     "delete segments.", None, "kv_pool_full", 503) from None
            except SegmentCapacityError as e:
                raise P.RequestError(f"No segment tier has room for this segment: {e}.", None,
                                     "segment_memory_full", 507) from None
            except ValueError as e:
                raise P.RequestError(_public(str(e)), param) from None

        return await state.loop.call(register)

    @app.get("/v1/segments")
    async def list_segments(request: Request, cache_salt: str | None = None):
        key = _extra_key(_tenant(state, request), _salt(cache_salt))
        data = await state.loop.call(
            lambda eng: [_segment_card(eng, e) for e in eng.reuser.store.entries(key)])
        return {"object": "list", "data": data}

    @app.get("/v1/segments/{segment_id}")
    async def get_segment(segment_id: str, request: Request, cache_salt: str | None = None):
        key = _extra_key(_tenant(state, request), _salt(cache_salt))
        return await state.loop.call(lambda eng: _segment_card(eng, _lookup(eng, segment_id, key, None, 404)))

    @app.delete("/v1/segments/{segment_id}")
    async def delete_segment(segment_id: str, request: Request, cache_salt: str | None = None):
        key = _extra_key(_tenant(state, request), _salt(cache_salt))

        def delete(eng):
            _lookup(eng, segment_id, key, None, 404)
            eng.delete_segment(segment_id, key)
            return {"id": segment_id, "object": "segment.deleted", "deleted": True}

        return await state.loop.call(delete)

    return app


def _salt(cache_salt: str | None) -> str | None:
    P.check_cache_salt(cache_salt)
    return cache_salt


def _check_logprobs_policy(state: ServerState, policy, param: str) -> None:
    """Alternatives and prompt logprobs come from the ordinary step programs; a retrieval policy's decode
    returns only the sampled token's logprob."""
    from jaxkv.policies.retrieve import RetrievalPolicy

    effective = state.kv_policy if policy is K.DEFAULT else policy
    if isinstance(effective, RetrievalPolicy):
        raise P.RequestError(f"{param} alternatives and echoed prompt logprobs are not available with the "
                             f"retrieval KV policy {effective.name!r}; pass logprobs without alternatives, "
                             "or kv_policy null for the full cache.", param)


def _check_reuse_enabled(state: ServerState) -> None:
    if not state.reuse_enabled:
        raise P.RequestError("Segment reuse needs every KV head to keep its full history; this server runs "
                             "windowed (local) heads. Start it with --head-classes global.", "reuse",
                             "reuse_unavailable")


def _public(message: str) -> str:
    """An engine message without the namespace (tenant) it names."""
    return re.sub(r" (does not exist )?in namespace .*$", " does not exist here", message)


def _lookup(eng, seg_id: str, key: str | None, param: str | None, status: int = 400):
    from jaxkv.cache.segments import SegmentError

    try:
        return eng.reuser.store.get(seg_id, key)
    except SegmentError:
        raise K.segment_not_found(seg_id, param, status) from None


def _token_ids(state: ServerState, ids, param: str) -> list[int]:
    """`ids` as a list, or a 400 naming `param` when one lies outside the vocabulary."""
    ids = list(ids)
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise P.RequestError(f"{param} must lie in [0, {state.vocab_size}) (got {bad[0]}).", param)
    return ids


def _segment_card(eng, e) -> dict:
    return K.segment_card(eng.reuser.tiers, e)


async def _segment_tokens(state: ServerState, seg_ids: list[str], key: str | None,
                         param: str) -> list[list[int]]:
    """The tokens of each named segment in namespace `key` (looked up on the engine thread)."""
    _check_reuse_enabled(state)
    name = (lambda i: f"{param}[{i}]") if param == "reuse.segments" else (lambda i: param)
    return await state.loop.call(
        lambda eng: [list(_lookup(eng, s, key, name(i)).tokens) for i, s in enumerate(seg_ids)])


def _set_policy(jobs: list[_Job], policy) -> None:
    for j in jobs:  # reuse jobs: DEFAULT or None only (a policy object was refused with the request)
        j.kv_policy = policy


_ERROR_TYPES = {408: "timeout_error", 429: "rate_limit_error"}
# A text longer than this many characters per context token is first tokenized up to that length: one
# too long is refused after tokenizing a bounded prefix, not the whole body.
_PREFIX_CHARS_PER_TOKEN = 16
_PREFIX_SLACK_TOKENS = 64  # a cut through a word can add a few tokens that the whole text does not have


def _openapi(app: FastAPI) -> dict:
    """The OpenAPI schema with the request bodies the routes parse by hand (for clients and fuzzers)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title="jaxkv", version="0.1.0", routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    bodies = (("/v1/completions", P.CompletionRequest), ("/v1/chat/completions", P.ChatCompletionRequest),
              ("/v1/segments", P.SegmentRequest))
    for path, cls in bodies:
        js = cls.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        comps[cls.__name__] = js
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{cls.__name__}"}}}}
    app.openapi_schema = schema
    return schema


def _tenant(state: ServerState, request: Request) -> str | None:
    """The caller's namespace from `Authorization: Bearer KEY` when API keys are configured."""
    if not state.api_keys:
        return None
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    namespace = state.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
    if namespace is None:
        raise P.RequestError("Invalid or missing API key (pass it as 'Authorization: Bearer KEY').",
                             None, "invalid_api_key", 401, headers={"WWW-Authenticate": "Bearer"})
    return namespace


def _extra_key(tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine's prefix-cache namespace: identical prompts share pages only under an equal key."""
    if tenant is None and cache_salt is None:
        return None
    return json.dumps([tenant, cache_salt])


async def _read_body(request: Request, limit: int | None) -> bytes:
    """The body, refused with 413 from its Content-Length before reading (or once it passes `limit`)."""
    if limit is not None:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> P.RequestError:
    return P.RequestError(f"Request body of {size}+ bytes exceeds the server's limit of {limit} bytes "
                          "(--max-request-bytes).", None, "body_too_large", 413)


def _num_prompts(prompt) -> int:
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return 1
    return len(prompt)


def _check_choices(state: ServerState, num: int) -> None:
    """One request may not hold more engine requests than MAX_CHOICES or than the server admits."""
    cap = state.limits.capacity
    limit = P.MAX_CHOICES if cap is None else min(P.MAX_CHOICES, cap)
    if num > limit:
        raise P.RequestError(f"This request needs {num} generations (prompts x n); at most {limit} are "
                             "allowed in one request.", "n")


def _encode_within(state: ServerState, text: str, special: bool, param: str) -> list[int]:
    """Token ids of `text`, refusing a text far beyond the context without tokenizing all of it."""
    limit = state.max_model_len
    cut = _PREFIX_CHARS_PER_TOKEN * limit
    if len(text) > cut:
        head = len(state.encode(text[:cut], special)) - _PREFIX_SLACK_TOKENS
        if head >= limit:
            raise P.RequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has more "
                f"than {head} tokens. Please reduce the length of the prompt.", param,
                code="context_length_exceeded")
    return list(state.encode(text, special))


def _completion_jobs(state: ServerState, req, reuse: tuple | None = None) -> list[_Job]:
    """Jobs of a completion request; with `reuse` = (method, segment ids, segment tokens) every prompt is
    the suffix after ``prefix | segments``."""
    prompts = _completion_prompts(req.prompt, state, special=reuse is None, allow_empty=reuse is not None)
    explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    head, spec = [], None
    if reuse is not None:
        method, seg_ids, seg_tokens = reuse
        prefix = req.reuse.prefix
        if isinstance(prefix, list):
            _check_ids(state, prefix, "reuse.prefix")
            prefix_ids = list(prefix)
        else:  # the prompt's start: BOS (when the tokenizer adds one) and the prefix text
            prefix_ids = _encode_within(state, prefix or "", True, "reuse.prefix")
        head = prefix_ids + [t for seg in seg_tokens for t in seg]
        spec = (prefix_ids, list(seg_ids), method)
    jobs = []
    no_output = req.max_tokens == 0  # with echo (checked): the prompt alone, as lm-eval's loglikelihood asks
    for pi, (text, ids) in enumerate(prompts):
        full = head + ids
        if not full:
            raise P.RequestError("prompt is empty after tokenization.", "prompt")
        max_tokens = P.resolve_max_tokens(1 if no_output else req.max_tokens, explicit, len(full),
                                          state.max_model_len)
        if spec is not None:
            layout = [(len(prefix_ids), False)] + [(len(t), True) for t in seg_tokens] + [(len(ids), False)]
            max_tokens = _fit_reuse_layout(state, layout, max_tokens, explicit, "max_tokens", "prompt")
        if req.echo:
            echo = text if text is not None and spec is None else state.decode(full)
        else:
            echo = ""
        new = _jobs(state, req, pi, full, max_tokens, echo, len(jobs),
                    prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None)
        for j in new:
            j.no_output = no_output
            if spec is not None:
                j.reuse = (spec[0], spec[1], ids, spec[2])
        jobs += new
    return jobs


def _chat_jobs(state: ServerState, req, messages: list[dict], marker: str = "",
               reuse: tuple | None = None) -> list[_Job]:
    try:
        text = state.chat_text(messages)
    except Exception as e:  # jinja2 raise_exception (e.g. roles must alternate) and template errors
        raise P.RequestError(f"Could not apply the chat template: {e}", "messages") from None
    spec = None
    if reuse is None:
        ids = _encode_within(state, text, False, "messages")
    else:  # the rendered prompt around the (adjacent) segment parts: prefix | segments | suffix
        method, seg_ids, seg_tokens = reuse
        parts = text.split(marker)
        if (len(parts) != 2 * len(seg_ids) + 1 or parts[1::2] != [str(i) for i in range(len(seg_ids))]
                or any(parts[2:-1:2])):
            raise P.RequestError("Segment content parts must be adjacent (one run of segments in one "
                                 "message) and kept by the chat template.", "messages")
        prefix = _encode_within(state, parts[0], False, "messages")
        suffix = _encode_within(state, parts[-1], False, "messages")
        ids = prefix + [t for seg in seg_tokens for t in seg] + suffix
        spec = (prefix, list(seg_ids), suffix, method)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = P.resolve_max_tokens(requested, requested is not None, len(ids), state.max_model_len,
                                      param, "messages")
    if spec is not None:
        layout = [(len(spec[0]), False)] + [(len(t), True) for t in seg_tokens] + [(len(spec[2]), False)]
        max_tokens = _fit_reuse_layout(state, layout, max_tokens, requested is not None, param, "messages")
    jobs = _jobs(state, req, 0, ids, max_tokens, "", 0)
    for j in jobs:
        j.reuse = spec
    return jobs


def _fit_reuse_layout(state: ServerState, layout, max_tokens: int, explicit: bool, param: str,
                      prompt_param: str) -> int:
    """`max_tokens` within what a reuse prompt leaves: its segments start on page boundaries, so their
    padding takes context too. A default is clamped to it; an explicit value beyond it is a 400."""
    from jaxkv.engine.reuse import generation_room, prompt_pages

    ps = state.info["page_size"]
    pages = state.info.get("pages_per_head", -(-state.max_model_len // ps))  # context + reuse slack
    npg = prompt_pages(layout, ps)
    room = generation_room(npg, ps, pages)
    if max_tokens <= room:
        return max_tokens
    why = (f"The prompt with its segments starting on page boundaries (page size {ps}) takes {npg * ps} of "
           f"the {pages * ps} slots per head (the {state.max_model_len}-token context and its reuse slack, "
           "--segment-max-segments)")
    if room < 1:
        raise P.RequestError(f"{why}, which leaves no room for a completion. Please reduce the prompt or the "
                             "segments.", prompt_param, code="context_length_exceeded")
    if explicit:
        raise P.RequestError(f"{why}, which leaves room for {room} completion tokens; {param} is "
                             f"{max_tokens}. Please reduce {param}.", param, code="context_length_exceeded")
    return room


def _check_ids(state: ServerState, ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < state.vocab_size]
    if bad:
        raise P.RequestError(f"token ids must lie in [0, {state.vocab_size}) (got {bad[0]}).", param)


def _completion_prompts(prompt, state: ServerState, special: bool = True,
                        allow_empty: bool = False) -> list[tuple[str | None, list[int]]]:
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
            ids = _encode_within(state, p, special, param)
            if not ids and not allow_empty:
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
          first_index: int, prompt_logprobs: int | None = None) -> list[_Job]:
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
    want_logprobs = req.logprobs is not None and req.logprobs is not False
    # completions: `logprobs` is the count; chat: `logprobs` is a flag and `top_logprobs` the count
    alternatives = (req.top_logprobs or 0) if isinstance(req.logprobs, bool) else (req.logprobs or 0)
    alternatives = alternatives if want_logprobs else 0
    jobs = []
    for i in range(req.n or 1):
        kwargs = dict(temperature=float(pick(req.temperature, "temperature", 1.0)),
                      top_p=float(pick(req.top_p, "top_p", 1.0)), top_k=int(pick(req.top_k, "top_k", 0)),
                      max_tokens=max_tokens, stop=tuple(stop), stop_token_ids=stop_token_ids,
                      seed=P.engine_seed(req.seed, i), ignore_eos=ignore_eos,
                      detokenize=False)  # the text is made here (`_apply`); stop strings keep the engine's
        if alternatives:
            kwargs["logprobs"] = alternatives
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        try:
            sampling = state.make_sampling(**kwargs)
        except ValueError as e:
            raise P.RequestError(str(e)) from None
        jobs.append(_Job(first_index + i, prompt_index, ids, sampling, stop_ids,
                         TextStream(state.decode, ids, stop), echo, want_logprobs=want_logprobs,
                         num_alternatives=alternatives, echo_logprobs=prompt_logprobs is not None))
    return jobs


# ------------------------------------------------------------------------------------------ running


class RequestTimeout(P.RequestError):
    def __init__(self, timeout: float):
        super().__init__(f"The request did not finish within the server's limit of {timeout:g} s "
                         "(--request-timeout).", None, "request_timeout", 408)


async def _submit(state: ServerState, jobs: list[_Job], q: asyncio.Queue, extra_key: str | None) -> None:
    """Admit every choice or none: 429 with Retry-After while the server holds its capacity."""
    lim = state.limits
    if not state.loop.try_reserve(len(jobs), lim.capacity):
        raise P.RequestError(f"The server is at capacity ({lim.capacity} generations in flight: "
                             f"--max-num-seqs + --max-queued-requests); retry later.", None, "queue_full",
                             429, headers={"Retry-After": str(lim.retry_after_s)})
    added = 0
    try:
        for job in jobs:
            added += 1
            job.request_id = uuid.uuid4().hex  # set first: a cancelled submit still aborts it
            await state.loop.add(job.prompt_ids, job.sampling, q, job.index, extra_key, reserved=True,
                                 request_id=job.request_id, kv_policy=job.kv_policy, reuse=job.reuse)
            if job.reuse is not None:
                state.metrics.observe_reuse(job.reuse[3].name)
    except P.RequestError:
        state.loop.release(len(jobs) - added)
        _abort(state, jobs, "error")
        raise
    except ValueError as e:  # the engine refused (pool too small for this request, a segment, ...)
        state.loop.release(len(jobs) - added)
        _abort(state, jobs, "error")
        raise P.RequestError(_public(str(e))) from None
    except BaseException:
        state.loop.release(len(jobs) - added)
        _abort(state, jobs, "error")
        raise


def _abort(state: ServerState, jobs: list[_Job], reason: str) -> None:
    for job in jobs:
        if job.request_id is not None and not job.finished:
            state.loop.abort(job.request_id, reason)
            job.finished = True


def _abort_reason(e: BaseException) -> str:
    if isinstance(e, RequestTimeout):
        return "timeout"
    if isinstance(e, (EngineStepError, EngineDeadError)):
        return "engine_error"
    if isinstance(e, RequestFailed):
        return "error"
    return "client"


def _apply(state: ServerState, job: _Job, outs: list) -> None:
    """Feed a choice's pending engine outputs (oldest first; only the last may be finished) into it; ends
    the choice on finish or a matched stop string. Their tokens are detokenized in one pass."""
    new: list[int] = []
    for out in outs:
        ids = list(out.new_token_ids)
        job.output_tokens += len(ids)
        job.cached_tokens = max(job.cached_tokens, getattr(out, "num_cached_tokens", 0))
        if out.finished and out.finish_reason == "stop" and ids and ids[-1] in job.stop_ids:
            ids = ids[:-1]  # the stop token itself is not part of the text
        if job.echo_logprobs and out.prompt_logprobs is not None:
            job.logprobs[:0] = _prompt_items(state, job.prompt_ids, out)
        if job.no_output:  # max_tokens 0: the token the engine had to sample is not part of the answer
            ids, job.output_tokens = [], 0
        if job.want_logprobs:
            tops = out.new_top_logprobs or [None] * len(ids)
            job.logprobs += [(state.decode([t]), float(lp), _alternatives(state, top))
                             for t, lp, top in zip(ids, out.new_logprobs, tops)]
        new += ids
    last = outs[-1]
    job.text.add(new, final=last.finished)
    if last.finished:
        job.finished = True
        job.output_tokens = 0 if job.no_output else max(job.output_tokens, last.num_output_tokens)
        job.finish_reason = "length" if job.no_output else "stop" if job.text.stopped else last.finish_reason
    elif job.text.stopped:  # the stop string matched here first; the engine need not go on
        state.loop.abort(job.request_id, "stop_string")
        job.finished, job.finish_reason = True, "stop"


def _alternatives(state: ServerState, top) -> list[tuple[str, float]] | None:
    return None if top is None else [(state.decode([t]), float(lp)) for t, lp in top]


def _prompt_items(state: ServerState, prompt_ids: list[int], out) -> list[tuple]:
    """The echoed prompt's logprob items: (token text, logprob, alternatives); the first token has none."""
    tops = out.prompt_top_logprobs or [None] * len(prompt_ids)
    return [(state.decode([t]), None if lp is None else float(lp), _alternatives(state, top))
            for t, lp, top in zip(prompt_ids, out.prompt_logprobs, tops)]


async def _events(state: ServerState, jobs: list[_Job], q: asyncio.Queue,
                  deadline: float | None) -> AsyncIterator[list[_Job]]:
    """Yield the choices that got output, until every choice finished; RequestTimeout at `deadline`.

    Everything already queued is taken at once: a client that fell behind the engine gets each choice's
    new tokens as one multi-token piece (one detokenization, one SSE event), not one per engine step.
    """
    loop = asyncio.get_running_loop()
    by_index = {j.index: j for j in jobs}
    while not all(j.finished for j in jobs):
        left = None if deadline is None else deadline - loop.time()
        if left is not None and left <= 0:
            raise RequestTimeout(state.limits.request_timeout)
        if q.empty():
            try:
                items = [await asyncio.wait_for(q.get(), left)]
            except TimeoutError:
                raise RequestTimeout(state.limits.request_timeout) from None
        else:
            items = []
        while not q.empty():
            items.append(q.get_nowait())
        pending: dict[int, list] = {}  # choice index -> its outputs, in arrival order
        error = None
        for index, outs in items:  # outs: one step's outputs of that choice, or the exception it failed with
            if by_index[index].finished:
                continue  # output that raced our own abort
            if isinstance(outs, BaseException):
                error = by_index[index], outs
                break  # the request fails: what came after does not matter
            pending.setdefault(index, []).extend(outs)
        ready = []
        for index, outs in pending.items():
            job = by_index[index]
            _apply(state, job, outs)
            ready.append(job)
        if ready:
            yield ready
        if error is not None:
            error[0].finished = True  # the engine already dropped it
            raise error[1]


def _usage(jobs: list[_Job]) -> dict:
    prompt = {j.prompt_index: len(j.prompt_ids) for j in jobs}
    cached = {j.prompt_index: j.cached_tokens for j in jobs}
    return P.usage(sum(prompt.values()), sum(j.output_tokens for j in jobs), sum(cached.values()))


async def _serve(state: ServerState, request: Request, req, jobs: list[_Job], chat: bool,
                 extra_key: str | None, arrival: float):
    timeout = state.limits.request_timeout
    deadline = None if timeout is None else arrival + timeout
    q: asyncio.Queue = asyncio.Queue()
    await _submit(state, jobs, q, extra_key)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        usage_each = include_usage and opts.continuous_usage_stats
        return _Stream(_stream(state, req, jobs, q, rid, chat, include_usage, deadline, usage_each),
                       cleanup=lambda: _abort(state, jobs, "client"), media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache"})
    collect = asyncio.ensure_future(_collect(state, jobs, q, deadline))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # client went away (or we are being cancelled): free the pages
            collect.cancel()
            _abort(state, jobs, "client")
    if not collect.done() or collect.cancelled():
        return Response(status_code=499)
    if collect.exception() is not None:  # timeout or engine failure: the other choices stop too
        _abort(state, jobs, _abort_reason(collect.exception()))
        raise collect.exception()
    created = P.now()
    choices = []
    for j in jobs:
        text = j.echo + j.text.text
        if chat:
            lp = P.chat_logprobs(j.logprobs) if j.want_logprobs else None
            choices.append({"index": j.index, "message": {"role": "assistant", "content": text},
                            "logprobs": lp, "finish_reason": j.finish_reason})
        else:
            lp = P.completion_logprobs(j.logprobs, 0, j.num_alternatives > 0) if j.want_logprobs else None
            choices.append({"index": j.index, "text": text, "logprobs": lp, "finish_reason": j.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name, "system_fingerprint": None, "choices": choices, "usage": _usage(jobs)}


class _Stream(StreamingResponse):
    """A StreamingResponse that aborts its engine requests however it ends: a client gone before the
    first chunk never starts the generator, so the generator's own `finally` would not run."""

    def __init__(self, content, cleanup: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def _collect(state: ServerState, jobs: list[_Job], q: asyncio.Queue, deadline: float | None) -> None:
    async for _ in _events(state, jobs, q, deadline):
        pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(state: ServerState, req, jobs: list[_Job], q: asyncio.Queue, rid: str, chat: bool,
                  include_usage: bool, deadline: float | None,
                  usage_each: bool = False) -> AsyncIterator[str]:
    created = P.now()
    obj = "chat.completion.chunk" if chat else "text_completion"
    # Every event of this stream shares its head and tail; only the choices are encoded per event.
    # json.dumps keeps the default ASCII escaping: no U+2028 etc. inside an SSE line.
    head = (f'data: {{"id": {json.dumps(rid)}, "object": "{obj}", "created": {created}, '
            f'"model": {json.dumps(state.model_name)}, "system_fingerprint": null, "choices": [')
    tail = '], "usage": null}\n\n' if include_usage else "]}\n\n"

    def chunk(choices: list[dict], usage=None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                "system_fingerprint": None, "choices": choices}
        if include_usage:
            body["usage"] = _usage(jobs) if usage_each and usage is None else usage
        return f"data: {json.dumps(body)}\n\n"

    def event(job: _Job, text: str, finish: str | None) -> str:
        """One choice's SSE event; the plain case (no logprobs) from a template, not a dict."""
        if job.want_logprobs:
            return chunk([choice(job, text, finish)])
        fin = "null" if finish is None else json.dumps(finish)
        if chat:
            body = f'"delta": {{"content": {json.dumps(text)}}}' if text else '"delta": {}'
        else:
            body = f'"text": {json.dumps(text)}'
        end = f'], "usage": {json.dumps(_usage(jobs))}}}\n\n' if usage_each else tail
        return f'{head}{{"index": {job.index}, {body}, "logprobs": null, "finish_reason": {fin}}}{end}'

    def new_logprobs(job: _Job):
        """The log-probabilities of the tokens generated since the last chunk (None unless asked for)."""
        if not job.want_logprobs:
            return None
        items = job.logprobs[job.logprobs_sent:]
        job.logprobs_sent = len(job.logprobs)
        if chat:
            return P.chat_logprobs(items)
        out = P.completion_logprobs(items, job.logprobs_offset, job.num_alternatives > 0)
        job.logprobs_offset += sum(len(t) for t, _, _ in items)
        return out

    def choice(job: _Job, text: str, finish: str | None, first: bool = False) -> dict:
        lp = None if first else new_logprobs(job)
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": job.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": job.index, "text": text, "logprobs": lp, "finish_reason": finish}

    def fail(status: int, message: str, type_: str, code: str) -> str:
        # Headers (200) are gone: the error travels as the last event, as vLLM and OpenAI do.
        state.metrics.observe_error(status, code)
        return f"data: {json.dumps(P.error_body(message, type_, code=code))}\n\ndata: [DONE]\n\n"

    try:
        if chat:
            yield chunk([choice(j, "", None, first=True) for j in jobs])
        elif any(j.echo and not j.echo_logprobs for j in jobs):
            yield chunk([choice(j, j.echo, None) for j in jobs if j.echo and not j.echo_logprobs])
        async for ready in _events(state, jobs, q, deadline):
            events = []
            for job in ready:
                text = job.text.take(final=job.finished)
                if job.echo_logprobs and job.echo:  # the echo goes out with the prompt's logprobs
                    text, job.echo = job.echo + text, ""
                if job.finished:
                    events.append(event(job, text, job.finish_reason))
                elif text:
                    events.append(event(job, text, None))
            if events:  # one write for all choices that moved
                yield "".join(events)
        if include_usage:
            yield chunk([], _usage(jobs))
        yield "data: [DONE]\n\n"
    except RequestTimeout as e:
        _abort(state, jobs, "timeout")
        yield fail(408, e.message, "timeout_error", e.code)
    except EngineStepError as e:
        _abort(state, jobs, "engine_error")
        yield fail(500, str(e), "internal_error", "engine_error")
    except EngineDeadError as e:
        _abort(state, jobs, "engine_error")
        yield fail(503, str(e), "internal_error", "engine_dead")
    except RequestFailed as e:
        _abort(state, jobs, "error")
        yield fail(400, _public(str(e)), "invalid_request_error", "request_failed")
    finally:  # the client disconnected (generator closed) or we finished: free what is still running
        _abort(state, jobs, "client")
