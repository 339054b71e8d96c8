"""The retrieval and reuse forwards run through the model's layer loop (`llama.run_layers`): with
`SharedLayers` they trace one layer body per distinct attention (not one per layer) and give the unrolled
loop's tokens."""

import re

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.cache.head_classes import HeadClass, HeadClassMap, all_global
from jaxkv.engine.engine import Engine
from jaxkv.models import llama
from jaxkv.policies import get_policy
from jaxkv.policies.retrieve import specontext as sc
from jaxkv.policies.reuse import get_reuse_policy
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint, sharp_gqa_toy
from tests.test_reuse import run as run_reuse

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The 3-layer GQA toy with a lagged retrieval head (selects after layer 1, keys after layer 2): the
    decode's layer loop splits at both taps."""
    out = sharp_gqa_toy(tmp_path_factory.mktemp("toy"), seed=0)
    model = jaxkv.load(out)
    cfg = sc.HeadConfig.for_model(model.config, tap_layer=1, key_layer=2, model_id=model.model_id)
    sc.save_head(out / sc.HEAD_DIR, sc.init_head(cfg, jax.random.PRNGKey(5), scale=0.5), {"test": True})
    return jaxkv.load(out)


def _ring_map(cfg):
    """KV head 0 global, the others sink 2 + window 8 rings, in layers 1 and 2 only: the ring merge is a
    per-layer choice the shared body takes from data."""
    ring = (HeadClass.global_(),) + (HeadClass.local(2, 8),) * (cfg.num_kv_heads - 1)
    rows = [(HeadClass.global_(),) * cfg.num_kv_heads] + [ring] * (cfg.num_layers - 1)
    return HeadClassMap(cfg.num_layers, cfg.num_kv_heads, tuple(rows))


def _prompt(vocab, n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(10, vocab, n)]


def _retrieval_tokens(model, loop, policy, **kw):
    eng = Engine(model, page_size=4, max_model_len=128, max_num_seqs=4, max_step_tokens=16, decode_steps=3,
                 enable_prefix_caching=False, layer_loop=loop, head_classes=_ring_map(model.config), **kw)
    assert isinstance(eng.model.params["layers"], llama.SharedLayers) == (loop == "shared")
    vocab = model.config.vocab_size
    ids = [eng.add_request(_prompt(vocab, n, n), GREEDY, kv_policy=policy) for n in (50, 37)]
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    return [got[i] for i in ids]


@pytest.mark.parametrize("policy,kw", [
    (sc.SpeContext(budget=6, sink=1, recent=1), {}),
    (sc.SpeContext(budget=6, sink=1, recent=1), {"retrieval_inplace": False}),  # the selection buffer
    (get_policy("quest", budget=12), {}),
])
def test_retrieval_requests_give_the_same_tokens_shared_and_unrolled(toy, policy, kw):
    """SpeContext (in place and through the buffer; lagged head: taps before layers 1 and 2) and Quest
    (per-layer page choice), with ring heads in some layers: the shared layer body gives the unrolled
    loop's tokens, and the small budget matters (the selection path really ran)."""
    got = {loop: _retrieval_tokens(toy, loop, policy, **kw) for loop in ("unrolled", "shared")}
    assert got["shared"] == got["unrolled"] and all(len(t) == 8 for t in got["shared"])
    full = _retrieval_tokens(toy, "shared", None)
    assert got["shared"] != full


@pytest.fixture(scope="module")
def reuse_model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("reuse")))


def _reuse_run(model, loop, method):
    cfg = model.config
    # the engine's heads keep full history (reuse needs it); the reuse map has rings in layers 1 and 2, so
    # the windowed attention's per-layer choice runs
    eng = Engine(model, page_size=4, max_model_len=128, layer_loop=loop,
                 head_classes=all_global(cfg.num_layers, cfg.num_kv_heads),
                 segment_head_classes=_ring_map(cfg))
    eng.reuser.keep_logits = True
    rng = np.random.default_rng(0)
    prefix, s1, s2, suffix = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (5, 19, 13, 7)]
    return run_reuse(eng, prefix, [s1, s2], suffix, method, sampling=GREEDY)


@pytest.mark.parametrize("method", [
    # dense FFN in layer 0, sparse from 1 (one rolled body: the choice is data); FFN reuse runs the segment
    # FFN pass
    get_reuse_policy("redknot", dense_until=1, ffn_capacity=0.4, mass_thresh=0.05, ffn_dilate=0, recent_n=1,
                     ffn_reuse=True, edge_thresh=0.1),
    get_reuse_policy("sparsex"),
])
def test_reuse_requests_give_the_same_tokens_shared_and_unrolled(reuse_model, method):
    """A RedKnot (sparse FFN from layer 1, FFN reuse, edge promotion; its shared layers run rolled) and a
    SparseX reuse request: the same tokens and per-layer statistics with the shared layer body as unrolled,
    first-token logits equal to float rounding."""
    (tok_u, st_u), (tok_s, st_s) = (_reuse_run(reuse_model, loop, method) for loop in ("unrolled", "shared"))
    assert tok_s == tok_u and len(tok_s) == 8
    assert (st_s.kv_writes, st_s.ffn_rows, st_s.ffn_dropped, st_s.promoted_heads) == (
        st_u.kv_writes, st_u.ffn_rows, st_u.ffn_dropped, st_u.promoted_heads)
    np.testing.assert_allclose(st_s.first_logits, st_u.first_logits, atol=1e-5, rtol=1e-5)
    if method.name == "redknot":  # the sparse FFN ran: fewer rows than the prompt in the layers past 1
        assert min(st_s.ffn_rows[1:]) < st_s.prompt_tokens


