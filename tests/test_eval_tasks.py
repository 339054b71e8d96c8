"""Task suite: determinism, structure, lengths, tokenization of pieces."""

import pytest

from jaxkv.eval.tasks import TASKS, make_instance, make_instances
from jaxkv.eval.vocab import UNK, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("context", [1024, 4096])
def test_structure_and_length(task, context, tok):
    insts = make_instances(task, context, 2, seed=3)
    assert insts == make_instances(task, context, 2, seed=3)  # deterministic by seed
    assert insts[0] != insts[1]
    unk = tok.token_to_id(UNK)
    for inst in insts:
        assert inst.prefix.startswith("<s>") and inst.suffix.endswith("<|assistant|>\n")
        assert len(inst.segments) >= 2 and inst.answers
        whole = tok.encode(inst.prompt).ids
        pieces = [i for p in (inst.prefix, *inst.segments, inst.suffix) for i in tok.encode(p).ids]
        assert whole == pieces  # segments are reusable token blocks
        assert unk not in whole and unk not in tok.encode(inst.target).ids
        total = len(whole) + len(tok.encode(inst.target).ids)
        assert 0.9 * context <= total <= 1.02 * context
        for a in inst.answers:
            assert a in inst.target


def test_answers_grounded_in_segments():
    inst = make_instance("mq_niah", 2048, 0, 0)
    body = "".join(inst.segments)
    for k, n in zip(inst.meta["keys"], inst.answers, strict=True):
        assert f" {k} {n} {k} ." in body  # needle: the number right after its key
        assert inst.target.count(f"{k} {n} {k}") == 1
    vt = make_instance("vt", 4096, 0, 1)
    seg_of = {v: next(i for i, s in enumerate(vt.segments) if f" {v} " in s) for v in vt.answers}
    assert len(set(seg_of.values())) > 1  # the chain crosses segment boundaries
    vt_body = "".join(vt.segments)
    walk = [vt.meta["value"], *vt.answers]
    assert vt.target.split() == walk
    for a, b in zip(walk, walk[1:]):  # one-token hops: each name is the left element of exactly one pair
        assert vt_body.count(f"var {a} ") == 1 and f"var {a} {b} ." in vt_body
    qa = make_instance("qa", 4096, 0, 2)
    assert qa.meta["gold_docs"][0] != qa.meta["gold_docs"][1]
    person, city, country = qa.target.split()
    qa_body = "".join(qa.segments)
    assert f"person {person} {city} born ." in qa_body and f"city {city} {country} located ." in qa_body
    ch = make_instance("chain", 8192, 0, 0)
    assert len(ch.answers) >= 200  # long generation
    ch_body = "".join(ch.segments)
    assert all(f"go {a} {b} ." in ch_body for a, b in zip(ch.answers, ch.answers[1:]))
    assert ch.target.split() == list(ch.answers)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown task"):
        make_instance("nope", 2048, 0, 0)
    with pytest.raises(ValueError, match="context"):
        make_instance("vt", 100, 0, 0)


def test_32k_context(tok):
    inst = make_instance("mq_niah", 32768, 0, 0)
    assert 31000 < len(tok.encode(inst.prompt).ids) <= 32768
