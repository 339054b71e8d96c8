"""Segment tiers over HTTP: a real `python -m jaxkv.serve` whose KV pool cannot hold every registered
segment beside a request, driven with the official `openai` client. Segments move to host memory and
back, answers stay the same, and the /v1/segments cards and /metrics show where each segment is."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

from jaxkv.serve.launch import ServerProcess

SEG = 16  # tokens per segment: 4 pages per (layer, KV head) at page size 4; 16 pages per segment (2 x 2)
PER_SEGMENT = 2 * 2 * SEG * (2 * 16 * 4 + 4)  # bytes: layers x KV heads x slots x (K + V + position)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve_tiers") / "tiny-llama")
    # 112 pages: every segment, or three of them beside a request over three, never both.
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", "64", "--page-size", "4",
                       "--num-pages", "112", "--max-num-seqs", "2", "--max-step-tokens", "64",
                       "--head-classes", "global", "--no-precompile",
                       "--segment-host-bytes", str(2 * PER_SEGMENT + 100)])
    yield s
    s.stop()


def client(s: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=180)


def register(s, tokens, **body) -> dict:
    return client(s).post("/segments", body={"tokens": tokens, **body}, cast_to=dict)


def ask(s, segments) -> str:
    reuse = {"segments": segments, "method": "naive", "prefix": [1, 5, 6]}
    r = client(s).completions.create(model=s.name, prompt=[9, 10, 11], max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True, "reuse": reuse})
    assert r.usage.completion_tokens == 4
    return r.choices[0].text


def cards(s) -> dict:
    return {c["id"]: c for c in client(s).get("/segments", cast_to=dict)["data"]}


def test_segments_move_between_tiers_and_cards_show_it(server):
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 300, SEG).tolist() for _ in range(7)]
    ids = [register(server, d)["id"] for d in docs[:4]]
    first = ask(server, ids[:2])  # every segment fits on the device beside this request
    assert all(c["tiers"] == ["device"] and c["bytes"]["device"] == PER_SEGMENT
               for c in cards(server).values())
    ask(server, ids[1:4])  # three segments and their request: the least recently used one leaves
    card = cards(server)[ids[0]]
    assert card["tiers"] == ["host"] and card["bytes"] == {"device": 0, "host": PER_SEGMENT, "store": 0}
    assert ask(server, ids[:2]) == first  # promoted back from host memory: the same answer
    assert cards(server)[ids[0]]["tiers"][0] == "device"
    assert server.metric("jaxkv_segment_promotions_total") >= 1
    assert server.metric("jaxkv_segment_demotions_total") >= 1
    assert server.metric("jaxkv_segment_bytes_moved_total", direction="demote") >= PER_SEGMENT
    assert server.metric("jaxkv_segment_bytes_moved_total", direction="promote") >= PER_SEGMENT
    assert server.metric("jaxkv_segment_bytes", tier="host") >= PER_SEGMENT
    assert server.metric("jaxkv_segment_bytes", tier="store") == 0

    # A frozen segment pinned to host memory lives there; its card says so.
    pinned = register(server, docs[4], frozen=True, tier="host")
    assert pinned["tiers"] == ["host"] and pinned["tier_pin"] == "host"
    register(server, docs[5], frozen=True, tier="host")
    # Without a store a frozen segment is never dropped: past the host budget one is refused clearly.
    with pytest.raises(openai.APIStatusError) as err:
        register(server, docs[6], frozen=True, tier="host")
    assert err.value.status_code == 507 and "--segment-host-bytes" in err.value.message
    with pytest.raises(openai.BadRequestError, match="frozen"):
        register(server, docs[6], tier="host")
    assert ids[0] in cards(server)  # an ordinary segment another tier held whole was kept


def test_host_bytes_flag():
    from jaxkv.serve.__main__ import parse_args

    assert parse_args(["--segment-host-bytes", "512M"]).segment_host_bytes == 512 << 20
    assert parse_args(["--segment-host-bytes", "4GiB"]).segment_host_bytes == 4 << 30
    assert parse_args(["--segment-host-bytes", "0"]).segment_host_bytes == 0
    with pytest.raises(SystemExit):
        parse_args(["--segment-host-bytes", "lots"])
