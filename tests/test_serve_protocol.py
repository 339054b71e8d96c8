"""Fast in-process tests of the server's request validation and streamed detokenization."""

from __future__ import annotations

import pytest

from jaxkv.engine.detok import TextStream
from jaxkv.serve import protocol as P


def byte_decode(ids) -> str:
    """A byte-level 'tokenizer': token id = one UTF-8 byte (multi-byte characters span tokens)."""
    return bytes(ids).decode("utf-8", errors="replace")


def stream_all(text: str, stop=(), chunk: int = 1):
    ids = list(text.encode())
    ts = TextStream(byte_decode, [], stop)
    pieces = []
    for i in range(0, len(ids), chunk):
        ts.add(ids[i:i + chunk], final=i + chunk >= len(ids))
        pieces.append(ts.take(final=i + chunk >= len(ids)))
        if ts.stopped:
            break
    return ts, pieces


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_text_stream_multibyte_never_emits_broken_characters(chunk):
    text = "héllo wörld ✓ 🎉 end"
    ts, pieces = stream_all(text, chunk=chunk)
    assert "".join(pieces) == ts.text == text
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_stop_string_split_over_tokens_is_never_sent():
    ts, pieces = stream_all("one two STOP three", stop=["STOP", "xyz"])
    assert ts.stopped and ts.text == "one two "
    assert "".join(pieces) == "one two "
    assert not any("S" in p for p in pieces)


def test_text_stream_earliest_of_several_stops():
    ts, _ = stream_all("abc def ghi", stop=["ghi", "def"], chunk=4)
    assert ts.text == "abc "


def test_text_stream_keeps_leading_space_via_prompt_context():
    # SentencePiece-style decoding drops the leading space of the first piece; the new text must still
    # start with " world" after the prompt "hello".
    words = ["▁hello", "▁world", "▁again"]
    decode = lambda ids: "".join(words[i] for i in ids).replace("▁", " ").removeprefix(" ")
    ts = TextStream(decode, [0], ())
    ts.add([1])
    ts.add([2], final=True)
    assert ts.take(final=True) == " world again"


def test_parse_errors_name_the_parameter():
    with pytest.raises(P.RequestError, match="Malformed JSON"):
        P.parse(P.CompletionRequest, b"{")
    with pytest.raises(P.RequestError) as e:
        P.parse(P.CompletionRequest, b'{"model": "m", "prompt": "x", "top_k": "3"}')
    assert e.value.param == "top_k" and e.value.status == 400
    with pytest.raises(P.RequestError) as e:
        P.parse(P.ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": 1}]}')
    assert e.value.param == "messages[0].content"
    body = b'{"model": "m", "prompt": [1, 2], "unknown_field": 1, "temperature": 1}'
    req = P.parse(P.CompletionRequest, body)
    assert req.prompt == [1, 2] and req.temperature == 1.0


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("temperature", 2.5), ("top_p", 0.0),
                                         ("top_p", 1.01), ("top_k", -1), ("n", 0), ("n", 1000),
                                         ("presence_penalty", 0.5), ("stop", [""]), ("top_k", 2**31),
                                         ("seed", 2**64), ("seed", -(2**63) - 1), ("stop", "x" * 513),
                                         ("stop", ["a"] * 17), ("stop_token_ids", [1] * 257),
                                         ("cache_salt", "")])
def test_check_common_rejects(field, value):
    req = P.CompletionRequest.model_validate({"model": "m", "prompt": "x", field: value})
    with pytest.raises(P.RequestError) as e:
        P.check_common(req)
    assert e.value.param == field


def test_resolve_max_tokens():
    assert P.resolve_max_tokens(None, False, 10, 100) == 90  # chat default: the rest of the context
    assert P.resolve_max_tokens(16, False, 95, 100) == 5  # implicit completions default is clamped
    assert P.resolve_max_tokens(16, True, 10, 100) == 16
    with pytest.raises(P.RequestError, match="maximum context length") as e:
        P.resolve_max_tokens(91, True, 10, 100)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(P.RequestError) as e:
        P.resolve_max_tokens(1, True, 100, 100, prompt_param="messages")
    assert e.value.param == "messages"
    with pytest.raises(P.RequestError):
        P.resolve_max_tokens(0, True, 1, 100)


def test_engine_seed_is_valid_and_distinct_per_choice():
    assert P.engine_seed(None, 3) is None
    seeds = [P.engine_seed(-5, i) for i in range(3)]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)
