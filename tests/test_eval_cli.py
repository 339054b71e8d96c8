"""python -m jaxkv.eval end to end on a toy random model, plus argument errors; method registry."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import train_tiny as tt

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory):
    conf = json.loads((ROOT / "configs" / "tiny_default.json").read_text())["model"]
    conf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    cfg = tt.hf_config(conf)
    out = tmp_path_factory.mktemp("toy")
    tt.export_hf(tt.init_params(cfg, 0), cfg, out)
    return out


def test_cli_runs_and_writes(toy_model, tmp_path):
    from jaxkv.eval.__main__ import main

    out = tmp_path / "r.json"
    assert main(["--task", "vt", "--context", "512", "--num", "2", "--model", str(toy_model),
                 "--out", str(out), "--max-new-tokens", "4"]) == 0
    res = json.loads(out.read_text())
    assert res["num"] == 2 and len(res["instances"]) == 2 and 0.0 <= res["accuracy"] <= 1.0
    s = res["summary"]
    assert s["logit_cosine"] == pytest.approx(1.0) and s["top1_agree"] == 1.0
    assert s["kv_bytes_held"] > 0 and s["prefill_flops_attention"] > 0 and s["prefill_flops_ffn"] > 0
    assert all(r["output_tokens"] <= 4 for r in res["instances"])


def test_full_method_matches_dense_logits(toy_model):
    import numpy as np

    import jaxkv
    from jaxkv.eval.methods import PromptPieces, get_method

    model = jaxkv.load(toy_model)
    text = "<s><|user|>\nwhat is my pet ?<|end|>\n<|assistant|>\n"
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    out = get_method("full", model).run(PromptPieces(ids[:3], [ids[3:6]], ids[6:]), 5, ())
    np.testing.assert_allclose(out.first_logits, model.logits(ids)[0, -1], atol=1e-4)
    # Greedy continuation equals the dense argmax path.
    seq = list(ids)
    for t in out.token_ids:
        assert int(model.logits(seq)[0, -1].argmax()) == t
        seq.append(t)
    assert len(out.token_ids) == 5


@pytest.mark.parametrize("argv,msg", [
    (["--task", "nope"], "unknown task"),
    (["--task", "vt", "--method", "magic"], "unknown method"),
    (["--task", "vt", "--context", "12"], "--context must be"),
    (["--task", "vt", "--num", "0"], "--num must be"),
    (["--task", "vt", "--model", "/nonexistent"], "not a model directory"),
    (["--task", "ruler:/nonexistent.jsonl"], "does not exist"),
])
def test_bad_args(argv, msg):
    r = subprocess.run([sys.executable, "-m", "jaxkv.eval", *argv], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and msg in r.stderr


def test_registry():
    from jaxkv.eval.methods import METHODS, Method, get_method, register_method

    @register_method("_test_dummy")
    class Dummy(Method):
        name = "_test_dummy"

    try:
        assert isinstance(get_method("_test_dummy", None), Dummy)
        with pytest.raises(ValueError, match="unknown method"):
            get_method("nope", None)
    finally:
        METHODS.pop("_test_dummy")


def test_random_copy_baseline_is_chance_and_copies_context(toy_model, tmp_path):
    """The chance-level method copies segment tokens only, runs no model and reports no agreement."""
    from jaxkv.eval.__main__ import main

    out = tmp_path / "c.json"
    assert main(["--task", "cwe", "--method", "random_copy", "--context", "512", "--num", "3",
                 "--model", str(toy_model), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    assert s["kv_bytes_held"] == 0 and s["prefill_flops_attention"] == 0
    assert s["logit_cosine"] != s["logit_cosine"]          # NaN: nothing to agree with
    from jaxkv.eval.tasks import make_instances

    for inst, row in zip(make_instances("cwe", 512, 3, seed=0), res["instances"]):
        words = set(" ".join(inst.segments).split())
        assert row["prediction"].split() and set(row["prediction"].split()) <= words
    assert res["accuracy"] < 0.5     # 5 common words among ~300 distinct ones: far from solved


def test_engine_method_equals_full_and_policies_run_through_it(toy_model, tmp_path):
    """The serving engine is the eval's path for every KV method: with no policy it equals `full`."""
    import jaxkv
    from jaxkv.eval.__main__ import main
    from jaxkv.eval.methods import PromptPieces, get_method
    from jaxkv.eval.tasks import make_instances

    model = jaxkv.load(toy_model)
    enc = lambda s: model.tokenizer.encode(s, add_special_tokens=False)
    full, engine = get_method("full", model), get_method("engine", model)
    for inst in make_instances("vt", 512, 2, seed=3):
        pieces = PromptPieces(enc(inst.prefix), [enc(s) for s in inst.segments], enc(inst.suffix))
        assert engine.run(pieces, 12, ()).token_ids == full.run(pieces, 12, ()).token_ids
    with pytest.raises(ValueError, match="takes no budget"):
        get_method("engine", model, budget=0.5)
    out = tmp_path / "s.json"
    assert main(["--task", "vt", "--method", "snapkv", "--budget", "0.25", "--policy-arg", "window=16",
                 "--context", "512", "--num", "2", "--model", str(toy_model), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["policy"]["budget"] == 0.25 and res["policy"]["window"] == 16
    assert 0 < res["summary"]["kv_bytes_held"]


def test_policy_flags_need_a_policy_method():
    r = subprocess.run([sys.executable, "-m", "jaxkv.eval", "--task", "vt", "--method", "full",
                        "--budget", "0.5"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "apply to the KV policy methods" in r.stderr
