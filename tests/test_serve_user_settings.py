"""No setting a user chooses turns into a 500: request fields through the official `openai` client, and
startup flags of `python -m jaxkv.serve` (real server subprocesses, no mocks).

Every request of the grid below (odd-but-legal and illegal values) is answered 2xx, or 4xx with a message;
a stream ends normally. Startup sizes with which no request could be answered are refused before serving,
with a message naming the flag; small but workable ones serve.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

from jaxkv.serve.launch import REPO, ServerProcess

MAX_MODEL_LEN = 64
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("settings") / "tiny-llama")
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN), "--page-size",
                       str(PAGE_SIZE), "--num-pages", "256", "--max-num-seqs", "4", "--max-step-tokens", "16",
                       "--head-classes", "global", "--no-precompile"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def segment(server):
    """A 20-token segment: placed after a short chat prefix it starts on a page boundary, so the prompt's
    page-aligned layout takes more of the context than its token count."""
    r = httpx.post(server.url + "/segments", json={"tokens": list(range(10, 30))}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)


USER = [{"role": "user", "content": "hello there"}]
CHAT = [
    dict(temperature=0), dict(temperature=2), dict(temperature=2.5), dict(temperature=-1),
    dict(top_p=0), dict(top_p=1e-9), dict(top_p=1), dict(top_p=1.5),
    dict(n=16, max_tokens=2), dict(n=17, max_tokens=2), dict(n=1000, max_tokens=2), dict(n=0),
    dict(max_tokens=1), dict(max_tokens=0), dict(max_tokens=-5), dict(max_tokens=10**9),
    dict(max_completion_tokens=3), dict(max_tokens=3, max_completion_tokens=4),
    dict(stop=[]), dict(stop=""), dict(stop=[""]), dict(stop=["a"] * 16), dict(stop=["a"] * 17),
    dict(stop="x" * 513), dict(stop=[" ", "e", "the"]),
    dict(logprobs=True), dict(logprobs=True, top_logprobs=0), dict(logprobs=True, top_logprobs=5),
    dict(logprobs=False, top_logprobs=2), dict(logprobs=True, stream=True),
    dict(seed=-1), dict(seed=2**64), dict(seed=2**63 - 1),
    dict(presence_penalty=0.5), dict(frequency_penalty=0), dict(logit_bias={"5": 10}),
    dict(response_format={"type": "json_object"}), dict(user="someone"),
    dict(stream=True, n=3, max_tokens=4), dict(stream=True, stream_options={"include_usage": True}),
    dict(messages=[]), dict(messages=[{"role": "user", "content": ""}]),
    dict(messages=[{"role": "user", "content": []}]), dict(messages=[{"role": "system", "content": "hi"}]),
    dict(messages=[{"role": "robot", "content": "hi"}]),
    dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    dict(messages=[{"role": "user", "content": "word " * 200_000}]),
    dict(messages=[{"role": "user", "content": [{"type": "segment", "id": "seg-unknown"}]}]),
    dict(extra_body={"top_k": -1}), dict(extra_body={"top_k": 2**31}), dict(extra_body={"top_k": 1}),
    dict(extra_body={"ignore_eos": True}, max_tokens=1), dict(extra_body={"stop_token_ids": [-1]}),
    dict(extra_body={"stop_token_ids": [10**9]}), dict(extra_body={"stop_token_ids": list(range(300))}),
    dict(extra_body={"kv_policy": "nope"}), dict(extra_body={"kv_policy": {"name": "snapkv", "budget": 0}}),
    dict(extra_body={"kv_policy": {"name": "snapkv", "budget": 10**9}}),
    dict(extra_body={"kv_policy": "streaming_llm"}), dict(extra_body={"cache_salt": ""}),
    dict(extra_body={"reuse": {"method": "nope"}}),
]
COMPLETIONS = [
    dict(prompt="The king"), dict(prompt=""), dict(prompt=[]), dict(prompt=[[]]), dict(prompt=[10**9]),
    dict(prompt=[-1]), dict(prompt=["a", "b", "c"], n=2, max_tokens=3), dict(prompt=[1] * 100_000),
    dict(prompt="x", max_tokens=None), dict(prompt="x", echo=True), dict(prompt="x", echo=True, logprobs=0),
    dict(prompt="x", logprobs=0), dict(prompt="x", logprobs=5), dict(prompt="x", suffix="y"),
    dict(prompt="x", best_of=2), dict(prompt="x", n=2, best_of=2, max_tokens=2),
    dict(prompt="x", stream=True, logprobs=0), dict(prompt="x", stop=["\n"] * 3, temperature=0.01),
    dict(prompt="x", extra_body={"reuse": {"segments": ["seg-unknown"]}}),
    dict(prompt="x", extra_body={"reuse": {"segments": []}}),
    dict(prompt="x", extra_body={"reuse": {"segments": ["seg-unknown"]}, "kv_policy": "snapkv"}),
]


def _answer(call) -> int:
    """The status of one request: 200 when it (and its stream) completed, else the error's 4xx status;
    fails on a 5xx or an error without a message."""
    try:
        r = call()
        if isinstance(r, openai.Stream):
            assert list(r), "an empty stream"
        return 200
    except openai.APIStatusError as e:
        assert e.status_code < 500, f"{e.status_code}: {e.message}"
        assert e.message and e.body and e.body.get("message"), e.body
        return e.status_code
    except openai.APIError as e:  # an error event inside a stream
        pytest.fail(f"stream ended with an error event: {e.message} {e.body}")


@pytest.mark.parametrize("kw", CHAT, ids=[repr(k)[:80] for k in CHAT])
def test_chat_settings_never_answer_5xx(server, kw):
    kw = {"messages": USER, "max_tokens": 8, **kw}
    _answer(lambda: _client(server).chat.completions.create(model=server.name, **kw))


@pytest.mark.parametrize("kw", COMPLETIONS, ids=[repr(k)[:80] for k in COMPLETIONS])
def test_completion_settings_never_answer_5xx(server, kw):
    kw = {"max_tokens": 8, **kw}
    _answer(lambda: _client(server).completions.create(model=server.name, **kw))


def test_engine_is_clean_after_the_grid(server):
    """Whatever the grid did, no request is left holding pages or counted as an engine failure."""
    assert server.metric("jaxkv_http_request_errors_total", status="500") == 0
    assert server.metric("jaxkv_kv_pages_in_use") == 0
    assert httpx.get(server.base + "/health").json()["status"] == "ok"


def _segment_chat(seg: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "read"}, {"type": "segment", "id": seg},
                                         {"type": "text", "text": "now"}]}]


def test_chat_with_a_segment_and_no_max_tokens_fits_the_layout(server, segment):
    """Chat's default max_tokens is the rest of the context; with page-aligned segments the layout takes
    more than the prompt's tokens, and the default is clamped to what it leaves (before: a 400). An explicit
    max_tokens of exactly that fits; one more is a 400 naming max_tokens."""
    c = _client(server)

    def chat(**kw):
        return c.chat.completions.create(model=server.name, messages=_segment_chat(segment), temperature=0,
                                         extra_body={"reuse": {"method": "naive"}, "ignore_eos": True}, **kw)

    r = chat()
    room = r.usage.completion_tokens
    assert r.choices[0].finish_reason == "length" and room >= 1
    assert room < MAX_MODEL_LEN - r.usage.prompt_tokens  # the layout's padding matters in this setup
    assert chat(max_tokens=room).usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError) as err:
        chat(max_tokens=room + 1)
    assert err.value.body["param"] == "max_tokens"
    assert "page boundaries" in err.value.message
    assert f"room for {room} completion tokens" in err.value.message


def test_documented_precompile_example_answers_chat_without_max_tokens():
    """`--precompile --max-model-len 64 --max-num-seqs 1 --max-step-tokens 8` on the embedded model (windowed
    heads): a chat request's default max_tokens makes multi-step decode calls longer than a step."""
    s = ServerProcess(["--model", "synthetic", "--max-model-len", "64", "--max-num-seqs", "1",
                       "--max-step-tokens", "8", "--precompile"])
    try:
        c = _client(s)
        for _ in range(2):
            r = c.chat.completions.create(model=s.name, messages=USER, extra_body={"ignore_eos": True})
            assert r.usage.prompt_tokens + r.usage.completion_tokens == 64
        assert s.metric("jaxkv_http_request_errors_total") == 0
    finally:
        s.stop()


@pytest.mark.parametrize("flags, names", [
    (["--max-model-len", "1"], "--max-model-len"),
    (["--num-pages", "1"], "--num-pages"),
    (["--max-step-tokens", "0"], "--max-step-tokens"),
])
def test_sizes_no_request_fits_are_refused_at_startup(flags, names):
    r = subprocess.run([sys.executable, "-m", "jaxkv.serve", "--model", "synthetic", "--port", "0", *flags],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    assert names in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_tiny_context_and_pool_still_serve():
    """The smallest workable sizes start (the warm-up request fits them) and answer."""
    s = ServerProcess(["--model", "synthetic", "--max-model-len", "4", "--num-pages", "32"])
    try:
        r = _client(s).completions.create(model=s.name, prompt=[5, 6], max_tokens=2,
                                          extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
    finally:
        s.stop()
