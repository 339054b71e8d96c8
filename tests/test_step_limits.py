"""`max_step_tokens` bounds what one forward writes and attends, not what a multi-step decode call reserves.

A multi-step decode call reserves its K tokens at once but writes and attends them one per step, so a K
larger than `max_step_tokens` (which sizes the local heads' rings) is legal; before, such a call raised
"tokens in one step exceed max_step_tokens" and every request of a server started with a small
`--max-step-tokens` failed.
"""

import numpy as np
import pytest

import jaxkv
from jaxkv.cache.head_classes import HeadClass, HeadClassMap
from jaxkv.engine.engine import Engine
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-step-limits")))


def _windowed(model, sink=2, window=6) -> HeadClassMap:
    """Every other head local with a ring of a few slots, so decoding wraps it many times."""
    cfg = model.config
    row = tuple(HeadClass.local(sink, window) if h % 2 == 0 else HeadClass.global_()
                for h in range(cfg.num_kv_heads))
    return HeadClassMap(cfg.num_layers, cfg.num_kv_heads, (row,) * cfg.num_layers)


def _generate(model, prompts, max_tokens, **kw):
    engine = Engine(model, page_size=4, max_model_len=96, max_num_seqs=2, enable_prefix_caching=False,
                    head_classes=_windowed(model), **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert engine.allocator.num_free == engine.allocator.num_pages
    return [got[i] for i in ids], engine


@pytest.mark.parametrize("max_step_tokens", [1, 3])
def test_decode_calls_longer_than_a_step_with_windowed_heads(llama, max_step_tokens):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, llama.config.vocab_size, size=n).tolist() for n in (7, 12)]
    many, engine = _generate(llama, prompts, 40, max_step_tokens=max_step_tokens, decode_steps=16)
    assert engine.tables.local.any() and engine.decode_steps > max_step_tokens
    # The reference: one token per request per step, each step within max_step_tokens.
    one, _ = _generate(llama, prompts, 40, max_step_tokens=max_step_tokens, decode_steps=1)
    assert many == one
    assert [len(t) for t in many] == [40, 40]
