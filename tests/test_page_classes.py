"""Page-table width classes: a step compiles once per class, so fewer classes mean fewer programs. A wider
table than a step needs changes no token (each sequence's attention follows its own length), and one class
serves a mix of short and long prompts after precompile without compiling."""

import jax
import pytest

import jaxkv
from jaxkv.engine import compilations, warmup
from jaxkv.engine.config import EngineConfig
from jaxkv.engine.engine import Engine, page_classes
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint
from tests.test_engine import prompts_for
from tests.test_sampler_programs import _run

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-page-classes")))


def _engine(model, **kw):
    # 512 tokens (the tiny model's positions) at page 2: 256 pages, classes of 32 and 256 pages
    return Engine(model, page_size=2, max_model_len=512, max_num_seqs=2, max_step_tokens=64,
                  enable_prefix_caching=False, **kw)


def test_classes_are_the_widest_ones_asked_for():
    assert page_classes(2048, 2049) == (32, 256, 2049)
    assert page_classes(2048, 2049, 2) == (256, 2049)
    assert page_classes(2048, 2049, 1) == page_classes(2048, 2049, 7)[-1:] == (2049,)
    assert page_classes(20, 22) == (22,)  # a context narrower than the narrowest class: one width


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1", True])
def test_page_classes_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="page_classes"):
        EngineConfig(page_classes=bad)


def test_default_is_one_class_off_the_cpu(llama):
    widths = _engine(llama)._page_buckets
    assert len(widths) == (2 if jax.default_backend() == "cpu" else 1)
    assert _engine(llama, page_classes=1)._page_buckets == widths[-1:]
    assert _engine(llama, page_classes=1).page_widths == widths[-1:]


def test_one_class_compiles_half_the_steps_and_changes_no_token(llama):
    every, one = _engine(llama, page_classes=2), _engine(llama, page_classes=1)
    assert every._page_buckets == (32, 256) and one._page_buckets == (256,)
    fresh = sum(v[5] for v in warmup.variants(one))  # a fresh prompt's width follows its length
    assert len(warmup.variants(every)) - fresh == 2 * (len(warmup.variants(one)) - fresh)
    # prompts in the narrow class (20 tokens: 10 pages) and the wide one (300 tokens: 150 pages)
    prompts = prompts_for(llama, [20, 300, 9], seed=5)
    samplings = [GREEDY, SAMPLED, GREEDY]
    assert _run(one, prompts, samplings) == _run(every, prompts, samplings)


def test_one_class_serves_short_and_long_prompts_without_compiling(llama):
    engine = _engine(llama, page_classes=1)
    engine.precompile(progress=False, step_cache=False)
    before = compilations.step_programs()
    prompts = prompts_for(llama, [7, 150, 33], seed=6)
    _run(engine, prompts, [GREEDY, SAMPLED, GREEDY])
    assert compilations.step_programs() == before


def test_a_segments_own_prefill_runs_a_precompiled_step(llama):
    """A segment's prefill is a ragged step of the scheduler's shape (its rows padded to the step's), so
    registering one after precompile compiles nothing."""
    engine = _engine(llama, page_classes=1)
    engine.precompile(progress=False, step_cache=False)
    before = compilations.step_programs()
    for n in (40, 150):
        engine.register_segment(prompts_for(llama, [n], seed=n)[0], frozen=True)
    assert compilations.step_programs() == before
