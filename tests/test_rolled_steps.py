"""Ragged steps of many tokens may run their layers as one rolled loop (`EngineConfig.rolled_from_tokens`):
one compiled layer body instead of L inlined ones. The rolled steps give the tokens of the inlined ones,
plain and with the retrieval tap (SpeContext, Quest), and only the steps at or past the threshold roll."""

import numpy as np
import pytest

import jaxkv
from jaxkv.engine.engine import Engine
from jaxkv.models import llama as llama_mod
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint
from tests.test_retrieval_precompile import KW, policies, serve


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-rolled")))


@pytest.fixture
def rolled_loops(monkeypatch):
    """Counts the rolled layer loops traced (each rolled range of a traced step is one)."""
    calls = []
    real = llama_mod._rolled_layers

    def spy(*args, **kw):
        calls.append(args[10] - args[9])  # layers in the range: stop - start
        return real(*args, **kw)

    monkeypatch.setattr(llama_mod, "_rolled_layers", spy)
    return calls


def _serve(eng, prompts):
    sps = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0.8, max_tokens=5, seed=3, ignore_eos=True)]
    ids = [eng.add_request(p, sps[i % 2]) for i, p in enumerate(prompts)]
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    return [got[i] for i in ids]


def test_rolled_steps_give_the_inlined_steps_tokens(model, rolled_loops):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in (3, 29, 40)]
    kw = dict(page_size=8, max_model_len=96, max_num_seqs=2, max_step_tokens=32, enable_prefix_caching=False)
    inlined = Engine(model, **kw)
    assert inlined.runner.rolled(32) == {}
    want = _serve(inlined, prompts)
    assert rolled_loops == []
    rolled = Engine(model, **kw, rolled_from_tokens=16)
    assert rolled.runner.rolled(16) == {"rolled": True} and rolled.runner.rolled(8) == {}
    assert _serve(rolled, prompts) == want
    # only the 16- and 32-token steps rolled (every layer in one loop); the decode steps stayed inlined
    assert rolled_loops and set(rolled_loops) == {model.config.num_layers}


def test_retrieval_tap_steps_roll_too(model, rolled_loops, tmp_path):
    pols = policies(model, str(tmp_path / "head"))
    want = serve(Engine(model, **KW), model, pols)
    assert rolled_loops == []
    got = serve(Engine(model, **KW, rolled_from_tokens=8), model, pols)
    assert got == want
    # SpeContext's tap splits the loop before its layer: two rolled ranges per tap step
    assert 1 in rolled_loops and model.config.num_layers in rolled_loops


def test_rolled_from_tokens_is_checked():
    from jaxkv.engine.config import EngineConfig

    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="rolled_from_tokens"):
            EngineConfig(rolled_from_tokens=bad)
    assert EngineConfig(rolled_from_tokens=0).rolled_from_tokens == 0