@pytest.mark.parametrize("inplace", [True, False])
def test_lowered_retrieval_decode_holds_one_layer_function_per_attention(toy, inplace):
    """The lowered SpeContext decode program with `SharedLayers`: one private function for the dense layers
    before the tap and one for the selected layers after it (called for each of the 3 layers, the second
    across the lagged head's key tap), none unrolled."""
    from jaxkv.engine import retrieval as R
    from jaxkv.engine.warmup import STOP_BUCKET

    pol = sc.SpeContext(budget=6, sink=1, recent=1)
    texts = {}
    for loop in ("shared", "unrolled"):
        eng = Engine(toy, page_size=4, max_model_len=128, max_num_seqs=2, layer_loop=loop, kv_policy=pol,
                     retrieval_inplace=inplace)
        r, runner = eng.retriever, eng.runner
        cfg = runner.cfg
        L, H, s, k, p = cfg.num_layers, cfg.num_kv_heads, 2, 2, 8
        d = dict(tokens=np.zeros(s, np.int32), positions=np.zeros(s, np.int32),
                 slots=np.full((k, s, L, H), -1, np.int32), lengths=np.zeros((k, s, L, H), np.int32),
                 prev_lengths=np.zeros((k, s, L, H), np.int32), active=np.zeros((k, s), bool),
                 stop_ids=np.full((s, STOP_BUCKET), -1, np.int32), known=np.zeros(s, bool),
                 page_table=np.full((s, L, H, p), -1, np.int32), temperature=np.zeros(s, np.float32),
                 top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32), seeds=np.zeros(s, np.uint32),
                 counters=np.zeros(s, np.int32), head_rows=np.full(s, -1, np.int32), **runner._heads)
        texts[loop] = R._decode_retrieval.lower(
            runner.params, runner.pool, R._on_device(d), r._state_for(pol), r.params_for(pol), None,
            r.buffers.buffer_for(pol), None, cfg=cfg, policy=pol, attn_impl=None, greedy=True,
            local_layers=r.local_layers, chunk=1, inplace=inplace, overlap=0).as_text()
    calls = re.findall(r"call @(layer\w*)\(", texts["shared"])
    bodies = re.findall(r"func\.func private @(layer\w*)\(", texts["shared"])
    assert len(calls) == L and len(bodies) == 2 and set(calls) == set(bodies)
    assert calls.count(calls[-1]) == L - 1  # layers 1 and 2 (split at the key tap) share one body
    assert "@layer" not in texts["unrolled"]


def _redknot_pass_hlo(num_layers: int, policy) -> str:
    """The compiled RedKnot reuse pass (all-padding batch, 32 tokens) of a random model of `num_layers`
    layers whose reuse map mixes global and windowed heads (two windowed configurations)."""
    from jaxkv.config import ModelConfig
    from jaxkv.loading import Model

    cfg = ModelConfig("llama", 256, 64, 128, num_layers, 4, 2, 16, tie_word_embeddings=True,
                      max_position_embeddings=256)
    model = Model(cfg, llama.init_params(cfg, jax.random.key(0)), None, {}, "random", None)
    ring = (HeadClass.global_(), HeadClass.local(2, 8))
    rows = [(HeadClass.global_(),) * 2] + [ring, ring[::-1]] * num_layers
    eng = Engine(model, page_size=4, max_model_len=64, head_classes=all_global(num_layers, 2),
                 segment_head_classes=HeadClassMap(num_layers, 2, tuple(rows[:num_layers])))
    fn, args, static = eng.reuser._pass_call(policy, 32, 32, 0)
    return fn.lower(*args, **static).compile().as_text()


def test_redknot_pass_compiles_one_layer_body_whatever_the_layer_count():
    """RedKnot's reuse pass runs its layer loop rolled (`rolled_layers`): the compiled program holds one
    sparse layer body, so 3 and 6 layers compile to the same matmuls, fusions and loops (inlined, every
    layer added its own copy: the pass compiled for minutes at 8K on an H100)."""
    pol = get_reuse_policy("redknot", dense_until=1, ffn_reuse=True)
    assert pol.rolled_layers and pol.device_form() is pol
    ops = {}
    for n in (3, 6):
        hlo = _redknot_pass_hlo(n, pol)
        ops[n] = {op: len(re.findall(rf" {op}\(", hlo)) for op in ("dot", "fusion", "while")}
    assert ops[3]["dot"] > 0 and ops[3]["while"] > 0
    assert ops[3] == ops[6]


def test_redknot_pass_is_one_layer_body_across_its_dense_ffn_layers():
    """Dense FFN before `dense_until`, sparse after: the choice is data in the one rolled body, so a pass
    whose dense layers end mid-model compiles the attention once, like a pass sparse in every layer (split
    at the boundary it held two layer bodies: 49 matmuls and 11 loops against 26 and 7)."""
    def ops(dense_until):
        hlo = _redknot_pass_hlo(4, get_reuse_policy("redknot", dense_until=dense_until))
        return {op: len(re.findall(rf" {op}\(", hlo)) for op in ("dot", "while")}

    cross, sparse = ops(2), ops(0)
    assert cross["while"] == sparse["while"]
    assert sparse["dot"] <= cross["dot"] <= sparse["dot"] + 3  # + the dense branch's FFN
