"""A reuse prompt whose tokens fit the context fits however its segments' page-alignment holes fall: the
engine's pages per head have slack for them (`segment_max_segments`), while positions stay within
max_model_len. Beyond the slack a request is refused with the engine's reason."""

import pytest

from tests.hf_tiny import make_tiny_checkpoint

# 8 segments of 17 tokens: each starts on a fresh 16-slot page, so the layout takes 8 more pages per head than
# its 228 tokens; with the answer's page, more than the 16 pages per head of a 256-token context.
SEGMENTS = [[5 + (i * 17 + j) % 90 for j in range(17)] for i in range(8)]
PREFIX, SUFFIX = [1], list(range(3, 94))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import jaxkv

    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("m"), max_position_embeddings=256)
    return jaxkv.load(path)


def engine(model, **kw):
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine

    cfg = model.config
    kw = {"page_size": 16, **kw}
    return Engine(model, max_model_len=256, max_num_seqs=1, enable_prefix_caching=False,
                  head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), **kw)


def test_eight_segments_fit_the_whole_context_as_with_a_larger_one(model, tmp_path):
    import jaxkv
    from jaxkv.eval.registry import PromptPieces, get_method

    pieces = PromptPieces(PREFIX, SEGMENTS, SUFFIX)
    assert len(pieces.ids) + 16 <= 256  # the tokens fit the context
    method = get_method("naive", model)
    out = method.run(pieces, max_new_tokens=16, stop_ids=())
    eng = method.engine
    assert eng.max_model_len == 256 and eng.max_pages_per_head > 256 // 16
    assert len(out.token_ids) == 16
    # the same checkpoint with a context large enough for the holes anyway: the same tokens
    larger = jaxkv.load(make_tiny_checkpoint("llama", tmp_path / "l", max_position_embeddings=512))
    ref = get_method("naive", larger)
    assert ref.run(pieces, max_new_tokens=16, stop_ids=()).token_ids == out.token_ids
    assert ref.engine.max_model_len == 512


def test_a_layout_beyond_the_slack_is_refused_with_the_reason(model):
    from jaxkv.sampling import SamplingParams

    eng = engine(model, segment_max_segments=2)  # 16 + 3 pages per head: 8 segments' holes need more
    assert eng.max_pages_per_head == 19
    rid = eng.add_reuse_request(PREFIX, SEGMENTS, SUFFIX, reuse="naive",
                                sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    outs = [o for _ in range(3) for o in eng.step()]
    assert [o.request_id for o in outs] == [rid] and outs[0].finish_reason == "abort"
    assert "does not fit" in outs[0].text and "segment_max_segments >= 8" in outs[0].text
    assert not eng.has_unfinished() and not any(eng.stats().pages_in_use_by_class.values())


def test_tokens_beyond_the_context_are_refused_though_slack_pages_are_free(model):
    eng = engine(model, segment_max_segments=8)
    long = [[5 + j % 90 for j in range(100)], [7 + j % 80 for j in range(100)]]
    prefix, suffix = [1], list(range(3, 60))  # 258 tokens: the pages would hold them, the positions do not
    assert 258 <= eng.max_pages_per_head * eng.page_size
    with pytest.raises(ValueError, match="maximum model length is 256"):
        eng.add_reuse_request(prefix, long, suffix, reuse="naive")


def test_slack_widens_the_widest_page_class_and_adds_no_step_variant(model):
    from jaxkv.engine import warmup

    plain, slack = engine(model, page_size=4), engine(model, page_size=4, segment_max_segments=16)
    assert plain._page_buckets == (32, 64) and slack._page_buckets == (32, 64 + 17)
    assert len(warmup.variants(slack)) == len(warmup.variants(plain))


def test_slack_of_segments_plus_one_pages_holds_every_layout_whose_tokens_fit():
    """The bound behind `max_segments + 1`: a prompt of S segments whose tokens and answer fit the context
    (8,192 tokens, page 16: SmolLM2's whole context with 16 documents) never needs more pages per head than
    the context's plus S + 1, whatever the lengths; with S pages alone some layouts do not fit."""
    import random

    from jaxkv.engine.reuse import generation_room, prompt_pages

    rng, ps, context, worst = random.Random(0), 16, 8192, 0
    for _ in range(2000):
        S = rng.randint(1, 16)
        lengths = [rng.randint(1, 600) for _ in range(S + 2)]  # prefix, segments, suffix
        total = sum(lengths)
        if total >= context:
            continue
        gen = rng.randint(1, context - total)
        layout = [(lengths[0], False)] + [(n, True) for n in lengths[1:-1]] + [(lengths[-1], False)]
        npg = prompt_pages(layout, ps)
        assert gen <= generation_room(npg, ps, context // ps + S + 1)
        worst = max(worst, npg + -(-gen // ps) - context // ps - S)
    assert worst == 1


def test_prompts_of_one_power_of_two_bucket_share_one_eval_engine(model):
    """The reuse eval keeps one engine (and its compiled programs) for every prompt within the first one's
    power-of-two bucket (at least 1,024 tokens), instead of a new engine each time a prompt is longer."""
    from jaxkv.eval.registry import PromptPieces, get_method

    method = get_method("naive", model)
    method.run(PromptPieces(PREFIX, SEGMENTS[:2], SUFFIX[:20]), max_new_tokens=4, stop_ids=())
    first = method.engine
    method.run(PromptPieces(PREFIX, SEGMENTS[:5], SUFFIX), max_new_tokens=4, stop_ids=())
    assert method.engine is first  # 56 and 177 tokens: one bucket
    # sized for the bucket, not the first prompt
    assert first.allocator.num_pages >= 4 * model.config.num_layers * model.config.num_kv_heads * (1024 // 16)
