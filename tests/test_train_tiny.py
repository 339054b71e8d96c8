"""`python -m tools.train_tiny` end to end at toy size: train, checkpoint, resume, export, jaxkv.load."""

import json
from pathlib import Path

import numpy as np

from tools import train_tiny as tt

ROOT = Path(__file__).resolve().parents[1]


def test_train_resume_export_load(tmp_path):
    import jax.numpy as jnp

    import jaxkv

    conf = json.loads((ROOT / "configs" / "tiny_default.json").read_text())
    conf["model"].update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8)
    conf["train"].update(warmup_steps=2, checkpoint_every=2, log_every=1)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(conf))
    common = ["--config", str(cfg_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--workers", "1",
              "--curriculum", "[[0.0, 512, 2]]"]
    tt.main(common + ["--steps", "3"])
    log = [json.loads(line) for line in (tmp_path / "ckpt" / "loss_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in log)
    out = tmp_path / "export"
    tt.main(common + ["--steps", "4", "--export", str(out)])  # resumes at 3, trains one step
    log = [json.loads(line) for line in (tmp_path / "ckpt" / "loss_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert json.loads((out / "train_state.json").read_text())["step"] == 4
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "model.safetensors.index.json"]:
        assert (out / name).exists(), name
    model = jaxkv.load(out)
    assert model.config.num_kv_heads == 2
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "llama" and "jaxkv_untrained" not in hf
    ids = model.tokenizer.encode("<s><|user|>\nwhat is my pet ?<|end|>\n<|assistant|>\n")
    ours = tt.forward({k: jnp.asarray(v) for k, v in tt.load_hf_params(out).items()}, hf,
                      jnp.asarray([ids]), jnp.float32, "xla")
    np.testing.assert_allclose(model.logits(ids), np.asarray(ours), atol=1e-4)
