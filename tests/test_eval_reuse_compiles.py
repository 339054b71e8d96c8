"""The reuse eval compiles its programs on the first instance of a context: later instances, whose segments
have other lengths in pages, whose prompts with their answers straddle the engine's power-of-two bucket and
whose segments push earlier ones out of the pool, compile nothing (but the second request's one-off clearing
of the first one's table row) and give the tokens and first-token logits of a fresh engine per instance; with
RedKnot's FFN reuse, segments of new lengths also keep and place their FFN outputs without a new program."""

import numpy as np
import pytest

from tests.hf_tiny import make_tiny_checkpoint

# name -> reuse-policy fields; RedKnot's FFN reuse also places each segment's kept FFN outputs per prompt
METHODS = {"naive": {}, "cacheblend": {}, "redknot": {},
           "redknot-ffn": {"ffn_reuse": True, "ffn_select": "deviation"}}
PREFIX = [1] + [5 + j % 50 for j in range(19)]
SUFFIX = [60 + j % 30 for j in range(20)]


def seg(n: int, k: int) -> list[int]:
    return [7 + (k * 31 + j * 7) % 100 for j in range(n)]


# Two segments of 369 tokens in all per prompt, split differently: with the BOS anchor's page each one is
# prefilled into 10 to 16 pages, counts no earlier prompt had, while the pass's token and row buckets (436
# slots with the page-alignment holes) stay those of the first.
SPLITS = ((129, 240), (145, 224), (161, 208), (177, 192))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import jaxkv

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("m"), max_position_embeddings=4096)
    return jaxkv.load(path)


def pieces_of(i: int, split, extra: int = 0):
    from jaxkv.eval.registry import PromptPieces

    return PromptPieces(PREFIX, [seg(n, 2 * i + k) for k, n in enumerate(split)], SUFFIX + [9] * extra)


def compiled() -> int:
    """XLA programs built or loaded from the persistent compilation cache so far."""
    from jaxkv.engine import compilations

    compilations.install()
    return sum(compilations.xla_programs().values())


def compiled_names(run) -> set[str]:
    """The functions `run()` compiled programs of."""
    from jaxkv.engine import compilations

    compilations.install()
    before = compilations.seconds()[1]
    run()
    return {k for k, v in compilations.seconds()[1].items() if v != before.get(k)}


@pytest.mark.parametrize("label", METHODS)
def test_instances_after_the_first_compile_nothing_and_match_a_fresh_engine(model, label):
    from jaxkv.eval.registry import get_method

    name, opts = label.split("-")[0], METHODS[label]
    method = get_method(name, model, **opts)
    prompts = [pieces_of(i, split) for i, split in enumerate(SPLITS)]
    outs = [method.run(prompts[0], 8, ())]
    # the second request compiles the clearing of the first one's device-table row, once per engine
    before = compiled()
    assert compiled_names(lambda: outs.append(method.run(prompts[1], 8, ()))) <= {"jit(_clear)"}
    assert compiled() - before <= 1
    before = compiled()
    outs += [method.run(p, 8, ()) for p in prompts[2:]]
    assert compiled() == before, f"{name}: later instances compiled {compiled() - before} programs"
    for p, out in zip(prompts, outs, strict=True):
        ref = get_method(name, model, **opts).run(p, 8, ())  # a new engine for this prompt alone
        assert out.token_ids == ref.token_ids and len(out.token_ids) == 8
        assert np.array_equal(out.first_logits, ref.first_logits)


def test_a_prompt_just_past_the_bucket_keeps_the_engine(model):
    """A 1,014-token prompt with 8 answer tokens fits the 1,024-token bucket, one of 1,026 does not: the
    eval keeps the engine it has (its context and pool hold both) instead of building one for 2,048 tokens
    and compiling everything again, and gives the tokens a fresh engine gives."""
    from jaxkv.eval.registry import get_method

    method = get_method("naive", model)
    small, large = pieces_of(0, (487, 487)), pieces_of(1, (487, 487), extra=12)
    assert len(small.ids) + 8 <= 1024 < len(large.ids) + 8
    method.run(small, 8, ())
    method.run(pieces_of(2, (487, 487)), 8, ())  # the second request's one-off program (above)
    eng, before = method.engine, compiled()
    out = method.run(large, 8, ())
    assert method.engine is eng and compiled() == before
    ref = get_method("naive", model)
    assert ref.run(large, 8, ()).token_ids == out.token_ids and ref.engine.max_model_len > eng.max_model_len
    # Every prompt leaves 2 x 31 pages per head of segments in a pool of 4 x 96: the next ones drop the
    # oldest (copies to host memory would compile gathers per segment size) and compile nothing.
    before = compiled()
    for i in range(3, 7):
        method.run(pieces_of(i, (487, 487)), 8, ())
    assert eng.reuser.tiers.drops > 0 and method.engine is eng and compiled() == before
