"""KV compression policies and segment reuse over HTTP: a real `python -m jaxkv.serve`
subprocess on a tiny random checkpoint with every head global, driven with the official `openai` client
(extensions through `extra_body`) and raw httpx. No mocks.

Two tenants (API keys) share the server; segments one registers are invisible to the other.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hf_tiny import make_tiny_checkpoint

from jaxkv.serve.launch import ServerProcess
from jaxkv.tokenizer import Tokenizer

MAX_MODEL_LEN = 256
KEYS = {"key-a": "team-a", "key-b": "team-b"}
# ~150 tokens: long enough that a 0.25 budget drops most of the prompt's K/V.
PROMPT = " ".join(["the king and the queen of the river water music"] * 6)
DOC = " ".join(["the cache head page token model layer query key value window sink"] * 4)
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("serve_kv") / "tiny-llama")


@pytest.fixture(scope="module")
def tok(ckpt):
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "512",
                       "--max-num-seqs", "4", "--max-step-tokens", "64", "--head-classes", "global",
                       "--api-keys-file", str(keys), "--no-precompile", "--precompile-reuse", "redknot"])
    yield s
    s.stop()


def client(s: ServerProcess, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url, api_key=key, max_retries=0, timeout=180)


def complete(s, key="key-a", prompt=PROMPT, **extra) -> str:
    r = client(s, key).completions.create(model=s.name, prompt=prompt, **GREEDY,
                                          extra_body={"ignore_eos": True, **extra})
    assert r.usage.completion_tokens == GREEDY["max_tokens"]
    return r.choices[0].text


def http(s, method: str, route: str, key: str | None = "key-a", **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{s.url}/{route}", headers=headers, timeout=180, **kw)


def register(s, key="key-a", **body) -> str:
    r = http(s, "POST", "segments", key, json=body)
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["object"] == "segment" and card["id"].startswith("seg-") and card["num_tokens"] > 0
    return card["id"]


# ------------------------------------------------------------------------------------ KV policies


def test_server_default_policy_is_visible(server):
    models = http(server, "GET", "models").json()["data"]
    assert models[0]["kv_policy"] is None  # started without --kv-policy: the full cache
    info = httpx.get(server.base + "/info").json()
    assert info["kv_policy"] is None and info["segment_reuse"] is True
    assert {"snapkv", "hardkv", "specontext", "quest"} <= set(info["kv_policies"])
    assert set(info["reuse_methods"]) == {"naive", "epic", "cacheblend", "sparsex", "redknot", "full"}
    assert info["precompiled_reuse_passes"] == {"redknot": 1}   # --precompile-reuse: its one bucket (256)


def test_per_request_policy_compresses_and_a_large_budget_equals_full(server):
    before = (server.metric("jaxkv_kv_compressions_total"),
              server.metric("jaxkv_kv_pages_freed_by_compression_total"))
    full = complete(server)
    assert complete(server, kv_policy=None) == full  # explicit null: the full cache
    # A budget beyond the prompt keeps every token: greedy output equals the full cache's.
    assert complete(server, kv_policy={"name": "snapkv", "budget": 10_000}) == full
    assert server.metric("jaxkv_kv_compressions_total") == before[0]  # nothing to compress there
    small = complete(server, kv_policy={"name": "snapkv", "budget": 0.25, "window": 8})
    assert small != full  # a quarter of the prompt's K/V: a different (random) model output
    assert complete(server, kv_policy="streaming_llm")  # a bare name: the policy's default budget
    assert complete(server, kv_policy={"name": "hardkv", "merge": False})  # no bias here: without merging
    assert server.metric("jaxkv_kv_compressions_total") >= before[0] + 2
    assert server.metric("jaxkv_kv_pages_freed_by_compression_total") > before[1]
    assert server.metric("jaxkv_kv_pages_in_use") == 0  # compressed requests gave every page back


def test_per_request_retrieval_policy(server):
    """Quest keeps the cache and reads a per-head top-B in decode; B beyond the context reads everything."""
    full = complete(server)
    assert complete(server, kv_policy={"name": "quest", "budget": MAX_MODEL_LEN}) == full
    assert complete(server, kv_policy={"name": "quest", "budget": 16})  # a small selection still serves


def test_per_request_policy_in_a_chat_stream(server):
    c = client(server)
    kw = dict(model=server.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0)
    plain = c.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].message.content
    chunks = list(c.chat.completions.create(**kw, stream=True, extra_body={
        "ignore_eos": True, "kv_policy": {"name": "h2o", "budget": 4096}}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == plain


BAD_POLICY = [
    ({"kv_policy": "nope"}, "unknown KV policy"),
    ({"kv_policy": {"name": "quest", "budget": 0.5}}, "budget"),  # retrieval budgets are tokens per head
    ({"kv_policy": {"name": "snapkv", "budget": -1}}, "budget"),
    ({"kv_policy": {"name": "snapkv", "budget": 0}}, "budget"),
    ({"kv_policy": {"name": "snapkv", "budget": "half"}}, "budget"),
    ({"kv_policy": {"name": "snapkv", "pooling": "median"}}, "pooling"),
    ({"kv_policy": {"name": "snapkv", "colour": "red"}}, "no field"),
    ({"kv_policy": {"budget": 0.5}}, "needs a 'name'"),
    ({"kv_policy": {"name": "full", "budget": 0.5}}, "takes no fields"),
    ({"kv_policy": 5}, "kv_policy"),
    ({"kv_policy": {"name": "pyramidkv", "beta": [1]}}, "beta must be an integer"),  # unhashable
    ({"kv_policy": {"name": "rkv", "kernel": 2.5}}, "kernel must be an integer"),
    ({"kv_policy": {"name": "hardkv", "calibration": "x"}}, "cannot be set"),
    ({"kv_policy": "hardkv"}, "--kv-merge"),  # HARD-KV merges; this server holds no per-slot bias
    ({"kv_policy": {"name": "snapkv", "window": 10**6}}, "at most max_model_len"),  # sizes a buffer
]


@pytest.mark.parametrize("extra,words", BAD_POLICY, ids=[str(i) for i in range(len(BAD_POLICY))])
def test_bad_policy_is_400(server, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).completions.create(model=server.name, prompt="hi", max_tokens=1, extra_body=extra)
    err = e.value.body
    assert err["param"] == "kv_policy" and words in err["message"], err


def test_cli_rejects_bad_policies(capsys):
    from jaxkv.serve.__main__ import parse_args

    for argv, words in ([["--kv-policy", "nope"], "unknown KV policy"],
                        [["--kv-policy", "snapkv", "--kv-budget", "-1"], "budget"],
                        [["--kv-policy", "snapkv", "--kv-policy-arg", "colour=red"], "no field"],
                        [["--kv-policy", "snapkv", "--kv-policy-arg", "window"], "KEY=VALUE"],
                        [["--kv-budget", "0.5"], "need --kv-policy"],
                        [["--retrieval-resident", "0.5", "--retrieval-host-tier"], "must be >= 1"],
                        [["--retrieval-resident", "2"], "needs --retrieval-host-tier"],
                        [["--retrieval-host-pages", "8"], "needs --retrieval-host-tier"],
                        [["--retrieval-host-pages", "-1", "--retrieval-host-tier"], "must be >= 0"],
                        [["--retrieval-host-overlap"], "needs --retrieval-host-tier"],
                        [["--segment-anchor", "system"], "--segment-anchor must be"],
                        [["--segment-ffn-cache-mb", "-1"], "--segment-ffn-cache-mb must be"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err, argv
    args = parse_args(["--kv-policy", "snapkv", "--kv-budget", "0.125", "--kv-policy-arg", "window=32",
                       "--kv-policy-arg", "pooling=max"])
    p = args.kv_policy_obj
    assert (p.name, p.budget, p.window, p.pooling) == ("snapkv", 0.125, 32, "max")
    args = parse_args(["--kv-policy", "specontext", "--kv-budget", "64", "--retrieval-host-tier",
                       "--retrieval-resident", "2", "--retrieval-host-pages", "4096",
                       "--retrieval-host-overlap"])
    assert (args.kv_policy_obj.name, args.kv_policy_obj.budget) == ("specontext", 64)   # an int budget
    assert (args.retrieval_host_tier, args.retrieval_resident, args.retrieval_host_pages) == (True, 2.0, 4096)
    assert args.retrieval_host_overlap and not parse_args([]).retrieval_host_overlap
    assert parse_args(["--kv-policy", "snapkv", "--kv-budget", "128"]).kv_policy_obj.budget == 128
    assert parse_args([]).segment_anchor == "bos"
    assert parse_args(["--segment-anchor", "none"]).segment_anchor is None
    assert parse_args(["--segment-anchor", "1,5,9"]).segment_anchor == [1, 5, 9]
    assert parse_args([]).segment_ffn_cache_mb is None
    assert parse_args(["--segment-ffn-cache-mb", "64"]).segment_ffn_cache_mb == 64.0


# ------------------------------------------------------------------------------------ segment reuse


def test_segment_register_reuse_delete(server, tok, ckpt):
    seg = register(server, text=DOC)
    assert register(server, text=DOC) == seg  # content-addressed: registering again is idempotent
    listed = http(server, "GET", "segments").json()["data"]
    assert seg in [x["id"] for x in listed]
    card = http(server, "GET", f"segments/{seg}").json()
    assert card["num_tokens"] == len(tok.encode(DOC, add_special_tokens=False))
    assert server.metric("jaxkv_segments") >= 1

    question = " what is the answer"
    doc_ids, q_ids = tok.encode(DOC, add_special_tokens=False), tok.encode(question, add_special_tokens=False)
    bos = tok.encode("", add_special_tokens=True)
    plain = complete(server, prompt=bos + doc_ids + q_ids)  # the same prompt, no reuse
    # `full` recomputes everything: the ordinary engine's greedy output.
    assert complete(server, prompt=question, reuse={"segments": [seg], "method": "full"}) == plain
    # Segments are prefilled after BOS (the default --segment-anchor): right after a BOS prefix a segment
    # sits where it was prefilled, with the context it was prefilled in, so naive reuse is exact there.
    at1 = complete(server, prompt=q_ids, reuse={"segments": [seg], "method": "naive", "prefix": bos})
    assert at1 == plain
    for method in ("naive", "epic", "cacheblend", "sparsex", "redknot", {"name": "cacheblend", "ratio": 0.5},
                   {"name": "redknot", "ffn_reuse": True, "ffn_select": "deviation"}):
        r = client(server).completions.create(model=server.name, prompt=question, **GREEDY, extra_body={
            "ignore_eos": True, "reuse": {"segments": [seg], "method": method, "prefix": "document:"}})
        n = len(tok.encode("document:")) + len(doc_ids) + len(q_ids)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 12), method
    assert server.metric("jaxkv_reuse_requests_total", method="cacheblend") >= 2
    # RedKnot's ffn_reuse kept the segment's FFN outputs beside it: the card says how much memory that is.
    cfg = json.loads((ckpt / "config.json").read_text())  # served in float32 on a CPU (--dtype auto)
    # It keeps its forward's padded output: the BOS anchor and the document, rows bucketed.
    from jaxkv.engine.reuse import row_bucket

    assert http(server, "GET", f"segments/{seg}").json()["ffn_cache_bytes"] == (
        cfg["num_hidden_layers"] * row_bucket(1 + len(doc_ids), floor=128) * cfg["hidden_size"] * 4)

    # Streaming with reuse, and the segment as a chat content part.
    chunks = list(client(server).completions.create(
        model=server.name, prompt=question, **GREEDY, stream=True,
        extra_body={"ignore_eos": True, "reuse": {"segments": [seg], "method": "full"}}))
    assert "".join(ch.choices[0].text for ch in chunks) == plain
    r = client(server).chat.completions.create(model=server.name, max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "read:"}, {"type": "segment", "id": seg},
                                     {"type": "text", "text": question}]}],
        extra_body={"reuse": {"method": "epic"}})
    assert r.usage.prompt_tokens > len(doc_ids)

    r = http(server, "DELETE", f"segments/{seg}")
    assert r.status_code == 200 and r.json() == {"id": seg, "object": "segment.deleted", "deleted": True}
    assert http(server, "DELETE", f"segments/{seg}").status_code == 404
    assert seg not in [x["id"] for x in http(server, "GET", "segments").json()["data"]]
    with pytest.raises(openai.BadRequestError) as e:
        complete(server, prompt=question, reuse={"segments": [seg]})
    assert e.value.body["code"] == "segment_not_found" and e.value.body["param"] == "reuse.segments[0]"
    assert server.metric("jaxkv_kv_pages_in_use") == 0


def test_segment_registered_with_its_prompt_context(server, tok):
    """`context`: the segment as it was in an earlier prompt; reused right after that same text, naive reuse
    decodes exactly like the plain prompt. The context is part of the id; bad context ids are a 400."""
    plain_id = register(server, text=DOC)
    ctx = "notes for the meeting:"
    seg = register(server, text=DOC, context=ctx)
    assert seg != plain_id
    ctx_ids = tok.encode(ctx, add_special_tokens=False)
    assert http(server, "GET", f"segments/{seg}").json()["context_tokens"] == len(ctx_ids)
    bos = tok.encode("", add_special_tokens=True)
    doc_ids = tok.encode(DOC, add_special_tokens=False)
    q_ids = tok.encode(" what is the answer", add_special_tokens=False)
    plain = complete(server, prompt=bos + ctx_ids + doc_ids + q_ids)
    reuse = {"segments": [seg], "method": "naive", "prefix": bos + ctx_ids}
    assert complete(server, prompt=q_ids, reuse=reuse) == plain
    r = http(server, "POST", "segments", json={"text": DOC, "context": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "context"


def test_segments_are_invisible_to_other_tenants(server):
    text = "tenant secret " + DOC
    seg = register(server, "key-a", text=text, frozen=True)
    mine = http(server, "GET", "segments", "key-a").json()["data"]
    assert [x["frozen"] for x in mine if x["id"] == seg] == [True]
    assert seg not in [x["id"] for x in http(server, "GET", "segments", "key-b").json()["data"]]
    assert http(server, "GET", f"segments/{seg}", "key-b").status_code == 404
    for key, salt in (("key-b", None), ("key-a", "other-salt")):  # another tenant, or another salt
        extra = {"reuse": {"segments": [seg]}, **({"cache_salt": salt} if salt else {})}
        with pytest.raises(openai.BadRequestError) as e:
            client(server, key).completions.create(model=server.name, prompt="q", max_tokens=1,
                                                   extra_body=extra)
        assert e.value.body["code"] == "segment_not_found"
        assert "team-a" not in e.value.body["message"]  # the owner's namespace is not revealed
    assert http(server, "DELETE", f"segments/{seg}", "key-b").status_code == 404  # cannot delete it either
    # The same text registered by the other tenant is its own segment (another id, its own pages).
    seg_b = register(server, "key-b", text=text)
    assert seg_b != seg
    assert complete(server, "key-a", prompt=" q", reuse={"segments": [seg]})
    assert http(server, "GET", "segments", key=None).status_code == 401
    for k, s in (("key-a", seg), ("key-b", seg_b)):
        assert http(server, "DELETE", f"segments/{s}", k).status_code == 200


BAD_REUSE = [  # (route, body fields, param)
    ("segments", {}, "text"),
    ("segments", {"text": "a", "tokens": [1]}, "text"),
    ("segments", {"text": ""}, "text"),
    ("segments", {"tokens": [10**9]}, "tokens"),
    ("segments", {"tokens": list(range(5, 5 + MAX_MODEL_LEN))}, "tokens"),
    ("segments", {"text": "a", "colour": "red"}, "colour"),
    ("segments", {"text": "a", "frozen": "yes"}, "frozen"),
    ("segments", {"text": "a", "cache_salt": ""}, "cache_salt"),
    ("completions", {"prompt": "q", "reuse": {"segments": []}}, "reuse.segments"),
    ("completions", {"prompt": "q", "reuse": {"segments": ["seg-nope"]}}, "reuse.segments[0]"),
    ("completions", {"prompt": "q", "reuse": {"segments": ["seg-nope"], "method": "bogus"}}, "reuse.method"),
    ("completions", {"prompt": "q", "reuse": {"segments": ["seg-nope"], "method": {"name": "epic", "x": 1}}},
     "reuse.method"),
    ("completions", {"prompt": "q", "reuse": {"segments": ["s"], "extra": 1}}, "reuse.extra"),
    ("completions", {"prompt": "q", "reuse": {"segments": ["s"]}, "kv_policy": "snapkv"}, "kv_policy"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "reuse": {"segments": ["s"]}},
     "reuse"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "segment"}]}]},
     "messages[0].content[0]"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "segment", "id": "seg-nope"}]}]},
     "messages"),
]


@pytest.mark.parametrize("route,body,param", BAD_REUSE,
                         ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD_REUSE)])
def test_bad_reuse_input_is_400(server, route, body, param):
    if route != "segments":
        body = {"model": server.name, "max_tokens": 1, **body}
    r = http(server, "POST", route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_non_adjacent_segment_parts_are_400(server):
    seg = register(server, text="a small note on the river")
    parts = [{"type": "segment", "id": seg}, {"type": "text", "text": "and"}, {"type": "segment", "id": seg}]
    r = http(server, "POST", "chat/completions", json={"model": server.name, "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and "adjacent" in r.json()["error"]["message"], r.text


def test_reuse_request_beyond_its_page_aligned_layout_is_400_naming_max_tokens(server):
    # Every reused segment starts on a page boundary: twelve 1-token segments lay the prompt out over 13 pages
    # per head, and 64 more tokens need 4 more: beyond the 16 pages of a 256-token context. The token count
    # (14 + 64) fits, so only the layout tells: refused before anything is queued, naming max_tokens.
    segs = [register(server, tokens=[100 + i]) for i in range(12)]
    body = {"model": server.name, "prompt": [7], "max_tokens": 64, "ignore_eos": True,
            "reuse": {"segments": segs, "prefix": [1]}}
    for stream in (False, True):
        r = http(server, "POST", "completions", json={**body, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        assert "page boundaries" in r.json()["error"]["message"]
    assert complete(server, prompt=[7], reuse={"segments": segs, "prefix": [1]})  # 12 tokens fit the layout
    assert complete(server, prompt=[7], reuse={"segments": segs[:2], "prefix": [1]})  # still serving
    assert server.metric("jaxkv_kv_pages_in_use") == 0
    for s in segs:
        assert http(server, "DELETE", f"segments/{s}").status_code == 200


def test_windowed_heads_refuse_reuse_clearly(ckpt):
    # In-process (httpx's ASGI transport): the refusal comes before the engine is asked anything.
    import asyncio

    import jaxkv
    from jaxkv.cache.head_classes import HeadClass, HeadClassMap
    from jaxkv.engine.engine import Engine
    from jaxkv.serve.app import build_app
    from jaxkv.serve.server import build_state

    model = jaxkv.load(ckpt, dtype="float32")
    cfg = model.config
    rows = [[HeadClass.local(4, 32) if (layer, h) == (0, 0) else HeadClass.global_()
             for h in range(cfg.num_kv_heads)] for layer in range(cfg.num_layers)]
    engine = Engine(model, num_pages=64, max_model_len=MAX_MODEL_LEN,
                    head_classes=HeadClassMap(cfg.num_layers, cfg.num_kv_heads, rows))
    app = build_app(build_state(model, engine, "tiny"))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/info"), await c.post("/v1/segments", json={"text": "a note"}),
                    await c.post("/v1/completions", json={"model": "tiny", "prompt": "q",
                                                          "reuse": {"segments": ["seg-x"]}}))

    info, seg, comp = asyncio.run(main())
    assert info.json()["segment_reuse"] is False
    for r in (seg, comp):
        assert r.status_code == 400 and r.json()["error"]["code"] == "reuse_unavailable", r.text
        assert "--head-classes global" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------ SpeContext host tier


def _with_random_head(ckpt, tmp_path):
    """A copy of the tiny checkpoint with a random-weight retrieval head beside it (tap layer 1)."""
    import shutil

    import jax

    import jaxkv
    from jaxkv.policies.retrieve import specontext as sc

    model_dir = tmp_path / "tiny-with-head"
    shutil.copytree(ckpt, model_dir)
    model = jaxkv.load(model_dir)
    cfg = model.config
    hc = sc.HeadConfig.for_model(cfg, num_heads=2 * cfg.num_kv_heads, model_id=model.model_id)
    sc.save_head(model_dir / sc.HEAD_DIR, sc.init_head(hc, jax.random.PRNGKey(0)), {"random": True})
    return model_dir


def test_specontext_host_tier_server_answers_as_the_in_place_server(ckpt, tmp_path):
    """`--kv-policy specontext --retrieval-host-tier --retrieval-resident 2`: the selection's K/V comes from
    a pinned host mirror through a resident device buffer; the greedy completion equals the server that reads
    the selection in place (same checkpoint, same random retrieval head beside it)."""
    model_dir = _with_random_head(ckpt, tmp_path)
    common = ["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "512",
              "--max-num-seqs", "2", "--max-step-tokens", "64", "--head-classes", "global", "--no-precompile",
              "--kv-policy", "specontext", "--kv-budget", "16"]
    texts = []
    for extra in ([], ["--retrieval-host-tier", "--retrieval-resident", "2"]):
        s = ServerProcess(common + extra)
        try:
            c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=180)
            r = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, **GREEDY)
            assert r.usage.completion_tokens == GREEDY["max_tokens"]
            texts.append(r.choices[0].text)
        finally:
            s.stop()
    assert texts[0] == texts[1]


def test_specontext_offload_server_finishes_a_batch_its_pool_cannot_hold(ckpt, tmp_path):
    """`--retrieval-host-pages`: two concurrent 158 + 60-token requests need 2 x 4 heads x 55 pages of 4
    slots = 440 pages; the pool has 360 (both prompts fit, their decodes do not). The server moves older
    pages of the selected layer to host memory instead of preempting: both requests finish, the metrics
    show pages offloaded and no preemption, and every host page is free again afterwards. (The same server
    without `--retrieval-host-pages` preempts once on this load.)"""
    import concurrent.futures

    model_dir = _with_random_head(ckpt, tmp_path)
    s = ServerProcess(["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--page-size", "4",
                       "--num-pages", "360", "--max-num-seqs", "2", "--max-step-tokens", "512",
                       "--head-classes", "global", "--no-precompile", "--kv-policy", "specontext",
                       "--kv-budget", "16", "--retrieval-host-tier", "--retrieval-host-pages", "512"])
    try:
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=300)
        name = c.models.list().data[0].id

        def ask(prompt):
            return c.completions.create(model=name, prompt=prompt, max_tokens=60, temperature=0,
                                        extra_body={"ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(ask, [PROMPT, PROMPT.replace("king", "cook")]))
        assert [r.usage.completion_tokens for r in rs] == [60, 60]
        assert s.metric("jaxkv_kv_pages_offloaded") > 0
        assert s.metric("jaxkv_num_preemptions") == 0
        assert any(k.startswith("jaxkv_kv_host_pages_in_use") for k in s.metrics())
        assert s.metric("jaxkv_kv_host_pages_in_use") == 0   # released with their requests
    finally:
        s.stop()


def test_segments_survive_a_server_restart(ckpt, tmp_path):
    """`--segment-store DIR`: a segment registered with one server process is served by the next one on
    the same store (no re-prefill), within its namespace, with the same tokens; another layout is refused
    at startup with a clear error."""
    store = tmp_path / "segments"
    common = ["--model", str(ckpt), "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "512",
              "--max-num-seqs", "2", "--max-step-tokens", "64", "--head-classes", "global",
              "--no-precompile", "--segment-store", str(store)]
    first = ServerProcess(common)
    try:
        seg = register(first, key=None, text=DOC, frozen=True)
        want = complete(first, key="unused", prompt=" what", reuse={"segments": [seg], "method": "naive"})
    finally:
        first.stop()
    second = ServerProcess(common)
    try:
        assert "segment store" in "".join(second.log) and "(1 segments restored)" in "".join(second.log)
        cards = http(second, "GET", "segments", key=None).json()["data"]
        assert [c["id"] for c in cards] == [seg] and cards[0]["frozen"]
        got = complete(second, key="unused", prompt=" what", reuse={"segments": [seg], "method": "naive"})
        assert got == want
    finally:
        second.stop()
    with pytest.raises(RuntimeError, match="another model or KV layout"):
        ServerProcess([*common, "--page-size", "8"])


def test_specontext_requests_wait_for_a_state_row_and_others_pass(ckpt, tmp_path):
    """`--retrieval-max-seqs 1`: two concurrent per-request SpeContext completions and a plain one on a
    3-sequence server all finish (the second SpeContext request waits for the row, the plain one does not);
    /metrics shows one row, free again afterwards."""
    import concurrent.futures

    model_dir = _with_random_head(ckpt, tmp_path)
    s = ServerProcess(["--model", str(model_dir), "--max-model-len", str(MAX_MODEL_LEN), "--num-pages", "512",
                       "--max-num-seqs", "3", "--max-step-tokens", "64", "--head-classes", "global",
                       "--no-precompile", "--retrieval-max-seqs", "1"])
    try:
        c = openai.OpenAI(base_url=s.url, api_key="x", max_retries=0, timeout=300)
        name = c.models.list().data[0].id
        spe = {"name": "specontext", "budget": 16}

        def ask(policy):
            body = {"ignore_eos": True, **({"kv_policy": policy} if policy else {})}
            return c.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body=body)

        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            rs = list(ex.map(ask, [spe, spe, None]))
        assert [r.usage.completion_tokens for r in rs] == [24, 24, 24]
        assert rs[0].choices[0].text == rs[1].choices[0].text  # one row, used in turn, same answer
        assert s.metric("jaxkv_retrieval_state_rows") == 1
        assert s.metric("jaxkv_retrieval_state_rows_in_use") == 0
        assert "retrieval state rows 1" in "".join(s.log)
        assert httpx.get(s.base + "/info").json()["retrieval_max_seqs"] == 1
    finally:
        s.stop()
