"""Greedy and sampled rows share one program per step shape (a `lax.cond` skips the sampler for a greedy
batch); `greedy_programs=True` compiles argmax-only twins instead. Both give the same tokens, and either
serves a greedy and sampled mix after precompile without compiling."""

import dataclasses

import jax
import pytest

import jaxkv
from jaxkv.engine import compilations, warmup
from jaxkv.engine.engine import Engine
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint
from tests.test_engine import prompts_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, max_tokens=9, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-sampler-programs")))


def _engine(model, greedy_programs=False, **kw):
    return Engine(model, page_size=4, max_model_len=64, max_num_seqs=2, max_step_tokens=16,
                  enable_prefix_caching=False, greedy_programs=greedy_programs, **kw)


def _run(engine, prompts, samplings):
    ids = [engine.add_request(p, s) for p, s in zip(prompts, samplings)]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    return [got[i] for i in ids]


def test_one_program_per_shape_unless_argmax_twins_are_asked_for(llama):
    one, twins = _engine(llama), _engine(llama, greedy_programs=True)
    # the default: twins on the CPU (programs compile on first use there), one program elsewhere
    assert Engine(llama, max_model_len=64, enable_prefix_caching=False).runner.greedy_programs == (
        jax.default_backend() == "cpu")
    shared = warmup.variants(one)
    assert shared and not any(v[4] for v in shared)  # every variant is the sampling one
    split = warmup.variants(twins)
    assert len(split) == 2 * len(shared)
    assert {v for v in split if not v[4]} == set(shared)


@pytest.mark.parametrize("greedy_programs", [False, True])
def test_greedy_and_sampled_rows_compile_nothing_after_precompile(llama, greedy_programs):
    engine = _engine(llama, greedy_programs=greedy_programs)
    engine.precompile(progress=False, step_cache=False)
    before = compilations.step_programs()
    prompts = prompts_for(llama, [5, 13, 7], seed=2)
    _run(engine, prompts[:2], [GREEDY, GREEDY])  # greedy batches only
    _run(engine, prompts, [GREEDY, SAMPLED, dataclasses.replace(SAMPLED, seed=4)])  # mixed, then sampled
    assert compilations.step_programs() == before


def test_the_shared_program_gives_the_argmax_programs_tokens(llama):
    prompts = prompts_for(llama, [5, 13, 7, 9], seed=4)
    samplings = [GREEDY, SAMPLED, dataclasses.replace(GREEDY, max_tokens=20),
                 dataclasses.replace(SAMPLED, seed=8)]
    shared = _run(_engine(llama), prompts, samplings)
    twins = _run(_engine(llama, greedy_programs=True), prompts, samplings)
    assert shared == twins
    # greedy alone (the cond's argmax branch) against greedy beside sampled rows (the sampler's branch)
    alone = _run(_engine(llama), prompts[:1], [GREEDY])
    assert alone[0] == shared[0]
