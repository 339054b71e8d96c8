"""Metrics: SQuAD EM/F1, RULER match-all, chain accuracy, logit agreement, FLOPs and KV bytes."""

import numpy as np
import pytest

from jaxkv.config import ModelConfig
from jaxkv.eval import metrics


def test_em_f1():
    assert metrics.exact_match("The Cat!", ["cat"]) == 1.0
    assert metrics.exact_match("a dog", "cat") == 0.0
    assert metrics.token_f1("the big cat", ["big cat sat"]) == pytest.approx(0.8)
    assert metrics.token_f1("", ["x"]) == 0.0
    assert metrics.token_f1("x y", ["q", "y x"]) == 1.0


def test_match_all_and_chain():
    pred = "meki : 634313 , devu : 394237"
    assert metrics.match_all(pred, ["634313", "394237", "111111"]) == pytest.approx(2 / 3)
    assert metrics.match_all("6343130", ["634313"]) == 0.0  # whole words only
    assert metrics.chain_accuracy("a b x d", ["a", "b", "c", "d"]) == 0.75
    assert metrics.score("all", "x", ["x"]) == 1.0
    # list answers: only the first len(answers) words count, in any order, punctuation ignored
    assert metrics.match_list("q , p , r", ["p", "q", "r"]) == 1.0
    assert metrics.match_list("q , x , y , p , r", ["p", "q", "r"]) == pytest.approx(1 / 3)
    assert metrics.score("list", "x y", ["y"]) == 0.0
    with pytest.raises(ValueError):
        metrics.score("bleu", "a", ["a"])


def test_logit_agreement():
    a = np.arange(20, dtype=np.float32)
    same = metrics.logit_agreement(a, a)
    assert same == {"logit_cosine": pytest.approx(1.0), "top1_agree": 1.0, "top10_overlap": 1.0}
    b = a.copy()
    b[0] = 100.0
    diff = metrics.logit_agreement(b, a)
    assert diff["top1_agree"] == 0.0 and diff["top10_overlap"] == 0.9 and diff["logit_cosine"] < 1.0


def test_flops_and_kv_bytes():
    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 16})
    f = metrics.prefill_flops(cfg, 10)
    proj = 2 * 10 * 64 * 16 * (2 * 4 + 2 * 2)
    scores = 4 * 4 * 16 * 55
    assert f["attention"] == 2 * (proj + scores)
    assert f["ffn"] == 2 * 2 * 10 * 3 * 64 * 128
    assert f["total"] == f["attention"] + f["ffn"]
    # Cached tokens add only attention work.
    g = metrics.prefill_flops(cfg, 10, num_cached=100)
    assert g["ffn"] == f["ffn"] and g["attention"] > f["attention"]
    assert metrics.kv_bytes(cfg, 7) == 2 * 2 * 2 * 16 * 7 * 2
