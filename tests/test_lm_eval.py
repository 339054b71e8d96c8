"""lm-evaluation-harness against `python -m jaxkv.serve` end to end: `lm_eval --model local-completions` runs
the local tasks of examples/lm_eval (one multiple-choice, one generate_until) against a real server on a tiny
random checkpoint, tokenizing through the server's /tokenize (no tokenizer files on lm-eval's side). Every
loglikelihood lm-eval logged is checked against a dense forward of the same model. Skipped without lm_eval
(a heavy optional install: `pip install "lm-eval[api]"`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_tiny import make_tiny_checkpoint

import jaxkv
from jaxkv.serve.launch import ServerProcess

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lm_eval_local_completions(tmp_path):
    ckpt = make_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    server = ServerProcess(["--model", str(ckpt), "--max-model-len", "256", "--num-pages", "256",
                            "--max-num-seqs", "4", "--no-precompile"])
    try:
        out = tmp_path / "results"
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
               f"model={server.name},base_url={server.url}/completions,max_length=256",
               "--tasks", "jaxkv_mc,jaxkv_gen", "--include_path", "examples/lm_eval",
               "--output_path", str(out), "--log_samples"]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "remote tokenizer" in proc.stderr  # lm-eval found /tokenizer_info and /tokenize on its own
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["jaxkv_mc"]["acc,none"] <= 1 and 0 <= results["jaxkv_gen"]["exact_match,strip"] <= 1

    model = jaxkv.load(ckpt)
    tok = model.tokenizer
    logged = next(out.rglob("samples_jaxkv_mc_*.jsonl")).read_text().splitlines()
    samples = [json.loads(line) for line in logged]
    assert len(samples) == 10
    hits = []
    for s in samples:
        # lm-eval logs one (context, continuation) request per choice as {gen_args_i: {arg_j: ...}} and
        # each response (loglikelihood, is_greedy) as strings
        args = [[a[f"arg_{j}"] for j in range(len(a))] for a in s["arguments"].values()]
        context, choices = args[0][0], [a[1] for a in args]
        resps = [(float(r[0][0]), r[0][1] == "True") for r in s["resps"]]
        scores = []
        for choice, (loglik, greedy) in zip(choices, resps):
            ctx_ids = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + choice, add_special_tokens=False)
            cont = whole[len(ctx_ids):]
            x = np.asarray(model.logits(whole)[0], np.float64)
            lsm = x - x.max(-1, keepdims=True)
            lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
            rows = lsm[len(ctx_ids) - 1:len(whole) - 1]
            assert abs(loglik - sum(rows[i, t] for i, t in enumerate(cont))) < 1e-3
            assert greedy == all(int(np.argmax(rows[i])) == t for i, t in enumerate(cont))
            scores.append(loglik)
        hits.append(int(np.argmax(scores)) == int(s["target"]))
    assert abs(np.mean(hits) - results["jaxkv_mc"]["acc,none"]) < 1e-9
