"""Engine logprobs: top alternatives and prompt logprobs against a dense forward of the same model, through
chunked prefill, multi-step decode and a step shared with a retrieval request; the logprob variants are
compiled only when asked for, and ordinary steps keep their programs."""

import dataclasses

import numpy as np
import pytest

import jaxkv
from jaxkv.engine import runner as runner_mod
from jaxkv.engine.engine import Engine
from jaxkv.engine.runner import num_compilations
from jaxkv.sampling import MAX_LOGPROBS, SamplingParams
from tests.hf_tiny import make_tiny_checkpoint

TOL = 2e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("lp-engine")))


def log_softmax(model, ids) -> np.ndarray:
    x = np.asarray(model.logits(ids)[0], np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def prompt(model, n, seed=0):
    return np.random.default_rng(seed).integers(3, model.config.vocab_size, size=n).tolist()


def engine(model, **kw):
    return Engine(model, **{"page_size": 4, "max_model_len": 128, "max_num_seqs": 4, "max_step_tokens": 16,
                            "decode_steps": 4, **kw})


def drain(eng):
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def check_request(model, p, outs, k_gen, k_prompt):
    tokens = [t for o in outs for t in o.new_token_ids]
    ref = log_softmax(model, p + tokens)
    first = outs[0]
    if k_prompt is not None:
        assert first.prompt_logprobs[0] is None and first.prompt_top_logprobs[0] is None
        np.testing.assert_allclose(first.prompt_logprobs[1:], [ref[j - 1, p[j]] for j in range(1, len(p))],
                                   atol=TOL)
        for j in range(1, len(p)):
            ids = [i for i, _ in first.prompt_top_logprobs[j]]
            assert ids == list(np.argsort(-ref[j - 1], kind="stable")[:k_prompt])
            np.testing.assert_allclose([v for _, v in first.prompt_top_logprobs[j]], ref[j - 1, ids],
                                       atol=TOL)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # handed out once
    for i, o in enumerate(outs):
        row = ref[len(p) - 1 + i]
        assert abs(o.new_logprobs[0] - row[tokens[i]]) < TOL
        if k_gen:
            top = o.new_top_logprobs[0]
            assert [t for t, _ in top] == list(np.argsort(-row, kind="stable")[:k_gen])
            np.testing.assert_allclose([v for _, v in top], row[[t for t, _ in top]], atol=TOL)
        else:
            assert o.new_top_logprobs is None


def test_prompt_and_top_logprobs_through_chunked_prefill_and_decode(model):
    """A 40-token prompt prefills in three 16-token steps beside a request that asks for nothing; greedy
    and sampled rows decode 4 steps per call."""
    eng = engine(model)
    asks = [  # (prompt, sampling, alternatives per generated token, per prompt token)
        (prompt(model, 40), SamplingParams(temperature=0, max_tokens=9, logprobs=5, prompt_logprobs=3), 5, 3),
        (prompt(model, 7, 1), SamplingParams(temperature=0.8, seed=3, max_tokens=9), 0, None),
        (prompt(model, 5, 2), SamplingParams(temperature=1.0, seed=4, max_tokens=9, logprobs=MAX_LOGPROBS),
         MAX_LOGPROBS, None),
        (prompt(model, 20, 3), SamplingParams(max_tokens=2, prompt_logprobs=0), 0, 0),
    ]
    rids = [eng.add_request(p, dataclasses.replace(sp, ignore_eos=True)) for p, sp, _, _ in asks]
    outs = drain(eng)
    for rid, (p, _, k_gen, k_prompt) in zip(rids, asks):
        check_request(model, p, outs[rid], k_gen, k_prompt)
    assert outs[rids[3]][0].prompt_top_logprobs[1] == []  # prompt logprobs without alternatives


def test_prompt_logprobs_skip_the_prefix_cache(model):
    """Cached prompt pages have no logits: a request asking for prompt logprobs prefills its whole prompt."""
    eng = Engine(model, page_size=4, max_model_len=64, max_num_seqs=2)
    p = prompt(model, 33, 5)
    drain_one = lambda sp: drain_req(eng, p, sp)  # noqa: E731
    drain_one(SamplingParams(max_tokens=2))
    assert drain_one(SamplingParams(max_tokens=2))[0].num_cached_tokens == 32  # the prompt's pages are shared
    out = drain_one(SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert out[0].num_cached_tokens == 0
    check_request(model, p, out, 0, 1)


def drain_req(eng, p, sp):
    rid = eng.add_request(p, sp)
    return drain(eng)[rid]


def test_ordinary_steps_compile_nothing_new_and_have_no_top_k(model):
    """Requests without logprobs after requests with them reuse the variants compiled before; the lowered
    ordinary step holds no top-k, the logprob variant does."""
    eng = engine(model)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    drain_req(eng, prompt(model, 10), plain)
    before = num_compilations()
    drain_req(eng, prompt(model, 10, 1), SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                        ignore_eos=True))
    with_logprobs = num_compilations()
    assert with_logprobs > before  # the variants with alternatives are their own programs
    drain_req(eng, prompt(model, 10, 2), plain)
    assert num_compilations() == with_logprobs

    t, p = 8, eng._page_buckets[0]  # an all-padding ragged step, as precompile builds it
    s = eng.step_rows(t)
    q_seq = np.full(t, -1, np.int32)
    page_table, lengths, slots = eng.device_tables.step_meta([], [], s, p, q_seq, np.zeros(t, np.int32))
    arrays = dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32), q_seq=q_seq, slots=slots,
                  page_table=page_table, lengths=lengths, logits_index=np.zeros(s, np.int32),
                  temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
                  top_p=np.ones(s, np.float32), seeds=np.zeros(s, np.uint32), counters=np.zeros(s, np.int32))
    r = eng.runner
    args = (r.params, r.pool, {**arrays, **r._heads})
    kw = dict(cfg=r.cfg, attn_impl=r.attn_impl, use_plan=r.use_plan, greedy=True, mesh=None)
    ordinary = runner_mod._step.lower(*args, **kw).as_text()
    top = runner_mod._step.lower(*args, **kw, top_width=MAX_LOGPROBS).as_text()
    assert "top_k" not in ordinary and "top_k" in top


