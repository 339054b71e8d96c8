"""OpenAI request schemas, their validation, and the response / error bodies.

Everything a client can get wrong is checked here and raised as `RequestError` (HTTP 400 with an
OpenAI-style body). Parsing is strict: a string where a number belongs is an error, not a coercion.
Unknown fields are ignored (clients send many optional OpenAI fields); fields we know but do not
implement (penalties, tools, ...) are rejected with a message saying so.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 16
MAX_STOP = 16
MAX_STOP_CHARS = 512  # per stop string: held-back text while a stop could still match grows with it
MAX_STOP_TOKEN_IDS = 256
MAX_CHOICES = 64  # prompts x n of one request: more is a batch job, not one request
MAX_CACHE_SALT_CHARS = 256
MAX_SEGMENTS = 64  # segments one reuse request names
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's range)
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs (OpenAI's range)
INT32_MAX = 2**31 - 1  # top_k and token ids travel to the device as int32
SEED_MOD = 2**63
SEED_RANGE = (-(2**63), 2**64)


class RequestError(ValueError):
    """A client error: becomes HTTP `status` with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.headers = headers

    @property
    def reason(self) -> str:
        """Label of `jaxkv_requests_rejected_total`: the code when there is one."""
        return self.code or ("invalid_request" if self.status == 400 else f"http_{self.status}")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (clients time tokens, not events, with it).
    continuous_usage_stats: bool = False


class _Closed(BaseModel):
    """Extension objects: an unknown field there is a typo, refused with 400."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ReuseSpec(_Closed):
    """Extension `reuse`: the prompt is ``prefix | segments | prompt`` with the segments' cached K/V."""

    segments: list[str] = Field(default_factory=list)  # segment ids from POST /v1/segments
    method: str | dict[str, Any] = "naive"  # a reuse method name, or {"name": ..., fields}
    prefix: str | list[int] | None = None  # completions only: text (with BOS) or ids before the segments


class SegmentRequest(_Closed):
    """POST /v1/segments: register a segment (its K/V prefilled once) under the caller's namespace."""

    text: str | None = None
    tokens: list[int] | None = None
    add_special_tokens: bool = False  # text only: a segment sits mid-prompt, so no BOS by default
    cache_salt: str | None = None  # a namespace within the caller's tenant, as on the generation routes
    frozen: bool = False  # a knowledge-base entry: pinned in its tier (device unless `tier` says host)
    tier: Literal["device", "host"] | None = None  # where a frozen segment stays (docs/segments.md)
    # what preceded the segment in the prompt it comes from (text, tokenized like `text`, or token ids): the
    # segment is prefilled after it, its own K/V dropped, and it is part of the segment's id (SparseX's
    # cache-building request; docs/policies.md, "Segment context")
    context: str | list[int] | None = None


class _CommonRequest(_Strict):
    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM-compatible); 0 disables
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension: generate exactly max_tokens tokens
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None  # extension (vLLM): prefix-cache namespace within the caller's tenant
    kv_policy: str | dict[str, Any] | None = None  # extension: compression policy; null = full cache
    reuse: ReuseSpec | None = None  # extension: segment reuse


class CompletionRequest(_CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class SegmentPart(_Strict):
    type: Literal["segment"]
    id: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Closed):
    """POST /tokenize (vLLM's shape): text -> token ids."""

    prompt: str
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(_Closed):
    """POST /detokenize (vLLM's shape): token ids -> text (special tokens skipped)."""

    tokens: list[int]
    model: str | None = None


def parse(model_cls: type[_Strict], body: bytes):
    """Parse a JSON body into `model_cls`, turning every problem into a `RequestError`."""
    if not body.strip():
        raise RequestError("Request body is empty; expected a JSON object.")
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as e:
        raise validation_to_request_error(e) from None


def validation_to_request_error(e: ValidationError) -> RequestError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return RequestError(f"Malformed JSON body: {err['msg']}.")
    if err["type"] == "model_type" and not err["loc"]:
        return RequestError("Request body must be a JSON object.")
    param = _loc_to_param(err["loc"])
    if err["type"] == "missing":
        return RequestError(f"Missing required parameter '{param}'.", param=param)
    got = err.get("input")
    got_s = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 80 else type(got).__name__
    return RequestError(f"Invalid value for '{param}': {err['msg']} (got {got_s}).", param=param)


