"""Engine speed paths: multi-step decode equals single-step decode; no compile after precompile."""

import dataclasses

import numpy as np
import pytest

import jaxkv
from jaxkv.engine import warmup
from jaxkv.engine.engine import Engine
from jaxkv.engine.runner import num_compilations
from jaxkv.sampling import SamplingParams
from tests.hf_tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return jaxkv.load(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama-engine")))


def prompts_for(model, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, model.config.vocab_size, size=n).tolist() for n in lengths]


def run(model, prompts, samplings, **kw):
    kw = {"page_size": 4, "max_model_len": 64, "max_num_seqs": 4, "max_step_tokens": 16, **kw}
    engine = Engine(model, enable_prefix_caching=False, **kw)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, samplings)]
    got = {i: [] for i in ids}
    per_step = []
    while engine.has_unfinished():
        outs = engine.step()
        per_step.append(outs)
        for o in outs:
            assert len(o.new_token_ids) == 1  # streaming stays token by token
            got[o.request_id] += o.new_token_ids
    assert engine.allocator.num_free == engine.allocator.num_pages  # reserved-ahead pages all returned
    return [got[i] for i in ids], per_step, engine


def test_multistep_decode_equals_single_step(llama):
    prompts = prompts_for(llama, [5, 11, 17])
    greedy = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=13, seed=5, ignore_eos=True)
    samplings = [greedy, sampled, dataclasses.replace(greedy, max_tokens=30)]
    one, _, _ = run(llama, prompts, samplings, decode_steps=1)
    many, steps, _ = run(llama, prompts, samplings, decode_steps=8)
    assert many == one
    assert [len(t) for t in many] == [21, 13, 30]
    assert max(len(s) for s in steps) > len(prompts)  # some call really produced several tokens per request


def test_multistep_stops_on_device_at_a_stop_token(llama):
    prompt = prompts_for(llama, [9], seed=3)[0]
    full, _, _ = run(llama, [prompt], [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)],
                     decode_steps=1)
    stop_id = full[0][10]
    first = full[0].index(stop_id)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,))
    many, _, _ = run(llama, [prompt], [sp], decode_steps=16)
    assert many[0] == full[0][:first + 1]


def test_decode_call_skips_the_steps_no_row_runs(llama):
    """Off the GPU a 16-step call for a request with 3 tokens left runs 3 steps: the skipped steps return
    zeros (a computed step has a log-probability < 0), and the tokens equal single-step decode's."""
    prompts = prompts_for(llama, [7, 12], seed=4)
    samplings = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    engine = Engine(llama, enable_prefix_caching=False, page_size=4, max_model_len=64, max_num_seqs=2,
                    max_step_tokens=32, decode_steps=16)
    calls = []
    decode = engine.runner.decode
    engine.runner.decode = lambda batch: calls.append(decode(batch)) or calls[-1]
    ids = [engine.add_request(p, s) for p, s in zip(prompts, samplings)]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    one, _, _ = run(llama, prompts, samplings, decode_steps=1)
    assert [got[i] for i in ids] == one
    assert len(calls) == 1  # both prompts in one prefill step, then one decode call of 16 steps
    tokens, logprobs, ran = calls[0].result()
    assert tokens.shape[0] == 16 and ran[:, :2].sum(axis=0).tolist() == [3, 5]
    assert (logprobs[:5, 1] < 0).all() and not logprobs[5:].any() and not tokens[5:].any()


