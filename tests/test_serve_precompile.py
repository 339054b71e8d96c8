"""`python -m jaxkv.serve --precompile` with a server-wide KV policy: every step variant is compiled before
the ready line, so serving traces (compiles) no step function and the compilation counter stays flat. A
real server subprocess on a tiny random checkpoint, sized so the precompile stays a few variants on CPU (4
variants, ~10 s cold on 2 cores; the persistent compilation cache makes a rerun faster).
"""

from __future__ import annotations

import re

import httpx
import openai
from hf_tiny import make_tiny_checkpoint

from jaxkv.serve.launch import ServerProcess

PROMPT = list(range(5, 45))  # 40 token ids: 5 chunks of 8
_TRACED_STEP = re.compile(r"Finished tracing (_step|_decode) ")


def test_precompiled_server_with_a_default_policy(tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", "64", "--page-size", "16",
                       "--num-pages", "64", "--max-num-seqs", "1", "--max-step-tokens", "8", "--precompile",
                       "--kv-policy", "snapkv", "--kv-budget", "0.25",
                       "--kv-policy-arg", "window=8"], env={"JAX_LOG_COMPILES": "1"})
    try:
        startup = "".join(s.log)
        # 4 step variants + the server policy's compression program (1 row x 1 page-table width)
        assert re.search(r"jaxkv: precompiled 5 step variants in \d+\.\d+s", startup), startup
        assert "KV policy snapkv (budget 0.25)" in startup
        assert "page-table widths 4 pages" in startup  # 64 tokens at page 16: one class
        assert _TRACED_STEP.search(startup)  # the compile log is on: precompile traced the steps
        info = httpx.get(s.base + "/info").json()
        assert info["precompiled_variants"] == 5
        # no fresh prompt is long enough to prefill alone at this length: no prefill kernel chosen yet
        assert info["prefill_global_impl"] is None and "prefill global heads" not in startup
        card = httpx.get(s.url + "/models").json()["data"][0]
        assert card["kv_policy"]["name"] == "snapkv" and card["kv_policy"]["budget"] == 0.25
        assert card["kv_policy"]["window"] == 8

        c = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)

        def text(prompt=PROMPT, max_tokens=16, **extra):
            r = c.completions.create(model=s.name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, **extra})
            assert r.usage.completion_tokens == max_tokens
            return r.choices[0].text

        # A sampled request: the warm-up request is greedy, so without --precompile this one would trace
        # (compile) a sampled prefill step and a sampled decode step while serving.
        seen = len(s.log)
        steps_before = s.metric("jaxkv_step_compilations_total")
        assert steps_before >= 4  # the precompiled variants (and the warm-up's metadata programs)
        c.completions.create(model=s.name, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1,
                             extra_body={"ignore_eos": True, "kv_policy": None})
        traced = [line for line in s.log[seen:] if _TRACED_STEP.search(line)]
        assert traced == [], f"a step compiled while serving: {traced}"
        assert s.metric("jaxkv_step_compilations_total") == steps_before
        assert s.metric("jaxkv_xla_compilations_total") > 0

        full = text(kv_policy=None)  # the full cache despite the server's policy

        assert text(kv_policy={"name": "snapkv", "budget": 1000}) == full  # keeps every token
        assert s.metric("jaxkv_kv_compressions_total") == 0
        assert text() != full  # the server's policy: a quarter of the prompt's K/V
        assert s.metric("jaxkv_kv_compressions_total") == 1
        text(kv_policy={"name": "snapkv", "budget": 0.5, "window": 8})  # another budget, the same program
        assert s.metric("jaxkv_kv_compressions_total") == 2
        assert s.metric("jaxkv_step_compilations_total") == steps_before  # the compressions compiled nothing
        assert s.metric("jaxkv_kv_pages_freed_by_compression_total") > 0
        assert s.metric("jaxkv_kv_pages_in_use") == 0

        # Segment reuse under a server-wide policy: `full` recomputes everything, so with `kv_policy: null`
        # it is the plain full-cache answer; left out, the server's policy compresses it too (the engine
        # does so after the request's first decode call, so it must generate more than 16 tokens).
        # (A page-aligned layout of 2 pages + 24 tokens fits the 4 pages of the 64-token context.)
        seg = httpx.post(s.url + "/segments", json={"tokens": PROMPT[:16]}, timeout=120).json()["id"]
        reuse = {"segments": [seg], "method": "full", "prefix": []}
        plain = text(prompt=PROMPT[:32], kv_policy=None)
        assert text(prompt=PROMPT[16:32], reuse=reuse, kv_policy=None) == plain
        assert s.metric("jaxkv_kv_compressions_total") == 2
        text(prompt=PROMPT[16:32], reuse=reuse, max_tokens=24)
        assert s.metric("jaxkv_kv_compressions_total") == 3
        assert s.metric("jaxkv_kv_pages_in_use") == 0
    finally:
        s.stop()