def _loc_to_param(loc) -> str:
    # Drop pydantic's union-member tags ("str", "list[int]", ...) so the param names the field.
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "dict", "list", "function-after"):
            continue
        else:
            out += ("." if out else "") + part
    return out or None


# ------------------------------------------------------------------------------------------- validation


def check_model(req: _CommonRequest, served_model_name: str) -> None:
    if req.model != served_model_name:
        raise RequestError(f"The model '{req.model}' does not exist. This server serves "
                           f"'{served_model_name}'.", param="model", code="model_not_found")


def check_common(req: _CommonRequest) -> None:
    """Range checks shared by both endpoints (types were checked by the schema)."""
    if req.temperature is not None and not (math.isfinite(req.temperature) and 0 <= req.temperature <= 2):
        raise RequestError(f"temperature must be between 0 and 2 (got {req.temperature}).", "temperature")
    if req.top_p is not None and not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1] (got {req.top_p}).", "top_p")
    if req.top_k is not None and not 0 <= req.top_k <= INT32_MAX:
        raise RequestError(f"top_k must be in [0, {INT32_MAX}], 0 disables it (got {req.top_k}).", "top_k")
    if req.seed is not None and not SEED_RANGE[0] <= req.seed < SEED_RANGE[1]:
        raise RequestError(f"seed must be a 64-bit integer (got {req.seed}).", "seed")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N} (got {n}).", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and v != 0:
            raise RequestError(f"{name} is not supported by this server; omit it or pass 0.", name)
    if req.logit_bias:
        raise RequestError("logit_bias is not supported by this server.", "logit_bias")
    stops = stop_list(req)
    if len(stops) > MAX_STOP:
        raise RequestError(f"At most {MAX_STOP} stop sequences are allowed (got {len(stops)}).", "stop")
    if any(s == "" for s in stops):
        raise RequestError("stop sequences must be non-empty strings.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop sequences may have at most {MAX_STOP_CHARS} characters.", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"At most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed "
                           f"(got {len(req.stop_token_ids)}).", "stop_token_ids")
    check_cache_salt(req.cache_salt)
    if req.reuse is not None:
        if "kv_policy" in req.model_fields_set and req.kv_policy is not None:
            raise RequestError("kv_policy cannot be combined with segment reuse (pass null or leave it out).",
                               "kv_policy")
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed when stream is true.", "stream_options")


def check_cache_salt(cache_salt: str | None) -> None:
    if cache_salt is not None and not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                           "characters.", "cache_salt")


def check_completion_extras(req: CompletionRequest) -> None:
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise RequestError(f"logprobs must lie in [0, {MAX_COMPLETION_LOGPROBS}] (got {req.logprobs}).",
                               "logprobs")
        if req.echo and req.reuse is not None:
            raise RequestError("echo with logprobs (the prompt's log-probabilities) cannot be combined with "
                               "segment reuse: reused segment tokens are not recomputed, so they have no "
                               "logits. Drop echo or logprobs, or send the prompt without reuse.", "echo")
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("max_tokens must be at least 1 (0 is allowed only with echo: true, which returns "
                           "the prompt).", "max_tokens")
    if req.suffix:
        raise RequestError("suffix is not supported by this server.", "suffix")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise RequestError("best_of is not supported by this server (it must equal n).", "best_of")
    if req.reuse is not None and not 1 <= len(req.reuse.segments) <= MAX_SEGMENTS:
        raise RequestError(f"reuse.segments must name 1 to {MAX_SEGMENTS} segment ids.", "reuse.segments")
    if isinstance(req.prompt, list) and not req.prompt:
        raise RequestError("prompt must not be empty.", "prompt")
    if isinstance(req.prompt, list) and any(isinstance(p, list) and not p for p in req.prompt):
        raise RequestError("prompt token lists must not be empty.", "prompt")


