"""RULER and LongBench JSONL loaders on small files written here."""

import json

import pytest

from jaxkv.eval.loaders import load_longbench_jsonl, load_ruler_jsonl
from jaxkv.eval.metrics import score


def test_ruler(tmp_path):
    p = tmp_path / "niah.jsonl"
    text = "".join(f"line {i} filler.\n" for i in range(40)) + "The special magic number is 42.\n"
    rows = [{"index": 0, "input": text, "outputs": ["42"], "length": 300, "answer_prefix": " Answer:"},
            {"index": 1, "input": "short\n", "outputs": ["a", "b"]}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    insts = load_ruler_jsonl(p, num_segments=4)
    assert len(insts) == 2
    a = insts[0]
    assert "".join(a.segments) == text and len(a.segments) == 4
    assert a.suffix == " Answer:" and a.answers == ("42",) and a.metric == "all"
    assert score(a.metric, "it is 42", a.answers) == 1.0
    assert len(load_ruler_jsonl(p, limit=1)) == 1


def test_longbench(tmp_path):
    p = tmp_path / "hotpotqa.jsonl"
    ctx = "Passage 1:\nAlice was born in Paris.\nPassage 2:\nParis is in France.\n"
    p.write_text(json.dumps({"input": "Where was Alice born?", "context": ctx, "answers": ["Paris"],
                             "dataset": "hotpotqa", "_id": "x1"}) + "\n")
    (inst,) = load_longbench_jsonl(p)
    assert inst.segments == ("Passage 1:\nAlice was born in Paris.\n", "Passage 2:\nParis is in France.\n")
    assert "Where was Alice born?" in inst.suffix and inst.metric == "f1"
    assert score(inst.metric, "paris", inst.answers) == 1.0


def test_bad_files(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input": "x"}\n')
    with pytest.raises(ValueError, match="outputs"):
        load_ruler_jsonl(p)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_longbench_jsonl(p)