def test_precompile_retrieval_covers_per_request_quest(tmp_path):
    """`--precompile-retrieval quest@32`: a per-request Quest policy (no server-wide policy) decodes through
    programs compiled before the ready line; without the flag the same request compiles its decode."""
    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    # Quest at 32 tokens per KV head: the budget is a shape (top-k), so a request names the same one.
    base = ["--model", str(ckpt), "--max-model-len", "64", "--page-size", "16", "--num-pages", "64",
            "--max-num-seqs", "1", "--max-step-tokens", "8"]
    compiled = {}
    for flags in (["--precompile-retrieval", "quest@32"], ["--precompile"]):
        s = ServerProcess(base + flags)
        try:
            c = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
            before = s.metric("jaxkv_step_compilations_total")
            quest = {"name": "quest", "budget": 32}
            r = c.completions.create(model=s.name, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True, "kv_policy": quest})
            assert r.usage.completion_tokens == 16
            compiled[flags[0]] = s.metric("jaxkv_step_compilations_total") - before
        finally:
            s.stop()
    assert compiled == {"--precompile-retrieval": 0, "--precompile": compiled["--precompile"]}
    assert compiled["--precompile"] > 0  # the flag is what covered the Quest decode


def test_precompile_retrieval_refuses_a_compression_press(tmp_path):
    import subprocess
    import sys

    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    r = subprocess.run([sys.executable, "-m", "jaxkv.serve", "--model", str(ckpt), "--port", "0",
                        "--max-model-len", "64", "--num-pages", "64", "--max-num-seqs", "1",
                        "--max-step-tokens", "8", "--precompile-retrieval", "snapkv"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--precompile-retrieval" in r.stderr and "quest" in r.stderr and "Traceback" not in r.stderr


_TRACED_REUSE = re.compile(r"Finished tracing reuse_prefill ")


def _reuse_requests_compile_nothing(s, methods, questions):
    """Registers PROMPT[:16] as a segment, asks one token of every (method, question) reusing it, and checks
    that no reuse pass was traced and nothing compiled while serving."""
    seg = httpx.post(s.url + "/segments", json={"tokens": PROMPT[:16]}, timeout=120).json()["id"]
    c = openai.OpenAI(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
    seen, xla_before = len(s.log), s.metric("jaxkv_xla_compilations_total")
    for method in methods:
        for question in questions:
            reuse = {"segments": [seg], "method": method, "prefix": []}
            r = c.completions.create(model=s.name, prompt=question, max_tokens=1, temperature=0,
                                     extra_body={"reuse": reuse})
            assert r.usage.completion_tokens == 1
    traced = [line for line in s.log[seen:] if _TRACED_REUSE.search(line)]
    assert traced == [], f"a reuse pass compiled while serving: {traced}"
    assert s.metric("jaxkv_xla_compilations_total") == xla_before


def test_precompile_reuse_covers_methods_that_pick_their_rows(tmp_path):
    """`--precompile-reuse naive,sparsex --no-segment-as-steps`: both methods' passes (a 64-token context:
    one token bucket x the 64- and 128-row buckets each; naive's also as its two layer groups, which
    segments promoted from host memory run in) compile before the ready line; reuse requests of either,
    with short and long questions, then trace no reuse pass and compile nothing. A name that is no reuse
    method is refused before the model loads."""
    import subprocess
    import sys

    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    base = ["--model", str(ckpt), "--max-model-len", "64", "--page-size", "16", "--num-pages", "64",
            "--max-num-seqs", "1", "--max-step-tokens", "8", "--head-classes", "global"]
    s = ServerProcess(base + ["--precompile-reuse", "naive,sparsex", "--no-segment-as-steps"],
                      env={"JAX_LOG_COMPILES": "1"})
    try:
        startup = "".join(s.log)
        assert re.search(r"jaxkv: precompiled 6 naive reuse programs", startup), startup
        assert re.search(r"jaxkv: precompiled 2 sparsex reuse programs", startup), startup
        assert _TRACED_REUSE.search(startup)   # the compile log is on: precompile traced the passes
        assert httpx.get(s.base + "/info").json()["precompiled_reuse_passes"] == {"naive": 6, "sparsex": 2}
        # 4 and ~32 rows: both in the 64-row floor
        _reuse_requests_compile_nothing(s, ("naive", "sparsex"), (PROMPT[16:19], PROMPT[16:46]))
    finally:
        s.stop()
    r = subprocess.run([sys.executable, "-m", "jaxkv.serve", "--port", "0", *base,
                        "--precompile-reuse", "naive,nope"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--precompile-reuse" in r.stderr and "unknown reuse method 'nope'" in r.stderr
    assert "Traceback" not in r.stderr


def test_precompile_compiles_reuse_passes_in_the_same_pool_run(tmp_path):
    """`--precompile --precompile-reuse naive,epic`: the steps and the page copy naive and EPIC share (their
    tokens run as the step programs) compile in one pool run (one ready line counting both apart, the copy
    once); /info reports each apart, and reuse requests then compile nothing."""
    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    s = ServerProcess(["--model", str(ckpt), "--max-model-len", "64", "--page-size", "16",
                       "--num-pages", "64", "--max-num-seqs", "1", "--max-step-tokens", "8",
                       "--head-classes", "global", "--precompile", "--precompile-reuse", "naive,epic"],
                      env={"JAX_LOG_COMPILES": "1"})
    try:
        startup = "".join(s.log)
        m = re.search(r"jaxkv: precompiled 4 step variants and 2 reuse programs in \d+\.\d+s", startup)
        assert m, startup
        assert "naive reuse programs" not in startup  # no second, per-method run
        info = httpx.get(s.base + "/info").json()
        # the page copy of one width class, and the step table of more than one row built on the device
        assert info["precompiled_reuse_passes"] == {"naive": 2, "epic": 2}
        assert info["precompiled_variants"] == 4  # as without reuse methods (test above, less its press)
        _reuse_requests_compile_nothing(s, ("naive", "epic"), (PROMPT[16:19],))
    finally:
        s.stop()