def check_chat_extras(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must lie in [0, {MAX_TOP_LOGPROBS}] (got {req.top_logprobs}).",
                               "top_logprobs")
        if not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true.", "top_logprobs")
    if req.tools:
        raise RequestError("tools (function calling) are not supported by this server.", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise RequestError("tool_choice is not supported by this server.", "tool_choice")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise RequestError("Only response_format {'type': 'text'} is supported.", "response_format")
    if req.reuse is not None and (req.reuse.segments or req.reuse.prefix is not None):
        raise RequestError("In a chat request segments are content parts ({'type': 'segment', 'id': ...}) "
                           "of a message; reuse takes only the method here.", "reuse")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        if req.max_tokens != req.max_completion_tokens:
            raise RequestError("Pass only one of max_tokens and max_completion_tokens.", "max_tokens")


def chat_messages(req: ChatCompletionRequest, segments: list[str] | None = None,
                  marker: str = "") -> list[dict[str, str]]:
    """Messages as plain dicts for the chat template; content parts must be text, or segments
    (``{"type": "segment", "id": ...}``): each is appended to `segments` and stands in the text as
    ``marker + index + marker`` (the caller splits the rendered prompt there)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "segment" and segments is not None:
                    try:
                        seg = SegmentPart.model_validate(part)
                    except ValidationError:
                        raise RequestError("A segment content part is {'type': 'segment', 'id': SEGMENT_ID}.",
                                           f"messages[{i}].content[{j}]") from None
                    texts.append(f"{marker}{len(segments)}{marker}")
                    segments.append(seg.id)
                    continue
                try:
                    texts.append(TextPart.model_validate(part).text)
                except ValidationError:
                    raise RequestError("Only text content parts ({'type': 'text', 'text': ...}) and segments "
                                       "({'type': 'segment', 'id': ...}) are supported.",
                                       f"messages[{i}].content[{j}]") from None
            content = "".join(texts)
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def stop_list(req: _CommonRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def resolve_max_tokens(requested: int | None, explicit: bool, prompt_len: int, max_model_len: int,
                       param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """The number of tokens to generate for one prompt, or a `RequestError` naming the limit.

    An explicit request that does not fit is an error (as in OpenAI / vLLM); an implicit default is
    clamped to the room left in the context.
    """
    if requested is not None and requested < 1:
        raise RequestError(f"{param} must be at least 1 (got {requested}).", param)
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of "
            "the prompt.", prompt_param,
            code="context_length_exceeded")
    if requested is None:
        return room
    if explicit and requested > room:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or {param}.", param, code="context_length_exceeded")
    return min(requested, room)


def engine_seed(seed: int | None, index: int) -> int | None:
    """Per-choice seed: choices of one request differ, and any OpenAI seed (even negative) is valid."""
    if seed is None:
        return None
    return (seed + index) % SEED_MOD


# ------------------------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_logprobs(items: list[tuple]) -> dict:
    """OpenAI chat `logprobs` of generated tokens [(token text, logprob, alternatives)], the alternatives
    [(token text, logprob)] most likely first (`top_logprobs` of the request; empty for 0)."""
    def entry(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts or ()]}
                        for t, lp, alts in items], "refusal": None}


def completion_logprobs(items: list[tuple], offset: int = 0, alternatives: bool = False) -> dict:
    """OpenAI completions `logprobs` [(token text, logprob or None, alternatives or None)]: echoed prompt
    tokens first (the first one has neither), then the generated ones. `text_offset` counts from `offset`
    (characters of the choice's text before them). With `alternatives` (`logprobs` > 0) `top_logprobs`
    holds per token a {token text: logprob} of its alternatives plus the token itself (as OpenAI: up to
    `logprobs` + 1 entries), else it is null."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp, alts in items:
        tokens.append(t)
        lps.append(lp)
        offsets.append(offset)
        offset += len(t)
        if alternatives:
            tops.append(None if lp is None else _top_dict(t, lp, alts))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if alternatives else None,
            "text_offset": offsets}


def _top_dict(token: str, logprob: float, alts) -> dict[str, float]:
    """Alternatives as {text: logprob}: two tokens with one text keep the likelier; the token itself last."""
    out: dict[str, float] = {}
    for text, lp in alts or ():
        out.setdefault(text, lp)
    out.setdefault(token, logprob)
    return out


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
