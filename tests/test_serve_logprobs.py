"""OpenAI logprobs over HTTP: top alternatives (completions `logprobs: k`, chat `top_logprobs: k`) and echoed
prompt logprobs (`echo` + `logprobs`, `max_tokens: 0`), against a real `python -m jaxkv.serve` subprocess on a
tiny random checkpoint, driven with the official `openai` client. Every number is checked against the
log-softmax of a dense forward of the same model (`jaxkv.load(...).logits`), streamed against non-streamed,
under a compression policy (snapkv) and with segment reuse. No mocks.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

import jaxkv
from jaxkv.serve.launch import ServerProcess
from jaxkv.tokenizer import Tokenizer

MAX_MODEL_LEN = 256
TOL = 2e-4  # the float32 engine (paged attention, chunked prefill) against a dense float64 log-softmax
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve_lp") / "tiny-llama")


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    return jaxkv.load(ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    # Steps of 32 tokens: a 100-token prompt prefills in 4 chunks whose prompt logprobs must join up.
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "512",
                       "--max-num-seqs", "4", "--max-step-tokens", "32", "--head-classes", "global",
                       "--no-precompile"])
    yield s
    s.stop()


def client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=300)


def log_softmax(model, ids) -> np.ndarray:
    """[T, V] float64 log-probabilities of the token after each position (dense forward)."""
    x = np.asarray(model.logits(ids)[0], np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def greedy_reference(model, prompt, n):
    """The greedy continuation of `prompt` and the log-softmax rows that chose each of its tokens."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(log_softmax(model, ids)[-1])))
    return ids[len(prompt):], log_softmax(model, ids)[len(prompt) - 1:-1]


def prompt_ids(model, n, seed=0):
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, size=n).tolist()


def stream_pieces(chunks):
    """Every streamed choice-0 logprobs object (none for chunks that carry none)."""
    return [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs is not None]


# -------------------------------------------------------------------------------------- alternatives


def test_completions_top_logprobs_match_dense_reference(server, model, tok):
    prompt = prompt_ids(model, 40)
    c = client(server)
    r = c.completions.create(model=server.name, prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                             extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    ref_ids, ref = greedy_reference(model, prompt, 6)
    assert lp.tokens == [tok.decode([t]) for t in ref_ids]
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, (top, value) in enumerate(zip(lp.top_logprobs, lp.token_logprobs)):
        assert abs(value - ref[i, ref_ids[i]]) < TOL
        values = list(top.values())
        assert 1 <= len(top) <= 6 and values == sorted(values, reverse=True)  # OpenAI: up to logprobs + 1
        assert lp.tokens[i] in top and abs(top[lp.tokens[i]] - value) < 1e-6  # greedy: the token is the best
        assert abs(max(values) - value) < 1e-6
        best5 = np.sort(ref[i])[::-1][:5]
        assert all(np.min(np.abs(best5 - v)) < TOL for v in values)  # each one is one of the 5 most likely
    assert sum(lp.token_logprobs) <= 0
    streamed = stream_pieces(c.completions.create(model=server.name, prompt=prompt, max_tokens=6,
                                                  temperature=0, logprobs=5, stream=True,
                                                  extra_body=IGNORE_EOS))
    assert sum((p.tokens for p in streamed), []) == lp.tokens
    assert sum((p.token_logprobs for p in streamed), []) == lp.token_logprobs
    assert sum((p.top_logprobs for p in streamed), []) == lp.top_logprobs
    assert sum((p.text_offset for p in streamed), []) == lp.text_offset


def test_chat_top_logprobs_match_dense_reference(server, model, tok):
    messages = [{"role": "user", "content": "the river and the king"}]
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    c = client(server)
    r = c.chat.completions.create(model=server.name, messages=messages, max_tokens=5, temperature=0,
                                  logprobs=True, top_logprobs=20, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    ref_ids, ref = greedy_reference(model, prompt, 5)
    assert len(content) == 5
    for i, item in enumerate(content):
        assert item.token == tok.decode([ref_ids[i]]) and item.bytes == list(item.token.encode())
        assert abs(item.logprob - ref[i, ref_ids[i]]) < TOL
        alts = item.top_logprobs
        assert len(alts) == 20
        values = [a.logprob for a in alts]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(ref[i])[::-1][:20], atol=TOL)
        assert alts[0].token == item.token and abs(alts[0].logprob - item.logprob) < 1e-6
        assert all(a.bytes == list(a.token.encode()) for a in alts)
    streamed = stream_pieces(c.chat.completions.create(
        model=server.name, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=20,
        stream=True, extra_body=IGNORE_EOS))
    assert [x.model_dump() for p in streamed for x in p.content] == [x.model_dump() for x in content]


def test_sampled_tokens_have_their_logprob_among_alternatives(server, model):
    """Temperature 1 with a seed: a sampled token need not be the best, but when it is among the
    alternatives its logprob is one of theirs (token texts may repeat: byte tokens all read as U+FFFD);
    alternatives stay sorted (multi-step decode)."""
    c = client(server)
    r = c.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "water music"}],
                                  max_tokens=12, temperature=1.0, seed=7, logprobs=True, top_logprobs=3,
                                  extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 12
    for item in content:
        values = [a.logprob for a in item.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert item.logprob < values[-1] - 1e-6 or np.min(np.abs(np.array(values) - item.logprob)) < 1e-6


# ------------------------------------------------------------------------------------ prompt logprobs


def check_prompt_logprobs(lp, prompt, ref, tok, k):
    n = len(prompt)
    assert lp.tokens[:n] == [tok.decode([t]) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    got = np.array(lp.token_logprobs[1:n])
    np.testing.assert_allclose(got, [ref[j - 1, prompt[j]] for j in range(1, n)], atol=TOL)
    assert got.sum() <= 0
    for j in range(1, n):
        values = list(lp.top_logprobs[j].values())
        assert values == sorted(values, reverse=True)
        best = np.sort(ref[j - 1])[::-1][:k]
        assert abs(max(values) - max(best[0], lp.token_logprobs[j])) < TOL
        assert all(np.min(np.abs(np.append(best, lp.token_logprobs[j]) - v)) < TOL for v in values)
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))


