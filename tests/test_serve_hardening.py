"""The server under hostile input, limits and faults.

Two kinds of fixtures, both over a real engine on a tiny random checkpoint, no mocks:
- `server`: a `python -m jaxkv.serve` subprocess with a small body limit and API keys (tenants), driven
  with the official `openai` client and raw httpx;
- `app`: the same app in-process (httpx's ASGI transport) whose `ServerState` a test may change, for
  what must not depend on timing: a full queue (capacity taken with the loop's own `try_reserve`), a
  deadline already past, and a sampling default that slips past the API checks and breaks an engine step.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

from jaxkv.serve.launch import ServerProcess

MAX_MODEL_LEN = 128
BODY_LIMIT = 65536
KEYS = {"key-a": "team-a", "key-a2": "team-a", "key-b": "team-b"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("hardening") / "tiny-llama")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "256",
                       "--max-num-seqs", "4", "--max-step-tokens", "64",
                       "--max-request-bytes", str(BODY_LIMIT), "--api-keys-file", str(keys)])
    yield s
    s.stop()


def client(s: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key=key, max_retries=0, timeout=120)


def post(s: ServerProcess, route: str, key: str | None = "key-a", **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{s.url}/{route}", headers={**headers, **kw.pop("headers", {})}, timeout=60, **kw)


# ------------------------------------------------------------------------------------ API keys, tenants

# About 85 tokens: several full pages of 16 that the prefix cache can serve.
DOC = " ".join(["the cache head page token model layer query key value window sink"] * 2)


def cached(s, key, prompt, **extra) -> int:
    r = client(s, key).completions.create(model=s.name, prompt=prompt, max_tokens=1, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_api_key_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, "wrong").completions.create(model=server.name, prompt="hi", max_tokens=1)
    assert e.value.body["code"] == "invalid_api_key"
    r = post(server, "completions", key=None, json={"model": server.name, "prompt": "hi"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/models").status_code == 401
    assert httpx.get(server.base + "/health").status_code == 200  # probes and scrapers need no key
    assert httpx.get(server.base + "/metrics").status_code == 200
    assert [m.id for m in client(server, "key-b").models.list().data] == [server.name]


def test_tenants_with_identical_prompts_share_nothing(server):
    prompt = "tenants " + DOC
    assert cached(server, "key-a", prompt) == 0  # first sight
    within = cached(server, "key-a", prompt)
    assert within >= 32  # the same tenant reuses its pages
    assert cached(server, "key-a2", prompt) == within  # another key of the same namespace too
    assert cached(server, "key-b", prompt) == 0  # another tenant: nothing
    assert cached(server, "key-b", prompt) == within  # ... until it cached its own copy


def test_cache_salt_separates_within_a_tenant(server):
    prompt = "salted " + DOC
    assert cached(server, "key-a", prompt) == 0
    assert cached(server, "key-a", prompt, cache_salt="s1") == 0
    assert cached(server, "key-a", prompt, cache_salt="s1") >= 32
    assert cached(server, "key-a", prompt, cache_salt="s2") == 0
    assert cached(server, "key-b", prompt, cache_salt="s1") == 0  # a salt does not cross tenants


# ------------------------------------------------------------------------------------ hostile input

_M = "MODEL"
HOSTILE = [  # (route, body: dict or raw bytes, expected status, param)
    ("completions", {"prompt": "a", "top_k": 2**31, "max_tokens": 4}, 400, "top_k"),
    ("completions", {"prompt": "a", "top_k": 10**30}, 400, "top_k"),
    ("completions", {"prompt": "a", "seed": 2**70}, 400, "seed"),
    ("completions", {"prompt": "a", "seed": -(2**64)}, 400, "seed"),
    ("completions", {"prompt": "a", "n": 10**30}, 400, "n"),
    ("completions", {"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens"),
    ("completions", {"prompt": [2**40]}, 400, "prompt"),
    ("completions", {"prompt": [[1, 2], [-5]]}, 400, "prompt[1]"),
    ("completions", {"prompt": "a", "stop_token_ids": [2**40]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "a", "stop_token_ids": [1] * 257}, 400, "stop_token_ids"),
    ("completions", {"prompt": "a", "stop": ["x"] * 1000}, 400, "stop"),
    ("completions", {"prompt": "a", "stop": "x" * 513}, 400, "stop"),
    ("completions", {"prompt": "a", "logprobs": 10**20}, 400, "logprobs"),
    ("completions", {"prompt": "a", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": ["a"] * 20, "n": 4}, 400, "n"),
    ("completions", {"prompt": "a", "cache_salt": ""}, 400, "cache_salt"),
    ("completions", {"prompt": "a", "cache_salt": 5}, 400, "cache_salt"),
    ("completions", {"prompt": "a", "top_k": True}, 400, "top_k"),
    ("completions", {"prompt": "hello " * 2000}, 400, "prompt"),  # beyond the context, tokenized in part
    ("completions", b'{"model": "MODEL", "prompt": "a", "temperature": NaN}', 400, "temperature"),
    ("completions", b'{"model": "MODEL", "prompt": "a", "top_p": Infinity}', 400, "top_p"),
    ("completions", b'{"model": "MODEL", "prompt": "a", "temperature": -Infinity}', 400, "temperature"),
    ("completions", b'{"model": "MODEL", "prompt": "a", "temperature": 1e400}', 400, "temperature"),
    ("completions", b'{"model": "MODEL", "prompt": "a\xff\xfe"}', 400, None),  # invalid UTF-8
    ("completions", b'{"model": "MODEL", "prompt": "a\\ud800"}', 400, None),  # lone surrogate
    ("completions", b'{"model": "MODEL", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, None),
    ("chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "root", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 10**9}, 400,
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**40},
     400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 1500}, 400, "messages"),
    ("chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
]


@pytest.mark.parametrize("route,body,status,param", HOSTILE,
                         ids=[f"{r}-{i}" for i, (r, *_) in enumerate(HOSTILE)])
def test_hostile_request_is_a_4xx_naming_the_field(server, route, body, status, param):
    if isinstance(body, dict):
        r = post(server, route, json={"model": server.name, **body})
    else:
        r = post(server, route, content=body.replace(b"MODEL", server.name.encode()),
                 headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == param, err


def test_body_over_the_limit_is_413_declared_or_streamed(server):
    big = json.dumps({"model": server.name, "prompt": "a " * BODY_LIMIT}).encode()
    r = post(server, "completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = post(server, "completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert server.metric("jaxkv_requests_rejected_total", reason="body_too_large") >= 2
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}


def test_hostile_input_leaves_the_server_serving(server):
    wrong = post(server, "completions", key="wrong", json={"model": server.name, "prompt": "hi"})
    assert wrong.status_code == 401
    r = client(server, "key-a").completions.create(model=server.name, prompt="hi", max_tokens=3,
                                                   extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert server.metric("jaxkv_http_request_errors_total", status="500") == 0
    assert server.metric("jaxkv_requests_rejected_total", reason="invalid_api_key") >= 1


def test_openapi_schema_describes_request_bodies(server):
    schema = httpx.get(server.base + "/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    ref = body["schema"]["$ref"].rsplit("/", 1)[-1]
    props = schema["components"]["schemas"][ref]["properties"]
    assert {"model", "prompt", "top_k", "cache_salt"} <= set(props)


# ------------------------------------------------------------------------------------ in-process app


@pytest.fixture(scope="module")
def app(ckpt):
    import jaxkv
    from jaxkv.engine.engine import Engine
    from jaxkv.serve.app import ServeLimits, build_app
    from jaxkv.serve.server import build_state, warm_up

    model = jaxkv.load(ckpt, dtype="float32")
    engine = Engine(model, num_pages=128, max_num_seqs=2, max_model_len=MAX_MODEL_LEN, max_step_tokens=32)
    warm_up(engine)
    state = build_state(model, engine, "tiny", limits=ServeLimits(max_queued_requests=2))
    state.loop.start()
    yield build_app(state), state
    state.loop.stop()


def run(app, *calls):
    """Send (method, path, json) calls in order through the ASGI app; returns the responses."""

    async def main():
        transport = httpx.ASGITransport(app=app[0])
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return [await c.request(m, p, json=j) for m, p, j in calls]

    return asyncio.run(main())


def body(**kw):
    return {"model": "tiny", "prompt": "the old river", "max_tokens": 4, "ignore_eos": True, **kw}


def settled(app) -> None:
    """Returns once the engine thread has finished the loop turn that answered the last request: its
    gauges (pages in use, ...) are refreshed after the answers are handed out, so a client can see its
    answer a moment before /metrics reflects the pages it freed. A no-op command runs only between turns."""
    asyncio.run(app[1].loop.call(lambda engine: None))


def metric(app, name: str, **labels) -> float:
    settled(app)
    text = run(app, ("GET", "/metrics", None))[0].text
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


def test_full_queue_is_429_with_retry_after(app):
    state = app[1]
    assert state.limits.capacity == 4  # max_num_seqs 2 + max_queued_requests 2
    assert state.loop.try_reserve(3, state.limits.capacity)  # three generations in flight elsewhere
    try:
        full, = run(app, ("POST", "/v1/completions", body(n=2)))
        one, = run(app, ("POST", "/v1/completions", body()))  # the last place
    finally:
        state.loop.release(3)
    assert full.status_code == 429, full.text
    assert full.headers["retry-after"] == "1" and full.json()["error"]["code"] == "queue_full"
    assert one.status_code == 200 and one.json()["usage"]["completion_tokens"] == 4
    assert state.loop.num_inflight == 0
    assert metric(app, "jaxkv_requests_rejected_total", reason="queue_full") >= 1


def test_request_past_its_deadline_is_408_and_frees_its_pages(app):
    state = app[1]
    state.limits.request_timeout = 1e-9  # the deadline has passed before the first token can arrive
    try:
        plain, streamed, = run(app, ("POST", "/v1/completions", body(max_tokens=112)),
                               ("POST", "/v1/completions", body(max_tokens=112, stream=True)))
    finally:
        state.limits.request_timeout = None
    assert plain.status_code == 408 and plain.json()["error"]["code"] == "request_timeout"
    assert streamed.status_code == 200  # headers went out first: the error is the last event
    events = [e for e in streamed.text.split("\n\n") if e]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_timeout"
    assert events[-1] == "data: [DONE]"
    ok, = run(app, ("POST", "/v1/completions", body()))
    assert ok.status_code == 200
    # An engine that finished a request before the abort reached its thread (a loaded machine can stall the
    # event loop for the ~50 ms that 112 tokens of the tiny model take) counts no abort for it.
    assert 1 <= metric(app, "jaxkv_requests_aborted_total", reason="timeout") <= 2
    assert metric(app, "jaxkv_kv_pages_in_use") == 0 and state.loop.num_inflight == 0


def test_engine_step_failure_fails_only_its_request(app):
    state = app[1]
    # A default that slipped past every API check: int32 overflow while the engine builds the step.
    state.sampling_defaults = {"top_k": 2**31}
    try:
        bad, bad_stream, health, good = run(
            app, ("POST", "/v1/completions", body()), ("POST", "/v1/completions", body(stream=True)),
            ("GET", "/health", None), ("POST", "/v1/completions", body(top_k=5)))
    finally:
        state.sampling_defaults = {}
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["code"] == "engine_error" and "OverflowError" in err["message"]
    assert '"code": "engine_error"' in bad_stream.text and bad_stream.text.endswith("data: [DONE]\n\n")
    assert health.json() == {"status": "ok"}
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 4
    assert state.loop.failed_steps == 2 and state.loop.alive
    assert metric(app, "jaxkv_kv_pages_in_use") == 0 and state.loop.num_inflight == 0
