"""End-to-end tests of `python -m jaxkv.serve`: a real server subprocess on a tiny random checkpoint,
driven with the official `openai` client and raw HTTP. No mocks.

One server (module scope) with prefix caching on and a pool too small to run every request at once.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

from jaxkv.serve.launch import ServerProcess
from jaxkv.tokenizer import Tokenizer

MAX_MODEL_LEN = 128
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve") / "tiny-llama")


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    # One server for everything (every new step shape compiles, which dominates CPU test time).
    # Pool: 2 layers x 2 KV heads x ceil(128 / 16) = 32 pages per full-length request; 64 pages hold two,
    # so a burst of long requests must wait or be preempted.
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN), "--page-size", "16",
                       "--num-pages", "64", "--max-num-seqs", "4", "--max-step-tokens", "32"])
    yield s
    s.stop()


def client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)


def aclient(s: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=300)


def wait_for(cond, timeout=20.0, what=""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------------ basic routes


def test_health_models_and_name(server):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    assert server.name == "tiny-llama"  # the directory name
    models = client(server).models.list().data
    assert [m.id for m in models] == ["tiny-llama"]
    assert httpx.get(server.url + "/models/tiny-llama").json()["max_model_len"] == MAX_MODEL_LEN


def test_logprobs_of_generated_tokens(server, ckpt, tok):
    """completions `logprobs: 0` and chat `logprobs: true` (official client, streamed and not): one
    log-probability per generated token, and for greedy decoding the first one equals the log-softmax
    maximum of a dense forward over the prompt."""
    import numpy as np

    import jaxkv

    c = client(server)
    prompt = [5, 17, 33, 9, 71, 2, 44]
    r = c.completions.create(model=server.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
                             extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.completion_tokens == 6
    assert all(v <= 0 for v in lp.token_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text
    logits = jaxkv.load(ckpt).logits(prompt)[0, -1].astype(np.float64)
    best = -np.log(np.exp(logits - logits.max()).sum())  # the log-softmax at the argmax
    assert abs(lp.token_logprobs[0] - best) < 1e-4
    streamed = [ch.choices[0].logprobs for ch in c.completions.create(
        model=server.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=0, stream=True,
        extra_body=IGNORE_EOS) if ch.choices and ch.choices[0].logprobs is not None]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs

    messages = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=server.name, messages=messages, max_tokens=5, temperature=0,
                                  logprobs=True, top_logprobs=0, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(t.logprob <= 0 and t.top_logprobs == [] for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert c.chat.completions.create(model=server.name, messages=messages, max_tokens=2,
                                     extra_body=IGNORE_EOS).choices[0].logprobs is None


def test_chat_completion_usage(server, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    r = client(server).chat.completions.create(model=server.name, messages=messages, max_tokens=5,
                                               extra_body=IGNORE_EOS)
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 5)
    assert r.usage.total_tokens == len(prompt_ids) + 5


def test_completion_greedy_stream_matches_non_stream(server, tok):
    c = client(server)
    kw = dict(model=server.name, prompt="the king and the queen", max_tokens=12, temperature=0,
              extra_body=IGNORE_EOS)
    full = c.completions.create(**kw)
    assert full.object == "text_completion"
    assert full.usage.prompt_tokens == len(tok.encode("the king and the queen"))
    assert full.usage.completion_tokens == 12

    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "length"


def test_chat_stream(server):
    stream = client(server).chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


def test_raw_sse_ends_with_done(server):
    body = {"model": server.name, "prompt": "hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_stop_string_and_token_ids_prompt(server, tok):
    c = client(server)
    ids = tok.encode("water music film")
    kw = dict(model=server.name, prompt=ids, max_tokens=24, temperature=0, extra_body=IGNORE_EOS)
    text = c.completions.create(**kw).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    cut = text[: text.index(stop)]
    r = c.completions.create(**kw, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = list(c.completions.create(**kw, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_seed_echo(server):
    c = client(server)
    kw = dict(model=server.name, prompt="red green", max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body=IGNORE_EOS)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seeded: reproducible
    assert a.usage.completion_tokens == 24
    echo = c.completions.create(model=server.name, prompt="red green", max_tokens=2, echo=True)
    assert echo.choices[0].text.startswith("red green")
    batch = c.completions.create(model=server.name, prompt=["red", "green blue"], max_tokens=2,
                                 extra_body=IGNORE_EOS)
    assert len(batch.choices) == 2 and batch.usage.completion_tokens == 4


def test_32_concurrent_streams(server):
    async def one(ac, i):
        stream = await ac.completions.create(
            model=server.name, prompt=f"story {i} of the river", max_tokens=6, stream=True,
            stream_options={"include_usage": True}, temperature=0.8, seed=i, extra_body=IGNORE_EOS)
        finish, usage = None, None
        async for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
            usage = ch.usage or usage
        return finish, usage.completion_tokens

    async def main():
        ac = aclient(server)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(32)))
        finally:
            await ac.close()

    assert asyncio.run(main()) == [("length", 6)] * 32
    assert server.metric("jaxkv_num_requests_running") == 0
    assert server.metric("jaxkv_time_to_first_token_seconds_count") >= 32


def test_prefix_cache_hit_visible_in_metrics(server):
    c = client(server)
    doc = " ".join(["the cache head page token model layer query key value window"] * 3)
    before = server.metric("jaxkv_prefix_cache_hits")
    r1 = c.completions.create(model=server.name, prompt=doc + " first", max_tokens=2)
    r2 = c.completions.create(model=server.name, prompt=doc + " second", max_tokens=2)
    assert r1.usage.prompt_tokens > 32
    assert server.metric("jaxkv_prefix_cache_hits") > before
    assert 0 < server.metric("jaxkv_prefix_cache_hit_rate") <= 1
    assert r2.usage.prompt_tokens_details.cached_tokens >= 32


def test_metrics_names(server):
    # the latency histograms have series once a request was served (not only when an earlier test sent one)
    client(server).completions.create(model=server.name, prompt="metrics", max_tokens=2)
    text = httpx.get(server.base + "/metrics").text
    for name in ("jaxkv_num_requests_running", "jaxkv_num_requests_waiting", "jaxkv_kv_pages_in_use",
                 "jaxkv_prefix_cache_hit_rate", "jaxkv_time_to_first_token_seconds_bucket",
                 "jaxkv_inter_token_latency_seconds_bucket", 'head_class="global"'):
        assert name in text, name


# ------------------------------------------------------------------------------------ bad input

_LONG = " ".join(["hello world"] * 200)

BAD = [
    ("completions", b"{not json", None),
    ("completions", b"", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"prompt": "hi"}, "model"),
    ("completions", {"model": "M"}, "prompt"),
    ("completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("completions", {"model": "M", "prompt": _LONG}, "prompt"),
    ("completions", {"model": "M", "prompt": "hi", "max_tokens": 127}, "max_tokens"),
    ("completions", {"model": "M", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"model": "M", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": "M", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("completions", {"model": "M", "prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("completions", {"model": "M", "prompt": "hi", "temperature": -0.1}, "temperature"),
    ("completions", {"model": "M", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"model": "M", "prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"model": "M", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"model": "M", "prompt": "hi", "top_k": -1}, "top_k"),
    ("completions", {"model": "M", "prompt": "hi", "n": 0}, "n"),
    ("completions", {"model": "M", "prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"model": "M", "prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"model": "M", "prompt": "hi", "seed": "x"}, "seed"),
    ("completions", {"model": "M", "prompt": "hi", "logprobs": 6}, "logprobs"),
    ("completions", {"model": "M", "prompt": "hi", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("completions", {"model": "M", "prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"model": "M", "prompt": [1, 2, 99999]}, "prompt"),
    ("completions", {"model": "M", "prompt": []}, "prompt"),
    ("completions", {"model": "M", "prompt": {"text": "hi"}}, "prompt"),
    ("completions", {"model": "M", "prompt": "hi", "presence_penalty": 1.0}, "presence_penalty"),
    ("chat/completions", {"model": "M"}, "messages"),
    ("chat/completions", {"model": "M", "messages": []}, "messages"),
    ("chat/completions", {"model": "M", "messages": "hi"}, "messages"),
    ("chat/completions", {"model": "M", "messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("chat/completions", {"model": "M", "messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": _LONG}]}, "messages"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 0},
     "top_logprobs"),
    ("completions", {"model": "M", "prompt": "hi", "logprobs": 2.5, "echo": True}, "logprobs"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
     "tools"),
    ("chat/completions", {"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
     "max_tokens"),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD)])
def test_bad_request_is_400(server, route, body, param):
    if isinstance(body, dict):
        body = {**body, "model": server.name} if body.get("model") == "M" else body
        r = httpx.post(f"{server.url}/{route}", json=body, timeout=30)
    else:
        r = httpx.post(f"{server.url}/{route}", content=body, headers={"content-type": "application/json"},
                       timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err


def test_bad_input_keeps_server_healthy(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=server.name, prompt="hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(server.url + "/nope").status_code == 404
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    assert c.completions.create(model=server.name, prompt="hi", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------------------------------ pool pressure


def test_small_pool_answers_every_request(server):
    async def one(ac, i):
        r = await ac.completions.create(model=server.name, prompt=f"the {i} old house", max_tokens=100,
                                        temperature=0, extra_body=IGNORE_EOS)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    async def main():
        ac = aclient(server)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(6)))
        finally:
            await ac.close()

    # 7 pages x 4 heads per request: at most two of the 64-page pool run at once.
    assert asyncio.run(main()) == [("length", 100)] * 6
    assert server.metric("jaxkv_kv_pages_in_use") == 0


# n=8 choices of ~120 tokens need 8 x 32 pages but the pool holds 64: the request runs for several
# rounds, long enough to be cancelled while it holds pages whatever the speed of the machine.
LONG_REQUEST = {"prompt": "a long story", "max_tokens": 110, "n": 8, "ignore_eos": True}


def test_cancelled_stream_frees_pages(server):
    before = server.metric("jaxkv_request_finished_total", finish_reason="abort")
    body = {"model": server.name, **LONG_REQUEST, "stream": True}
    held = None
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():  # leaving this loop early closes the connection
            assert line != "data: [DONE]", "finished before it could be cancelled"
            if line.startswith("data: "):
                held = server.metric("jaxkv_kv_pages_in_use"), server.metric("jaxkv_num_requests_running")
                break
    assert held[0] > 0 and held[1] >= 1, held
    wait_for(lambda: server.metric("jaxkv_kv_pages_in_use") == 0
             and server.metric("jaxkv_num_requests_running") == 0
             and server.metric("jaxkv_num_requests_waiting") == 0, what="pages to be freed")
    assert server.metric("jaxkv_request_finished_total", finish_reason="abort") > before


def test_disconnected_non_streaming_request_is_aborted(server):
    before = server.metric("jaxkv_request_finished_total", finish_reason="abort")

    async def main():
        async with httpx.AsyncClient(timeout=60) as ac:
            task = asyncio.create_task(ac.post(server.url + "/completions",
                                               json={"model": server.name, **LONG_REQUEST}))
            while server.metric("jaxkv_num_requests_running") == 0:
                assert not task.done(), "finished before it could be cancelled"
                await asyncio.sleep(0.02)
            task.cancel()  # drops the connection

    asyncio.run(main())
    wait_for(lambda: server.metric("jaxkv_request_finished_total", finish_reason="abort") > before,
             what="abort")
    wait_for(lambda: server.metric("jaxkv_kv_pages_in_use") == 0
             and server.metric("jaxkv_num_requests_waiting") == 0, what="pages to be freed")