def test_echo_prompt_logprobs_max_tokens_0(server, model, tok):
    """lm-eval's loglikelihood request shape with max_tokens 0: the prompt alone, its first token without a
    logprob; a 100-token prompt prefills in chunks; the same prompt again is not served by the prefix cache
    (cached pages have no logits) and gives the same numbers."""
    prompt = prompt_ids(model, 100, seed=1)
    ref = log_softmax(model, prompt)
    c = client(server)
    first = None
    for _ in range(2):
        r = c.completions.create(model=server.name, prompt=prompt, max_tokens=0, echo=True, logprobs=3,
                                 temperature=0)
        ch = r.choices[0]
        assert ch.text == tok.decode(prompt) and ch.finish_reason == "length"
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 100
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert len(ch.logprobs.tokens) == 100
        check_prompt_logprobs(ch.logprobs, prompt, ref, tok, 3)
        if first is not None:
            assert ch.logprobs.token_logprobs == first
        first = ch.logprobs.token_logprobs
    streamed = stream_pieces(c.completions.create(model=server.name, prompt=prompt, max_tokens=0, echo=True,
                                                  logprobs=3, temperature=0, stream=True))
    assert sum((p.token_logprobs for p in streamed), []) == first


def test_echo_then_completion(server, model, tok):
    """echo + logprobs with generated tokens: the prompt's entries, then the completion's, one text_offset
    scale; streamed equals non-streamed; text is prompt + completion."""
    prompt = prompt_ids(model, 20, seed=2)
    c = client(server)
    r = c.completions.create(model=server.name, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                             temperature=0, extra_body=IGNORE_EOS)
    ch = r.choices[0]
    lp = ch.logprobs
    ref_ids, ref_gen = greedy_reference(model, prompt, 4)
    assert len(lp.tokens) == 24 and r.usage.completion_tokens == 4
    check_prompt_logprobs(lp, prompt, log_softmax(model, prompt), tok, 2)
    np.testing.assert_allclose(lp.token_logprobs[20:], [ref_gen[i, t] for i, t in enumerate(ref_ids)],
                               atol=TOL)
    assert ch.text == tok.decode(prompt) + tok.decode(ref_ids)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(24)]
    streamed = stream_pieces(c.completions.create(model=server.name, prompt=prompt, max_tokens=4, echo=True,
                                                  logprobs=2, temperature=0, stream=True,
                                                  extra_body=IGNORE_EOS))
    assert sum((p.tokens for p in streamed), []) == lp.tokens
    assert sum((p.token_logprobs for p in streamed), []) == lp.token_logprobs
    assert sum((p.top_logprobs for p in streamed), []) == lp.top_logprobs
    assert sum((p.text_offset for p in streamed), []) == lp.text_offset


