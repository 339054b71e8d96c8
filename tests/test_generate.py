"""Generation through the per-head paged cache: equals dense argmax, never retraces, samples correctly."""

import dataclasses

import numpy as np
import pytest

import jaxkv
from jaxkv.engine.engine import Engine
from jaxkv.engine.runner import num_compilations
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import FAMILIES, make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return jaxkv.load(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-gen")))


def prompts_for(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in lengths]


def dense_greedy(model, prompt, n):
    return dense_greedy_batch(model, [prompt], n)[0]


def dense_greedy_batch(model, prompts, n):
    """Argmax of `.logits` re-run on each growing sequence (all padded to one shape: causal, so exact)."""
    total = max(len(p) for p in prompts) + n
    ids = np.zeros((len(prompts), total), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    for step in range(n):
        logits = model.logits(ids)
        for i, p in enumerate(prompts):
            t = len(p) + step
            ids[i, t] = int(np.argmax(logits[i, t - 1]))
    return [ids[i, len(p):len(p) + n].tolist() for i, p in enumerate(prompts)]


def test_greedy_paged_decoding_equals_dense_argmax(model):
    # Small pages, chunked prefill (16-token steps) and fewer slots than prompts exercise page
    # crossings, ragged mixed prefill/decode batches and queueing. Mistral's window (shorter than these
    # sequences) runs its heads as rings of pages.
    prompts = prompts_for(model, [5, 23, 40])
    outs = jaxkv.generate(model, prompts, GREEDY, page_size=4, max_step_tokens=16, max_num_seqs=2)
    assert [o.token_ids for o in outs] == dense_greedy_batch(model, prompts, 64)
    assert all(o.finish_reason == "length" for o in outs)


def test_no_retrace_in_steady_decode(llama):
    engine = Engine(llama, page_size=16, max_model_len=64, max_num_seqs=1, max_step_tokens=64, decode_steps=1)
    engine.add_request(prompts_for(llama, [40])[0], SamplingParams(temperature=0.0, max_tokens=20,
                                                                    ignore_eos=True))
    engine.step()  # prefill: 40 tokens -> token bucket 64, pages bucket 4
    engine.step()  # first decode: token bucket 8
    compiled = num_compilations()
    for _ in range(15):  # positions 41..56 stay inside the same (1 seq, 8 tokens, 4 pages) bucket
        assert engine.step()
    assert num_compilations() == compiled


def test_seeded_sampling_is_reproducible_and_batch_independent(llama):
    prompt = prompts_for(llama, [12])[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = jaxkv.generate(llama, [prompt], sp)[0].token_ids
    others = prompts_for(llama, [7, 30], seed=5)
    mixed = [dataclasses.replace(sp, seed=7), sp, SamplingParams(temperature=0.0)]
    batched = jaxkv.generate(llama, [others[0], prompt, others[1]], mixed)
    assert batched[1].token_ids == alone
    other_seed = jaxkv.generate(llama, [prompt], dataclasses.replace(sp, seed=99))[0].token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llama):
    prompt = prompts_for(llama, [9])[0]
    sampled = jaxkv.generate(llama, [prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=16,
                                                             ignore_eos=True, seed=3))[0]
    assert sampled.token_ids == dense_greedy(llama, prompt, 16)


def test_stop_token_and_stop_string(llama):
    prompt = prompts_for(llama, [10])[0]
    full = jaxkv.generate(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    out = jaxkv.generate(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         stop_token_ids=(stop_id,)))[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"

    # A 3-character stop string from the middle of the text (random weights: avoid partial-byte chars).
    start = next(i for i in range(4, len(full.text) - 3) if "\ufffd" not in full.text[i:i + 3])
    stop = full.text[start:start + 3]
    out = jaxkv.generate(llama, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.find(stop)]


def test_tiny_pool_preempts_and_still_answers_everything(llama):
    prompts = prompts_for(llama, [20, 20, 20, 20], seed=11)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    L, H = llama.config.num_layers, llama.config.num_kv_heads
    # 40 tokens at page size 4 = 10 pages per head: room for ~1.5 sequences at once.
    engine = Engine(llama, page_size=4, num_pages=15 * L * H, max_num_seqs=4, max_step_tokens=32,
                    max_model_len=64)
    outs = jaxkv.generate(llama, prompts, sp, engine=engine)
    expected = jaxkv.generate(llama, prompts, sp, page_size=4)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert engine.stats().num_preemptions > 0  # the pool really was too small for the batch
    # Every page is back: free, or held only by the prefix cache (all heads global here).
    assert engine.allocator.num_free + engine.prefix.num_pages == engine.allocator.num_pages


def test_prefix_cache_hit_gives_same_tokens(llama):
    shared = prompts_for(llama, [33], seed=2)[0]
    a, b = shared + [5, 6, 7], shared + [9, 10]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = Engine(llama, page_size=4, max_model_len=64, max_num_seqs=2)
    first = jaxkv.generate(llama, [a], sp, engine=engine)[0]
    rid = engine.add_request(b, sp)
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens if out.request_id == rid else cached
    assert cached == 32  # 8 full pages of the shared 33-token prefix
    stats = engine.stats()
    assert stats.prefix_cache_hits >= 1 and stats.prefix_cache_hit_tokens == 32
    fresh = jaxkv.generate(llama, [a, b], sp, enable_prefix_caching=False)
    assert first.token_ids == fresh[0].token_ids
    assert jaxkv.generate(llama, [b], sp, engine=engine)[0].token_ids == fresh[1].token_ids


def test_bad_requests_fail_clearly(llama):
    engine = Engine(llama, max_model_len=32)
    with pytest.raises(ValueError, match="maximum model length"):
        engine.add_request(list(range(3, 40)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_pallas_attention_in_the_engine_matches_the_twin(tmp_path):
    # The Pallas kernel (interpret mode on CPU) at the engine's call site, on Mistral's ring-stored window
    # heads with chunked prefill: same tokens as the jnp twin.
    model = jaxkv.load(make_tiny_checkpoint("mistral", tmp_path))
    prompts = prompts_for(model, [6, 19], seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(page_size=4, max_step_tokens=16)
    pallas = jaxkv.generate(model, prompts, sp, attn_impl="pallas", **kw)
    reference = jaxkv.generate(model, prompts, sp, attn_impl="reference", **kw)
    assert [o.token_ids for o in pallas] == [o.token_ids for o in reference]
