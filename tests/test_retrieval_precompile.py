"""Retrieval programs (SpeContext's and Quest's ragged steps with the tap and their decodes) compile on the
warm-up pool beside the step programs, are installed where the retriever calls them, and are kept in the
step cache: after precompile a SpeContext and a Quest request compile nothing and give the tokens of an
engine that compiles as it goes; a second process on the same step cache loads them instead."""

import json
import os
import subprocess
import sys

import pytest

import jaxkv
from jaxkv.engine.engine import Engine
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint

KW = dict(page_size=8, max_model_len=64, max_num_seqs=2, max_step_tokens=16, decode_steps=4,
          enable_prefix_caching=False)


def engine(model):
    return Engine(model, **KW)


def policies(model, head_dir: str):
    """SpeContext with a random retrieval head saved in `head_dir` (made there when absent), and Quest, both
    at a budget below the prompts' lengths (the selection really selects)."""
    from pathlib import Path

    import jax

    from jaxkv.policies.retrieve import specontext as sc
    from jaxkv.policies.retrieve.quest import Quest

    if not (Path(head_dir) / "config.json").exists():
        cfg = sc.HeadConfig.for_model(model.config, tap_layer=1, model_id=model.model_id)
        sc.save_head(head_dir, sc.init_head(cfg, jax.random.key(1)), {"random": True})
    return [sc.SpeContext(head_dir=head_dir, budget=16), Quest(budget=16, dense_layers=1)]


def serve(eng, model, pols) -> list[list[int]]:
    """Per policy: a greedy request of 30 tokens beside a sampled one of 12 (its decode tokens share ragged
    steps with the other's prefill: the K = 1 path), run to the end; their tokens."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for pol in pols:
        ids = [eng.add_request(rng.integers(3, model.config.vocab_size, size=n).tolist(), sp, kv_policy=pol)
               for n, sp in [(30, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
                             (12, SamplingParams(temperature=0.7, max_tokens=9, seed=1, ignore_eos=True))]]
        got = {i: [] for i in ids}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        out += [got[i] for i in ids]
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-retrieval-precompile"))
    return path, jaxkv.load(path)


def test_precompiled_retrieval_programs_serve_without_compiling(llama, tmp_path):
    from jaxkv.engine import compilations, programs
    from jaxkv.engine.warmup import variants

    compilations.install()
    _, model = llama
    pols = policies(model, str(tmp_path / "head"))
    probe = engine(model)
    steps = sum(len(probe.retriever.programs(p)) for p in pols)
    eng = engine(model)
    n = eng.precompile(progress=False, step_cache=False, retrieval=pols)
    assert len(eng.retriever.compiled) == steps > 0  # every retrieval program installed, none left to jit
    assert n == len(eng.runner.compiled) + steps
    # SpeContext keeps a device state: plain steps run its tap programs, so the runner keeps only decodes
    assert type(eng.retriever.every_step) is type(pols[0]) and eng.runner.step_tap is eng.retriever
    assert len(eng.runner.compiled) == sum(v[0] == "decode" for v in variants(eng)) > 0
    counts = lambda: (compilations.step_programs(), compilations.xla_programs()["compiled"],  # noqa: E731
                      programs.installed("retriever"))
    before = counts()
    tokens = serve(eng, model, pols)
    after = counts()
    assert after == before, f"compiled while serving: {before} -> {after}"
    lazy = engine(model)
    assert serve(lazy, model, pols) == tokens and not lazy.retriever.compiled
    assert all(len(t) == n for t, n in zip(tokens, [20, 9, 20, 9]))


def test_one_step_decodes_of_few_sequences_are_precompiled(llama):
    """With decode_steps=1 a decode of one request (the 2-row bucket, below every ragged step's row count)
    runs a precompiled program."""
    from jaxkv.engine import compilations
    from jaxkv.engine.engine import _resolve_policy

    _, model = llama
    quest = _resolve_policy("quest", None, model)
    eng = Engine(model, **{**KW, "max_num_seqs": 8, "decode_steps": 1})
    eng.precompile(progress=False, step_cache=False, retrieval=[quest])
    before = (compilations.step_programs(), compilations.xla_programs()["compiled"])
    eng.add_request(list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                    kv_policy=quest)
    while eng.has_unfinished():
        eng.step()
    assert (compilations.step_programs(), compilations.xla_programs()["compiled"]) == before


def test_retrieval_programs_round_trip_through_the_step_cache(llama, tmp_path):
    """Each side in a fresh process (XLA:CPU serializes a program completely only when no earlier compile of
    the process defined its kernels)."""
    ckpt, model = llama
    head_dir = tmp_path / "head"
    policies(model, str(head_dir))  # one head on disk for both sides
    env = {**os.environ, "JAXKV_COMPILATION_CACHE": "", "JAX_PLATFORMS": "cpu"}

    def side(phase):
        out = subprocess.run([sys.executable, "-m", "tests._retrieval_cache_worker", phase, str(ckpt),
                              str(tmp_path / "steps"), str(head_dir)], env=env, capture_output=True,
                             text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    wrote = side("write")
    assert wrote["hits"] == 0 and wrote["kept"] == wrote["programs"] > wrote["retrieval_programs"] > 0
    read = side("read")
    assert read["hits"] == wrote["programs"]  # the retrieval programs too: nothing traced or compiled
    assert read["retrieval_programs"] == wrote["retrieval_programs"]
    assert read["step_programs_while_serving"] == 0 and read["xla_programs_while_serving"] == 0
    assert read["tokens"] == wrote["reference_tokens"]


def test_split_off_decode_tokens_run_one_step_of_the_k_step_program(llama, tmp_path):
    """Decode tokens that share a ragged step with a prefill run the first step of the K-step decode program
    (it stops at the first step no row reserved), so precompile has no one-step decodes, and the tokens are
    those of an engine that decodes one step per call."""
    _, model = llama
    pols = policies(model, str(tmp_path / "head"))
    eng = engine(model)
    for pol in pols:
        decodes = [p for p in eng.retriever.programs(pol) if p[0] == "decode"]
        assert decodes and {p[2] for p in decodes} == {KW["decode_steps"]}
    one_step = Engine(model, **{**KW, "decode_steps": 1})
    assert serve(eng, model, pols) == serve(one_step, model, pols)
