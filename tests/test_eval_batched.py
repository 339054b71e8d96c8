"""`EngineMethod.run_many`: many instances through one batched engine give exactly `run`'s tokens."""

import pytest

import jaxkv
from jaxkv.eval.methods import PromptPieces, get_method
from jaxkv.eval.tasks import make_instances
from jaxkv.models.catalog import SYNTHETIC


@pytest.fixture(scope="module")
def model():
    return jaxkv.load(SYNTHETIC)  # the embedded model, fp32


@pytest.fixture(scope="module")
def prompts(model):
    """Four prompts of different lengths (1014, 521, 502, 265 tokens: Quest's fraction budget differs per
    request) and different token limits: two contexts, each once with one of its two segments dropped."""
    enc = lambda s: model.tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    out = []
    insts = make_instances("vt", 1024, 2, seed=6) + make_instances("vt", 512, 2, seed=5)
    for i, (inst, keep) in enumerate(zip(insts, (2, 1, 2, 1))):
        ids = PromptPieces(enc(inst.prefix), [enc(s) for s in inst.segments[:keep]], enc(inst.suffix)).ids
        out.append((ids, 4 + 3 * i))
    assert len({len(ids) for ids, _ in out}) == len(out)
    return out


@pytest.mark.parametrize("name, budget, rows, step_tokens", [
    ("engine", None, 2, None), ("snapkv", 0.25, 4, None), ("quest", 0.25, 4, None),
    ("snapkv", 0.25, 4, 2048),  # every prompt in one step, as on an accelerator
])
def test_run_many_equals_run_one_by_one(model, prompts, name, budget, rows, step_tokens):
    fields = {} if budget is None else {"budget": budget}
    stop = tuple(model.config.eos_token_ids)
    one = get_method(name, model, **fields)
    expected = [one.run(PromptPieces(ids, [], []), max_new, stop).token_ids for ids, max_new in prompts]
    # rows=2 with four prompts: half of them wait in the engine's queue
    got = get_method(name, model, **fields).run_many(prompts, stop, max_num_seqs=rows,
                                                    max_step_tokens=step_tokens)
    assert got == expected
    assert all(0 < len(g) <= max_new for g, (_, max_new) in zip(got, prompts))


def test_run_many_rejects_bad_rows(model):
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        get_method("engine", model).run_many([([1, 2, 3], 2)], (), max_num_seqs=0)


def test_kvpress_accuracy_batched_rows_equal_one_by_one(tmp_path):
    """`benchmarks.kvpress accuracy`, our side: `--batch 4` writes the rows `--batch 1` writes."""
    import json

    from benchmarks import kvpress as kvp

    rows = {}
    for batch in (1, 4):
        out = tmp_path / f"b{batch}.json"
        kvp.main(["accuracy", "--skip-kvpress", "--tasks", "vt", "--context", "512", "--num", "3",
                  "--methods", "snapkv", "--budgets", "0.25", "--full", "--batch", str(batch),
                  "--out", str(out)])
        rows[batch] = json.loads(out.read_text())["rows"]
    assert len(rows[1]) == 6 and {r["cell"] for r in rows[1]} == {"snapkv@0.25", "full"}
    assert any(r["tokens"] for r in rows[1])
    assert rows[4] == rows[1]


def test_kvpress_batch_must_be_positive(capsys):
    from benchmarks import kvpress as kvp

    with pytest.raises(SystemExit):
        kvp.main(["accuracy", "--skip-kvpress", "--batch", "0"])
    assert "--batch must be a positive integer" in capsys.readouterr().err
