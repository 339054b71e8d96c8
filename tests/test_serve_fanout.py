"""The server's fan-out under many concurrent streams: a real `python -m jaxkv.serve` subprocess driven by
the official `openai` client, checked against the in-process engine.

The engine thread hands each step's outputs to the event loop in one batch and a lagging stream gets
several steps' tokens as one multi-token delta; whatever the batching, every stream must receive exactly
its own tokens, in order, once, and end with its own usage.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

import jaxkv
from jaxkv.sampling import SamplingParams
from jaxkv.serve.launch import ServerProcess
from jaxkv.tokenizer import Tokenizer

STREAMS = 32
MAX_TOKENS = 40
WORDS = ("river water music film house king queen light dark north south story chapter answer token "
         "cache page window segment layer").split()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve_fanout") / "tiny-llama")


@pytest.fixture(scope="module")
def server(ckpt):
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", "128", "--num-pages", "1600",
                       "--max-num-seqs", str(STREAMS), "--max-step-tokens", "256"])
    yield s
    s.stop()


def prompts(tok: Tokenizer) -> list[list[int]]:
    """One distinct prompt per stream (different lengths too), so a stream given another's tokens shows."""
    out = []
    for i in range(STREAMS):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 5)]
        out.append(tok.encode(" ".join(words)))
    return out


async def stream_one(ac: openai.AsyncOpenAI, name: str, prompt: list[int], slow: bool) -> dict:
    stream = await ac.completions.create(
        model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    text, finishes, usage, events = "", [], None, 0
    async for ch in stream:
        events += 1
        for c in ch.choices:
            assert c.index == 0
            text += c.text
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
        usage = ch.usage or usage
        if slow:  # falls behind the engine: its queue holds several steps when it reads again
            await asyncio.sleep(0.03)
    return {"text": text, "finishes": finishes, "usage": usage, "events": events}


def test_concurrent_streams_each_get_their_own_greedy_tokens(server, ckpt):
    tok = Tokenizer.from_dir(ckpt)
    ps = prompts(tok)

    async def run_all():
        ac = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(stream_one(ac, server.name, p, slow=i % 3 == 0)
                                          for i, p in enumerate(ps)))
        finally:
            await ac.close()

    counts = ("jaxkv_time_to_first_token_seconds_count", "jaxkv_inter_token_latency_seconds_count")
    before = [server.metric(name) for name in counts]
    got = asyncio.run(run_all())
    # a step's tokens of one request are handed over together: still one first token and one
    # inter-token observation per later token, for every stream
    after = [server.metric(name) for name in counts]
    assert [a - b for a, b in zip(after, before)] == [STREAMS, STREAMS * (MAX_TOKENS - 1)]
    model = jaxkv.load(ckpt, dtype="float32")
    want = jaxkv.generate(model, ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                          max_num_seqs=STREAMS, max_model_len=128)
    assert len({w.text for w in want}) > STREAMS // 2, "prompts too alike to tell streams apart"
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(w.token_ids) == MAX_TOKENS
        assert g["text"] == w.text, f"stream {i}"
        assert g["finishes"] == ["length"], f"stream {i}"
        assert g["usage"].completion_tokens == MAX_TOKENS and g["usage"].prompt_tokens == len(ps[i])
    assert server.metric("jaxkv_http_request_errors_total") == 0
    assert server.metric("jaxkv_generation_tokens_total") >= STREAMS * MAX_TOKENS