def test_refusals(model):
    eng = engine(model)
    with pytest.raises(ValueError, match="retrieval policy"):
        eng.add_request(prompt(model, 8), SamplingParams(logprobs=1), kv_policy="quest", kv_budget=16)
    with pytest.raises(ValueError, match="segment reuse"):
        eng.add_reuse_request([1], [prompt(model, 8)], [2, 3], sampling=SamplingParams(prompt_logprobs=0))
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)


def test_alternatives_beside_a_retrieval_request(model):
    """A request asking for alternatives that shares its steps with a retrieval (Quest) request runs its
    prefill in a call of its own and gets its alternatives from the gathered decode."""
    eng = engine(model)
    p_ret, p_lp = prompt(model, 30, 7), prompt(model, 12, 8)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    r_ret = eng.add_request(p_ret, sp, kv_policy="quest", kv_budget=16)
    r_lp = eng.add_request(p_lp, SamplingParams(temperature=0, max_tokens=8, logprobs=4, prompt_logprobs=2,
                                                ignore_eos=True))
    outs = drain(eng)
    assert len(outs[r_ret]) == 8
    check_request(model, p_lp, outs[r_lp], 4, 2)


def test_pallas_plan_paths(model):
    """With the Pallas kernels (interpreted off the GPU): a 300-token fresh prompt prefills in one step
    through head_class_prefill, a 40-token one through the multi-layer plan, and decode writes K/V after
    the forward (`_decode_forward`); the logprobs are the same."""
    eng = Engine(model, page_size=16, max_model_len=512, max_num_seqs=4, max_step_tokens=64, decode_steps=4,
                 attn_impl="pallas")
    assert eng.runner.use_plan and eng.scheduler.max_fresh_tokens >= 300
    for n in (300, 40):
        p = prompt(model, n, seed=n)
        out = drain_req(eng, p, SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3,
                                               ignore_eos=True))
        check_request(model, p, out, 5, 3)
