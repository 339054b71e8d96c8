"""Precompile compiles the first program of each GEMM group before the group's others (XLA keeps the GEMM
tilings it timed, so the others find them instead of timing the same candidates at once), and still
installs every program."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import jaxkv
from jaxkv.engine import compilations
from jaxkv.engine.engine import Engine
from jaxkv.engine.warmup import CompileTimeline, _after, _leaders_first, _reuse_jobs, gemm_group, variants
from tests.hf_tiny import make_tiny_checkpoint


def test_programs_of_the_same_rows_share_a_group_across_kinds():
    assert gemm_group(("step", 32, 32, 256, True, False, 0, False)) == 32
    assert gemm_group(("decode", 32, 0, 2048, False, False, 0, False)) == 32
    assert gemm_group(("retrieval tap", 64, 32, 256, True, False, None, "specontext")) == 32
    assert gemm_group(("retrieval decode", 32, 16, 256, True, False, True, "specontext")) == 32
    assert gemm_group(("reuse redknot", 32, 64, 40)) == 32
    # a step's rows are its tokens, not its sequences; a compression program is apart from the rest
    assert gemm_group(("step", 32, 64, 256, True, False, 0, False)) == 64
    assert gemm_group(("compress", 32, 0, 256, "snapkv")) == ("compress", 32)


def test_leaders_come_first_in_their_order_then_the_rest_in_theirs():
    calls = [(("step", 8, 8, 32, g, False, 0, False),) for g in (True, False)]
    calls += [(("step", 16, 16, p, True, False, 0, False),) for p in (32, 256)]
    calls += [(("decode", 8, 0, 256, True, False, 0, False),), (("decode", 2, 0, 32, True, False, 0, False),)]
    out = [c[0] for c in _leaders_first(calls)]
    assert out == [calls[0][0], calls[2][0], calls[5][0], calls[1][0], calls[3][0], calls[4][0]]


def test_a_follower_starts_only_after_its_leader_and_keeps_its_outcome():
    release, started = threading.Event(), []

    def lead():
        release.wait(5)
        started.append("leader done")
        return 1

    def follow(x):
        started.append("follower")
        if x < 0:
            raise ValueError("bad")
        return x

    with ThreadPoolExecutor(4) as pool:
        leader = pool.submit(lead)
        ok, bad = _after(leader, pool, follow, 7), _after(leader, pool, follow, -1)
        time.sleep(0.2)
        assert started == [] and not ok.done()  # two free threads, yet nothing started before the leader
        release.set()
        assert ok.result(5) == 7
        with pytest.raises(ValueError, match="bad"):
            bad.result(5)
    assert started[0] == "leader done" and sorted(started[1:]) == ["follower", "follower"]
    # a leader already done: the follower is submitted at once
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(lambda: 0)
        done.result()
        assert _after(done, pool, follow, 3).result(5) == 3


@pytest.mark.parametrize("leaders", ["1", "0"])
def test_precompile_installs_every_variant_either_way(tmp_path, monkeypatch, leaders):
    monkeypatch.setenv("JAXKV_COMPILE_LEADERS", leaders)
    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path))
    engine = Engine(model, page_size=8, max_model_len=64, max_num_seqs=2, max_step_tokens=16,
                    enable_prefix_caching=False)
    n = engine.precompile(progress=False, step_cache=False)
    assert n == len(variants(engine)) == len(engine.runner.compiled)
    # the timeline saw every program lowered, then compiled after its lowering
    timeline = engine.compile_timeline
    assert len(timeline.lowering) == len(timeline.compiles) == n
    lowered_at = sorted(end for _, _, end in timeline.lowering)
    assert all(a <= b for (_, a, b) in timeline.compiles)
    assert min(a for _, a, _ in timeline.compiles) >= lowered_at[0]
    assert set(timeline.summary()["lowering_s"]) == {"step", "decode"}
    before = compilations.step_programs()
    engine.add_request([1, 2, 3, 4, 5], jaxkv.SamplingParams(temperature=0, max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    assert compilations.step_programs() == before


def test_the_compile_timeline_counts_programs_compiling_per_window():
    t = CompileTimeline(0.0)
    t.lowering = [("step", 0.0, 1.0), ("reuse redknot", 1.0, 4.0), ("step", 4.0, 5.0)]
    t.compiles = [("step", 1.0, 11.0), ("reuse redknot", 4.0, 24.0), ("step", 5.0, 6.0)]
    out = t.summary(window=10.0, last=2)
    # [0, 10): 9 + 6 + 1 seconds of compiling; [10, 20): 1 + 10; [20, 30): 4
    assert out["compiling_per_window"] == [1.6, 1.1, 0.4]
    assert out["lowering_done_s"] == 5.0 and out["compiles_done_s"] == 24.0
    assert out["lowering_s"] == {"reuse redknot": 3.0, "step": 2.0}
    assert out["last"] == [["step", 1.0, 11.0], ["reuse redknot", 4.0, 24.0]]
    assert CompileTimeline(0.0).summary() == {}


def test_a_compile_that_fails_on_the_pool_runs_again_after_every_other(tmp_path, monkeypatch):
    """XLA's autotuning of many programs at once can run out of device memory (8B shape on an H100): the
    failed program compiles again once no other compile runs, and every program is installed."""
    import jax

    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path))
    engine = Engine(model, page_size=8, max_model_len=64, max_num_seqs=2, max_step_tokens=16,
                    enable_prefix_caching=False)
    real, lock, log = jax.stages.Lowered.compile, threading.Lock(), []

    def compile_once_failing(self, *args, **kwargs):
        with lock:
            first = not log
            log.append(["start", id(self)])
        if first:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while autotuning")
        try:
            return real(self, *args, **kwargs)
        finally:
            with lock:
                log.append(["end", id(self)])

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_once_failing)
    n = engine.precompile(progress=False, step_cache=False, workers=2)
    assert n == len(variants(engine)) == len(engine.runner.compiled)
    failed = log[0][1]
    retry = [i for i, (what, lowered) in enumerate(log) if what == "start" and lowered == failed][1]
    ends = [i for i, (what, lowered) in enumerate(log) if what == "end" and lowered != failed]
    assert len(ends) == n - 1 and max(ends) < retry  # every other compile had ended


def test_a_compile_out_of_device_memory_even_alone_says_what_to_change(tmp_path, monkeypatch):
    import jax

    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path))
    engine = Engine(model, page_size=8, max_model_len=64, max_num_seqs=2, max_step_tokens=16,
                    enable_prefix_caching=False)

    def out_of_memory(self, *args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.02GiB")

    monkeypatch.setattr(jax.stages.Lowered, "compile", out_of_memory)
    with pytest.raises(MemoryError, match="ran out of device memory with no other compile running.*"
                                          "--memory-utilization.*--max-num-seqs.*--retrieval-max-seqs"):
        engine.precompile(progress=False, step_cache=False, workers=2)


def test_reuse_passes_are_lowered_largest_first(tmp_path):
    """The passes come last in a pool run: largest first, so the quickest compiles close it."""
    from jaxkv.cache.head_classes import all_global
    from jaxkv.policies.reuse import resolve_reuse

    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path))
    cfg = model.config
    engine = Engine(model, page_size=8, max_model_len=192, max_num_seqs=2, max_step_tokens=16,
                    enable_prefix_caching=False, head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))
    jobs = _reuse_jobs(engine, [resolve_reuse("redknot"), resolve_reuse("sparsex")])
    shapes = [(v[2], v[1]) for v, _, _ in jobs]
    assert len(shapes) == len(engine.reuser.calls(resolve_reuse("redknot"))) + len(
        engine.reuser.calls(resolve_reuse("sparsex")))
    assert shapes == sorted(shapes, reverse=True) and shapes[0] > shapes[-1]


def test_the_slowest_kinds_to_compile_are_lowered_first(tmp_path):
    """On a GPU precompile lowers the kinds that compile slowest first (retrieval decodes, reuse passes,
    decodes, taps, steps), the most rows first within a kind, so the programs lowered last compile quickly."""
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.warmup import lowering_order
    from jaxkv.policies.reuse import resolve_reuse

    jobs = [(("step", 2, 16, 64, True, False, 0, False),), (("compress", 2, 0, 64, "snapkv"),),
            (("step", 2, 64, 64, True, False, 0, False),), (("decode", 2, 0, 64, True, False, 0, False),),
            (("retrieval tap", 2, 16, 64, True, False, None, "specontext"),), (("reuse pages", 0, 0, 8),),
            (("retrieval decode", 2, 16, 64, True, False, True, "specontext"),), (("future kind", 1),),
            (("reuse redknot", 128, 128, 32),), (("reuse redknot", 512, 512, 64),)]
    kinds = [j[0][0] for j in lowering_order(jobs)]
    assert kinds == ["retrieval decode", "reuse redknot", "reuse redknot", "decode", "retrieval tap", "step",
                     "step", "compress", "reuse pages", "future kind"]
    order = lowering_order(jobs)
    assert [j[0][1] for j in order[1:3]] == [512, 128] and [j[0][2] for j in order[5:7]] == [64, 16]
    # every job of a real engine's precompile keeps its place in the set
    model = jaxkv.load(make_tiny_checkpoint("llama", tmp_path))
    cfg = model.config
    engine = Engine(model, page_size=8, max_model_len=192, max_num_seqs=2, max_step_tokens=16,
                    enable_prefix_caching=False, head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))
    real = [(v, None, None) for v in variants(engine)] + _reuse_jobs(engine, [resolve_reuse("redknot")])
    assert sorted(map(repr, lowering_order(real))) == sorted(map(repr, real))
    assert lowering_order(real)[0][0][0] == "reuse redknot"
