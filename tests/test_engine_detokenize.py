"""`SamplingParams.detokenize=False`: the engine makes no text (the server detokenizes on its own side),
the tokens are unchanged, and stop strings still stop the request where they match."""

from __future__ import annotations

import pytest
from hf_tiny import make_tiny_checkpoint

import jaxkv
from jaxkv.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("detok") / "tiny")
    return jaxkv.load(ckpt, dtype="float32")


def test_no_text_same_tokens(model):
    prompts = [model.tokenizer.encode("king queen river"), model.tokenizer.encode("music house light dark")]
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    with_text = jaxkv.generate(model, prompts, SamplingParams(**kw))
    without = jaxkv.generate(model, prompts, SamplingParams(**kw, detokenize=False))
    assert all(w.text for w in with_text)
    assert [w.token_ids for w in without] == [w.token_ids for w in with_text]
    assert [w.text for w in without] == ["", ""]
    assert [w.finish_reason for w in without] == ["length", "length"]


def test_stop_strings_keep_the_text(model):
    prompt = [model.tokenizer.encode("king queen river")]
    full = jaxkv.generate(model, prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    word = full.text.split()[len(full.text.split()) // 2]
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[word])
    want = jaxkv.generate(model, prompt, SamplingParams(**kw))[0]
    got = jaxkv.generate(model, prompt, SamplingParams(**kw, detokenize=False))[0]
    assert got.finish_reason == "stop" and got.text == full.text[:full.text.index(word)]
    assert (got.text, got.token_ids) == (want.text, want.token_ids)


def test_detokenize_must_be_a_bool():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")


def test_generate_makes_the_text_the_engine_streams(model):
    """`generate` asks the engine for tokens only and makes each completion's text after its last token: the
    text the engine's stream builds token by token, a stop token (never text) left out."""
    from jaxkv.engine.engine import Engine

    prompts = [model.tokenizer.encode("king queen river"), model.tokenizer.encode("music house light dark")]
    free = jaxkv.generate(model, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stop_id = free[0].token_ids[10]  # stops the first request early, on a token that is never text
    samplings = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]),
                 SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)]
    got = jaxkv.generate(model, prompts, samplings)
    eng = Engine(model, max_num_seqs=2, max_model_len=64)
    ids = [eng.add_request(p, s) for p, s in zip(prompts, samplings)]
    streamed = {}
    while eng.has_unfinished():
        for out in eng.step():
            streamed[out.request_id] = (out.text, out.finish_reason)
    assert got[0].finish_reason == "stop" and got[0].token_ids[-1] == stop_id
    assert got[0].text and got[1].text and got[0].text != got[1].text
    assert [(c.text, c.finish_reason) for c in got] == [streamed[i] for i in ids]