def test_no_new_compilation_after_precompile(llama):
    engine = Engine(llama, page_size=8, max_model_len=48, max_num_seqs=2, max_step_tokens=16, decode_steps=4)
    n = engine.precompile(progress=False)
    assert n > 0
    compiled = num_compilations()
    mix = [(prompts_for(llama, [3])[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
           (prompts_for(llama, [30], seed=1)[0], SamplingParams(temperature=0.7, max_tokens=9, seed=1)),
           (prompts_for(llama, [12], seed=2)[0], SamplingParams(temperature=0.0, top_k=3, max_tokens=5,
                                                                stop_token_ids=(7, 8)))]
    assert len(engine.runner.compiled) == n  # compiled ahead of time, called directly

    def outputs(eng):
        ids = [eng.add_request(prompt, sp) for prompt, sp in mix]
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[i] for i in ids]

    got = outputs(engine)
    assert num_compilations() == compiled
    # The programs compiled ahead of time give the tokens jit's own path gives.
    lazy = Engine(llama, page_size=8, max_model_len=48, max_num_seqs=2, max_step_tokens=16, decode_steps=4)
    assert outputs(lazy) == got and not lazy.runner.compiled


def test_precompile_records_the_largest_step_and_refuses_one_that_cannot_fit(llama):
    """Precompile keeps the largest scratch (XLA temporaries + outputs) of its programs; a configuration
    whose largest variant cannot fit beside the pool is refused naming the flags to change."""
    from jaxkv.engine.warmup import check_fits, scratch_bytes

    engine = Engine(llama, page_size=8, max_model_len=48, max_num_seqs=2, max_step_tokens=16, decode_steps=4)
    engine.precompile(progress=False)
    need, variant = engine.largest_step_scratch
    assert need > 0 and variant[0] in ("step", "decode")
    assert need == max(scratch_bytes(c) for c in engine.runner.compiled.values())
    check_fits(need, variant, free=need)
    with pytest.raises(MemoryError, match="--max-step-tokens or --max-num-seqs"):
        check_fits(need, variant, free=need - 1)


def test_precompiled_presses_compress_any_budget_without_a_compile(llama):
    """Precompile with presses: requests under those presses at budgets never seen, several due at once,
    compress without compiling and give the tokens of an engine that compiles them as they come."""
    from jaxkv.policies import apply as compress_apply
    from jaxkv.policies import get_policy

    kw = dict(page_size=8, max_model_len=48, max_num_seqs=4, max_step_tokens=16, decode_steps=4)
    presses = [get_policy("snapkv", window=4, sink=2), get_policy("h2o", window=4, sink=2)]
    mix = [(p, b, prompt) for p, b in ((presses[0], 0.3), (presses[1], 0.5), (presses[0], 12))
           for prompt in prompts_for(llama, [30, 24], seed=int(b * 10))]

    def outputs(eng):
        ids = [eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                               kv_policy=p, kv_budget=b) for p, b, prompt in mix]
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[i] for i in ids]

    engine = Engine(llama, **kw)
    n = engine.precompile(progress=False, presses=presses)
    assert len(engine.compressor.compiled) == len(warmup.press_programs(engine, presses)) == 2
    assert n == len(warmup.variants(engine)) + 2
    before = compress_apply.num_compilations()
    got = outputs(engine)
    assert engine.compressor.num_compressions >= 3 and compress_apply.num_compilations() == before
    lazy = Engine(llama, **kw)
    assert outputs(lazy) == got and compress_apply.num_compilations() > before


def test_precompiled_logprob_variants_serve_logprobs_and_echo_without_a_compile(llama):
    """`precompile(logprobs=True)` adds the logprob variants (alternatives; prompt logprobs for echo): a mix
    of such requests then compiles nothing, and the top alternatives equal jit's own path."""
    kw = dict(page_size=8, max_model_len=48, max_num_seqs=2, max_step_tokens=16, decode_steps=4)
    engine = Engine(llama, **kw)
    plain = len(warmup.variants(engine))
    n = engine.precompile(progress=False, logprobs=True)
    assert n == len(warmup.variants(engine, logprobs=True)) and plain < n < 3 * plain
    compiled = num_compilations()
    mix = [(prompts_for(llama, [5])[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                       logprobs=3)),
           (prompts_for(llama, [20], seed=1)[0], SamplingParams(temperature=0.7, max_tokens=6, seed=1,
                                                                logprobs=5, prompt_logprobs=2))]

    def outputs(eng):
        ids = [eng.add_request(prompt, sp) for prompt, sp in mix]
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).append(
                    (o.new_token_ids, o.new_top_logprobs, o.prompt_logprobs))
        return [out[i] for i in ids]

    got = outputs(engine)
    assert num_compilations() == compiled
    assert any(step[2] for step in got[1]) and all(step[1] for step in got[0] if step[0])
    lazy = Engine(llama, **kw)
    want = outputs(lazy)
    assert [[s[0] for s in r] for r in want] == [[s[0] for s in r] for r in got]


def test_fresh_long_prompt_prefills_alone_through_head_class_prefill(tmp_path):
    # Mistral's window heads are rings sized by max_step_tokens=8; prompts of 30-40 tokens prefill in one
    # step from their own K/V (the ring keeps only the last writers), then decode from the pages: same
    # tokens as chunked prefill through the jnp twin.
    model = jaxkv.load(make_tiny_checkpoint("mistral", tmp_path))
    prompts = prompts_for(model, [30, 41], seed=6)
    sp = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    kw = dict(max_step_tokens=8, decode_steps=4)
    fresh = Engine(model, page_size=4, max_model_len=64, max_num_seqs=2, enable_prefix_caching=False,
                   attn_impl="pallas", **kw)
    assert fresh.scheduler.max_fresh_tokens == 64
    ids = [fresh.add_request(p, s) for p, s in zip(prompts, sp)]
    chunks = fresh.scheduler.schedule()
    assert len(chunks) == 1 and chunks[0].fresh and chunks[0].num_tokens == 30
    for rid in ids:
        fresh.abort(rid)
    assert fresh.allocator.num_free == fresh.allocator.num_pages
    got = jaxkv.generate(model, prompts, sp, engine=fresh)
    ref, _, _ = run(model, prompts, sp, attn_impl="reference", **kw)
    assert [o.token_ids for o in got] == ref