def test_streamed_chat_events_are_well_formed_json(server):
    """Raw SSE of a streamed chat request (n = 2): each event is one JSON object with OpenAI's chunk keys,
    the role first, then content deltas, one finish per choice, then the usage chunk and [DONE]."""
    body = {"model": server.name, "messages": [{"role": "user", "content": "king queen river"}],
            "max_tokens": 12, "n": 2, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    keys = {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert all(set(c) == keys and c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert [ch["delta"] for ch in chunks[0]["choices"]] == [{"role": "assistant", "content": ""}] * 2
    texts, finishes = ["", ""], [[], []]
    for c in chunks[1:-1]:
        assert c["usage"] is None
        for ch in c["choices"]:
            assert set(ch) == {"index", "delta", "logprobs", "finish_reason"} and ch["logprobs"] is None
            texts[ch["index"]] += ch["delta"].get("content", "")
            if ch["finish_reason"] is not None:
                finishes[ch["index"]].append(ch["finish_reason"])
    assert finishes == [["length"], ["length"]]
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices alike
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24


def test_a_burst_of_tokens_counts_like_one_observation_per_token():
    """The engine thread records a K-token output as one histogram update; buckets and count must equal K
    separate observations (bucket edges included), the sum up to rounding."""
    from jaxkv.serve.metrics import _ITL_BUCKETS, ServeMetrics

    burst, single = ServeMetrics("m"), ServeMetrics("m")
    cases = [(b * f, k) for b in _ITL_BUCKETS for f in (0.5, 1.0, 1.5) for k in (1, 3, 16)] + [(1e9, 2)]
    for seconds_per_token, k in cases:
        burst.observe_tokens(False, seconds_per_token * k, k)
        for _ in range(k):  # the client library's own observation, of the float the burst's division gives
            single.itl.labels("m").observe(seconds_per_token * k / k)
            single.generation_tokens.labels("m").inc()

    def samples(m):
        out = {}
        for line in m.render().decode().splitlines():
            if line.startswith(("jaxkv_inter_token_latency_seconds", "jaxkv_generation_tokens")):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    a, b = samples(burst), samples(single)
    assert a.keys() == b.keys()
    for key in a:
        if "_created" in key:
            continue
        assert a[key] == pytest.approx(b[key], rel=1e-9), key
    assert a['jaxkv_inter_token_latency_seconds_count{model_name="m"}'] == sum(k for _, k in cases)


def test_stop_strings_cut_each_concurrent_stream_at_its_own_match(server, ckpt):
    """The server, not the engine thread, turns a plain stream's ids into text: streams with stop strings
    (each its own, taken from the middle of its greedy text) end there with finish 'stop', the text cut
    before the match; the streams beside them without stop strings run to max_tokens untouched."""
    tok = Tokenizer.from_dir(ckpt)
    ps = prompts(tok)
    model = jaxkv.load(ckpt, dtype="float32")
    want = jaxkv.generate(model, ps, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                          max_num_seqs=STREAMS, max_model_len=128)
    stops = {}
    for i, w in enumerate(want):
        word = w.text.split()[len(w.text.split()) // 2] if i % 2 == 0 and len(w.text.split()) > 2 else None
        if word is not None:
            stops[i] = word
    assert len(stops) > STREAMS // 4

    async def one(ac, i):
        kw = {"stop": [stops[i]]} if i in stops else {}
        stream = await ac.completions.create(model=server.name, prompt=ps[i], max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True},
                                             **kw)
        text, finish = "", []
        async for ch in stream:
            for c in ch.choices:
                text += c.text
                if c.finish_reason is not None:
                    finish.append(c.finish_reason)
        return text, finish

    async def run_all():
        ac = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(one(ac, i) for i in range(STREAMS)))
        finally:
            await ac.close()

    got = asyncio.run(run_all())
    for i, ((text, finish), w) in enumerate(zip(got, want)):
        if i in stops:
            assert text == w.text[:w.text.index(stops[i])], f"stream {i}"
            assert finish == ["stop"], f"stream {i}"
        else:
            assert text == w.text and finish == ["length"], f"stream {i}"


def test_continuous_usage_stats_counts_the_tokens_of_every_chunk(server, ckpt):
    """`stream_options.continuous_usage_stats` (vLLM's): every chunk carries the usage so far, so a client
    can time tokens although one event may carry several; the counts only grow and end at the final
    usage. Without it, chunks before the last carry `usage: null`."""
    tok = Tokenizer.from_dir(ckpt)
    body = {"model": server.name, "prompt": tok.encode("king queen river"), "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == len(body["prompt"]) for c in chunks)
    assert counts == sorted(counts) and counts[-1] == MAX_TOKENS and chunks[-1]["choices"] == []
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert text_chunks and all(c["usage"]["completion_tokens"] > 0 for c in text_chunks)
    want = jaxkv.generate(jaxkv.load(ckpt, dtype="float32"), [body["prompt"]],
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want.text
    text_counts = [c["usage"]["completion_tokens"] for c in text_chunks]
    assert len(set(text_counts)) == len(text_counts)  # a text piece needs at least one new token
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/completions", json=body, timeout=120) as r:
        plain = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line and "[DONE]" not in line]
    assert all(c["usage"] is None for c in plain[:-1])
    assert plain[-1]["usage"]["completion_tokens"] == MAX_TOKENS