def test_lm_eval_loglikelihood_batch(server, model):
    """What lm-eval's `local-completions` sends for loglikelihood: a batch of token lists, echo, logprobs 1,
    max_tokens 1, temperature 0; per choice (by index) the continuation's logprob sum and greediness."""
    ctx = prompt_ids(model, 12, seed=3)
    ref = log_softmax(model, ctx + [int(np.argmax(log_softmax(model, ctx)[-1]))])
    greedy_cont = [int(np.argmax(ref[-1]))]
    conts = [greedy_cont, [int(np.argsort(ref[len(ctx) - 1])[-2])]]  # the best next token, then the 2nd
    prompts = [ctx + cont for cont in conts]
    r = httpx.post(f"{server.url}/completions", timeout=300, json={
        "model": server.name, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True}).json()
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, prompt in zip(choices, prompts):
        lps = choice["logprobs"]
        assert len(lps["token_logprobs"]) == len(prompt) + 1
        cont_lp = lps["token_logprobs"][len(ctx):-1]
        ref_p = log_softmax(model, prompt)
        assert abs(sum(cont_lp) - ref_p[len(ctx) - 1, prompt[-1]]) < TOL
        greedy = all(t == max(top.values()) for t, top in zip(cont_lp, lps["top_logprobs"][len(ctx):-1]))
        assert greedy == (prompt[-1] == int(np.argmax(ref_p[len(ctx) - 1])))
    assert [c["index"] for c in choices] == [0, 1]


# ------------------------------------------------------------------------------- presses and reuse


def test_prompt_logprobs_under_snapkv_are_full_cache(server, model, tok):
    """A compression policy evicts after the prefill: the prompt logprobs are those of the full cache (equal
    to the dense reference), while generation runs on the compressed cache; alternatives stay consistent."""
    prompt = prompt_ids(model, 120, seed=4)
    c = client(server)
    r = c.completions.create(model=server.name, prompt=prompt, max_tokens=5, echo=True, logprobs=4,
                             temperature=0, extra_body={**IGNORE_EOS, "kv_policy": {"name": "snapkv",
                                                                                    "budget": 0.2}})
    lp = r.choices[0].logprobs
    check_prompt_logprobs(lp, prompt, log_softmax(model, prompt), tok, 4)
    for t, v, top in zip(lp.tokens[120:], lp.token_logprobs[120:], lp.top_logprobs[120:]):
        assert v <= 0 and abs(max(top.values()) - v) < 1e-6 and top[t] == v  # greedy on the compressed cache


def test_reuse_gives_alternatives_and_refuses_echo_logprobs(server, model, tok):
    seg = httpx.post(f"{server.url}/segments", timeout=300,
                     json={"tokens": prompt_ids(model, 24, seed=5)}).json()["id"]
    question = prompt_ids(model, 6, seed=6)
    c = client(server)
    body = {**IGNORE_EOS, "reuse": {"segments": [seg], "method": "full", "prefix": [1]}}
    r = c.completions.create(model=server.name, prompt=question, max_tokens=3, temperature=0, logprobs=5,
                             extra_body=body)
    lp = r.choices[0].logprobs
    full = [1] + prompt_ids(model, 24, seed=5) + question
    ref_ids, ref = greedy_reference(model, full, 3)
    assert lp.tokens == [tok.decode([t]) for t in ref_ids]
    for i, top in enumerate(lp.top_logprobs):  # the first token's from the reuse prefill, the rest decode's
        assert abs(max(top.values()) - ref[i].max()) < TOL and abs(top[lp.tokens[i]] - ref[i].max()) < TOL
        best5 = np.sort(ref[i])[::-1][:5]
        assert all(np.min(np.abs(best5 - v)) < TOL for v in top.values())
    bad = httpx.post(f"{server.url}/completions", timeout=60, json={
        "model": server.name, "prompt": question, "echo": True, "logprobs": 1, "max_tokens": 1,
        "reuse": {"segments": [seg]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
    assert "reuse" in bad.json()["error"]["message"]


# ------------------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 2, "kv_policy": {"name": "quest", "budget": 64}},
     "logprobs"),  # a retrieval policy's decode returns the sampled token's logprob only
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_limits_are_400_naming_the_parameter(server, route, body, param):
    r = httpx.post(f"{server.url}/{route}", json={"model": server.name, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_routes(server, tok):
    text = "the river and the king"
    r = httpx.post(f"{server.base}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert httpx.post(f"{server.base}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    info = httpx.get(f"{server.base}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == MAX_MODEL_LEN
    bad = httpx.post(f"{server.base}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