def test_pipelined_decode_equals_one_call_at_a_time(llama):
    # Call t+1 is dispatched from call t's last tokens on the device before call t is read; a request that
    # stops inside call t (stop token) or finishes on length must not gain tokens from the call after it.
    prompts = prompts_for(llama, [5, 11, 17], seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True)
    plain, _, _ = run(llama, prompts[:1], [greedy], decode_steps=1)
    stop_id = plain[0][9]
    samplings = [dataclasses.replace(greedy, stop_token_ids=(stop_id,)),
                 SamplingParams(temperature=1.0, top_p=0.9, max_tokens=14, seed=5, ignore_eos=True),
                 dataclasses.replace(greedy, max_tokens=31)]
    one, _, _ = run(llama, prompts, samplings, decode_steps=4, pipeline_decode=False)
    kw = {"page_size": 4, "max_model_len": 64, "max_num_seqs": 4, "max_step_tokens": 16, "decode_steps": 4}
    engine = Engine(llama, enable_prefix_caching=False, **kw)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, samplings)]
    got, overlapped = {i: [] for i in ids}, 0
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        overlapped += engine._inflight is not None  # a call still on the device when step() returned
    assert [got[i] for i in ids] == one
    assert one[0][-1] == stop_id and len(one[0]) == plain[0].index(stop_id) + 1
    assert [len(t) for t in one[1:]] == [14, 31]
    assert overlapped >= 3
    assert engine._inflight is None
    assert engine.allocator.num_free == engine.allocator.num_pages  # reserved-ahead pages all returned


def test_abort_while_a_decode_call_is_in_flight(llama):
    prompts = prompts_for(llama, [6, 9], seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    kw = {"page_size": 4, "max_model_len": 64, "max_num_seqs": 4, "max_step_tokens": 16, "decode_steps": 4}
    alone, _, _ = run(llama, prompts[1:], [sp], **kw)
    engine = Engine(llama, enable_prefix_caching=False, **kw)
    a, b = engine.add_request(prompts[0], sp), engine.add_request(prompts[1], sp)
    got = {a: [], b: []}
    while engine._inflight is None or not got[a]:
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    n_a = len(got[a])
    engine.abort(a)  # its rows are in the call on the device and in the one after it
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert len(got[a]) == n_a < 30
    assert got[b] == alone[0]
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_step_cache_loads_every_program_a_second_engine_needs(tmp_path):
    """A second process building the same engine loads every step program from the step cache (nothing
    traced or compiled) and gives the tokens jit's own path gives, also when the programs load in the
    background while it serves; an engine whose programs differ (another page size) finds none; a damaged
    entry is compiled again, not run. Each side in a fresh process: XLA:CPU
    serializes a program completely only when no earlier compile of the process defined its kernels."""
    import json
    import os
    import subprocess
    import sys

    from tests.hf_tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("llama", tmp_path / "ckpt")
    env = {**os.environ, "JAXKV_COMPILATION_CACHE": "", "JAX_PLATFORMS": "cpu"}

    def side(phase):
        out = subprocess.run([sys.executable, "-m", "tests._step_cache_worker", phase, str(ckpt),
                              str(tmp_path / "steps")], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    wrote = side("write")
    assert wrote["hits"] == 0 and wrote["kept"] == wrote["programs"] > 0 and wrote["writer_thread"]
    read = side("read")
    # only the small page-table programs compile again, none of the kept ones
    assert read["hits"] == wrote["programs"]
    assert read["compiled_in_precompile"] == wrote["compiled_in_precompile"] - wrote["programs"]
    assert read["step_programs_compiled_while_running"] == 0
    assert read["tokens"] == wrote["reference_tokens"]
    assert read["background_hits"] == wrote["programs"]
    assert read["background_tokens"] == wrote["reference_tokens"]
    assert read["background_compiled_while_running"] == 0
    assert read["background_loaded"] == wrote["programs"] and read["background_pending"] == 0
    assert read["other_config_hits"] == 0
    assert read["damaged_hits"] == wrote["programs"] - 1
    assert read["damaged_tokens"] == wrote["reference_tokens"]


def test_prompt_ids_are_checked_whatever_their_container(llama):
    """Lists, numpy arrays of any integer width and numpy integers are ids; out of the vocabulary, empty,
    text or nested input is refused with a ValueError / TypeError naming the problem, before any request."""
    eng = Engine(llama, page_size=8, max_model_len=64, max_num_seqs=2, max_step_tokens=16)
    vocab = llama.config.vocab_size
    ids = [3, 1, 4, 1, 5]
    for form in (ids, np.asarray(ids, np.int32), np.asarray(ids, np.uint16), [np.int64(i) for i in ids]):
        rid = eng.add_request(form, jaxkv.SamplingParams(max_tokens=1))
        got = eng._requests[rid].prompt_ids
        assert got == ids and all(type(i) is int for i in got)
        eng.abort(rid)
    outside = r"must lie in \[0, "
    for bad, match in (([], "prompt is empty"), ([1, -1], outside), ([vocab], outside),
                       (np.asarray([0, vocab], np.int64), outside), ("ab", "invalid literal")):
        with pytest.raises(ValueError, match=match):
            eng.add_request(bad)
    with pytest.raises(TypeError):
        eng.add_request([[1, 2], [3, 4]])
    assert not eng.has_unfinished()
