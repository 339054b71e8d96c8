"""The engine's typed configuration: flat keywords map onto the config tree, unknown options and bad sizes
are refused, and an engine built from a config equals one built from the same keywords."""

import dataclasses

import pytest

from jaxkv.engine.config import EngineConfig, RetrievalConfig, SegmentConfig


def test_flat_keywords_fill_the_sections():
    c = EngineConfig.from_kwargs(page_size=8, retrieval_host_tier=True, retrieval_host_pages=64,
                                 segment_anchor="none", segment_ffn_cache_bytes=1 << 20)
    assert c.page_size == 8
    assert c.retrieval == RetrievalConfig(host_tier=True, host_pages=64)
    assert c.segments == SegmentConfig(anchor="none", ffn_cache_bytes=1 << 20)
    base = EngineConfig(max_num_seqs=4)
    assert EngineConfig.from_kwargs(base, retrieval_resident=3.0).max_num_seqs == 4  # overrides keep the rest
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 16


@pytest.mark.parametrize("bad, match", [({"retrieval_nonsense": 1}, "unknown option 'retrieval_nonsense'"),
                                        ({"pagesize": 16}, "unknown option 'pagesize'")])
def test_unknown_options_are_refused(bad, match):
    with pytest.raises(TypeError, match=match):
        EngineConfig.from_kwargs(**bad)


@pytest.mark.parametrize("name", ["page_size", "max_num_seqs", "max_step_tokens", "decode_steps"])
def test_sizes_must_be_positive_integers(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer"):
        EngineConfig(**{name: 0})
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: True})


def test_engine_from_config_equals_engine_from_keywords(tmp_path):
    import jaxkv
    from jaxkv.engine.engine import Engine
    from tests.hf_tiny import make_tiny_checkpoint

    toy_model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path / "llama"))
    kw = dict(num_pages=256, page_size=8, max_num_seqs=2, max_step_tokens=32, max_model_len=128)
    a = Engine(toy_model, EngineConfig(**kw))
    b = Engine(toy_model, **kw)
    assert a.config == b.config and a.allocator.num_pages == b.allocator.num_pages == 256
    assert (a.page_size, a.max_model_len) == (8, 128)
