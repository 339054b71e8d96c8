"""Prefill through the CPU attention path (pallas_kernels/paged_attention/dense.py) in the engine: query
blocks that skip the tiles none of their queries sees give the tokens of the dense causal model, on the tiny
checkpoints and, where installed, on SmolLM2 against transformers."""

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.sampling import SamplingParams
from pallas_kernels.paged_attention import dense
from tests.hf_tiny import make_tiny_checkpoint
from tests.test_generate import dense_greedy_batch, prompts_for


@pytest.fixture
def small_blocks(monkeypatch):
    """4-query blocks over 8-slot tiles, so short prompts cross many blocks and tiles. The step programs are
    traced afresh (module constants are read at trace time) and dropped afterwards."""
    monkeypatch.setattr(dense, "Q_BLOCK", 4)
    monkeypatch.setattr(dense, "TILE_SLOTS", 8)
    monkeypatch.setattr(dense, "DECODE_TILE_SLOTS", 8)  # decode steps too
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_chunked_prefill_over_query_blocks_equals_dense_argmax(family, small_blocks, tmp_path):
    # Mistral's window heads are rings shorter than these prompts: their old tiles are skipped by the window,
    # the global heads' future tiles by causality; 16-token chunks put 4 blocks in every prefill step.
    model = jaxkv.load(make_tiny_checkpoint(family, tmp_path))
    assert jax.default_backend() != "gpu"  # the dense path is the default off the GPU
    prompts = prompts_for(model, [37, 9, 50], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = jaxkv.generate(model, prompts, sp, page_size=4, max_step_tokens=16, max_num_seqs=2)
    assert [o.token_ids for o in outs] == dense_greedy_batch(model, prompts, 12)


@pytest.mark.slow
def test_smollm2_long_prompt_greedy_tokens_match_transformers():
    """A 700-token prompt prefills in two chunks (512 + 188 tokens: query blocks of 256, future tiles
    skipped); the greedy continuation equals transformers' on the same GGUF weights (`generate`, and the
    benchmark's cached loop)."""
    torch = pytest.importorskip("torch")
    from benchmarks.cpu_real import prompt_ids, run_transformers
    from tests.test_gguf import hf_gguf, smollm2_path

    path = smollm2_path()
    model = jaxkv.load(path, dtype="float32")
    ids = prompt_ids(model.tokenizer, 700)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = jaxkv.generate(model, [ids], sp, max_step_tokens=512, max_model_len=1024)
    hf = hf_gguf(path)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.token_ids == gen[0, len(ids):].tolist()
    assert len(np.unique(out.token_ids)) > 1  # a real continuation, not one repeated token
    # benchmarks.cpu_real times transformers' decode as its own cached greedy loop: generate's tokens
    assert run_transformers(hf, ids, 8)["tokens"] == out.token_ids
