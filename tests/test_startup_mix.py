"""After precompile, a request mix of every kind the engine precompiles compiles nothing: plain greedy and
sampled requests of short and long prompts, n > 1, compression presses, every segment-reuse method on
registered segments and SpeContext (a random retrieval head made by the project's head code). The mix is
the startup benchmark's (benchmarks/startup.py), counted by the engine's compile counters."""

import pytest

import jaxkv
from benchmarks.startup import REUSE_METHODS, parse_args, random_retrieval_head, request_mix
from jaxkv.engine import code_maps, compilations
from jaxkv.engine.engine import Engine
from jaxkv.engine.warmup import sampler_forms
from jaxkv.policies.reuse.apply import reuse_prefill
from tests.hf_tiny import make_tiny_checkpoint

PRESSES = ["snapkv", "streaming_llm"]
KINDS = ["greedy", "sampled", "n=4", *(f"press:{p}" for p in PRESSES), *(f"reuse:{m}" for m in REUSE_METHODS),
         "retrieval:specontext"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-startup-mix")))


def _engine(model):
    return Engine(model, page_size=8, max_model_len=192, max_num_seqs=2, max_step_tokens=16, decode_steps=4,
                  enable_prefix_caching=False)


def test_precompiled_mix_of_every_precompiled_kind_compiles_nothing(llama):
    # Earlier tests of this process may have brought XLA:CPU near the memory-mapping cap, where the engine's
    # guard (jaxkv/engine/code_maps.py) would drop the precompiled programs mid-mix: start from none.
    code_maps.clear_compiled()
    engine = _engine(llama)
    retrieval = random_retrieval_head(llama)
    n = engine.precompile(progress=False, presses=PRESSES, retrieval=[retrieval])
    counted, jitted = compilations.step_programs(), reuse_prefill._cache_size()
    passes = engine.precompile_reuse(list(REUSE_METHODS), progress=False)
    # 192-token context: the selection CacheBlend and SparseX share (one token bucket, 256) and the steps
    # from their selection layer they share (the largest step bucket, 16 < 256 tokens: greedy and sampled),
    # RedKnot's one bucket (256), the page copy naive and EPIC run before their ragged steps (one
    # page-table width class), and the two-row step table all of them build on the device; every program
    # compiled on the warm-up pool and installed (none through jit), counted with the step programs
    assert len(engine._page_buckets) == 1 and {engine.step_rows(T) for T in engine._token_buckets} == {2}
    steps = len(sampler_forms(engine))
    assert passes == len(engine.reuser.compiled) == 1 + steps + 1 + 1 + 1
    assert reuse_prefill._cache_size() == jitted and compilations.step_programs() - counted == passes
    assert n > len(engine.runner.compiled) > 0  # the retrieval variants come on top of the step variants
    by_kind = engine.precompiled_by_variant  # both precompiles, per variant kind
    assert sum(by_kind.values()) == n + passes and by_kind["reuse redknot"] == 1
    assert by_kind["retrieval decode"] == len(engine.retriever.decode_seq_buckets(retrieval)) * steps
    mix = request_mix(engine, llama.config.vocab_size, retrieval=retrieval, compilations=compilations,
                      presses=PRESSES, kinds=KINDS)
    assert sorted(mix["compiled_per_kind"]) == sorted(KINDS)  # every kind ran (reuse needs global heads)
    assert mix["requests"] == 3 + 3 + 4 + len(PRESSES) + len(REUSE_METHODS) + 2  # prompts of 5, 32, 64 tokens
    assert engine.compressor.num_compressions == len(PRESSES)
    compiled = {k: v for k, v in mix["compiled_per_kind"].items() if any(v.values())}
    assert compiled == {}, f"compiled after ready: {compiled}"
    # The same mix on an engine that compiles as it goes gives the same tokens.
    lazy = _engine(llama)
    again = request_mix(lazy, llama.config.vocab_size, retrieval=retrieval, presses=PRESSES, kinds=KINDS)
    assert again["digest"] == mix["digest"] and not lazy.runner.compiled


def test_startup_benchmark_precompiles_redknot_unless_asked_for_more(capsys):
    """At the GPU configuration CacheBlend and SparseX are 76 passes each, so the benchmark's default is
    RedKnot's 19 and naive's and EPIC's page copy; `all` or a list asks for more, and an unknown name is
    refused at parsing."""
    assert parse_args([]).precompile_reuse == parse_args(["--precompile-reuse", "all"]).precompile_reuse
    assert parse_args(["--precompile-reuse", "all"]).precompile_reuse == list(REUSE_METHODS)
    assert parse_args(["--precompile-reuse", "naive, sparsex"]).precompile_reuse == ["naive", "sparsex"]
    assert parse_args(["--precompile-reuse", ""]).precompile_reuse == []
    with pytest.raises(SystemExit):
        parse_args(["--precompile-reuse", "naive,nope"])
    assert "unknown reuse method 'nope'" in capsys.readouterr().err


def test_reuse_passes_load_from_the_step_cache_in_a_second_process(tmp_path):
    """A second process building the same engine loads every reuse pass of two methods from the step cache
    (no XLA compile in the precompile), serves a request of each without compiling a pass and gives the
    tokens of jit's own path, also when the passes load in the background while it serves."""
    import json
    import os
    import subprocess
    import sys

    ckpt = make_tiny_checkpoint("llama", tmp_path / "ckpt")
    env = {**os.environ, "JAXKV_COMPILATION_CACHE": "", "JAX_PLATFORMS": "cpu"}

    def side(phase):
        out = subprocess.run([sys.executable, "-m", "tests._reuse_cache_worker", phase, str(ckpt),
                              str(tmp_path / "steps")], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    wrote = side("write")
    # 128-token context: naive's page copy (its tokens run as the step programs; one page-table width
    # class) and the table of a two-row step it builds on the device; RedKnot's one bucket (128)
    assert wrote["passes"] == wrote["installed"] == wrote["kept"] == 1 + 1 + 1 and wrote["hits"] == 0
    assert wrote["compiled_in_precompile"] >= wrote["passes"]
    read = side("read")
    assert read["hits"] == read["installed"] == wrote["passes"] and read["compiled_in_precompile"] == 0
    assert read["passes_compiled_while_serving"] == 0
    assert read["tokens"] == wrote["reference_tokens"]
    assert read["background_hits"] == wrote["passes"] and read["background_compiled_while_serving"] == 0
    assert read["background_tokens"] == wrote["reference_tokens"]
    assert read["background_loaded"] == wrote["passes"] and read["background_pending"] == 0
