"""Quality, agreement and cost metrics of the eval harness.

Quality: `exact_match`, SQuAD-style `token_f1`, RULER-style `match_all` (fraction of expected items found
as whole words), `chain_accuracy` (per-step agreement of a long generation), and `score` which applies an
instance's own metric. Agreement with the full-recompute run: `logit_agreement` (cosine, top-1, top-10
overlap of the first generated token's logits). Cost: analytical prefill FLOPs split into attention and
FFN (`prefill_flops`) and KV bytes (`kv_bytes`).
"""

from __future__ import annotations

import collections
import re
import string

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def exact_match(prediction: str, references: list[str] | tuple[str, ...] | str) -> float:
    refs = [references] if isinstance(references, str) else list(references)
    return float(any(normalize_answer(prediction) == normalize_answer(r) for r in refs))


def token_f1(prediction: str, references: list[str] | tuple[str, ...] | str) -> float:
    """Max over references of the SQuAD token F1."""
    refs = [references] if isinstance(references, str) else list(references)
    pred = normalize_answer(prediction).split()
    best = 0.0
    for r in refs:
        gold = normalize_answer(r).split()
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        common = collections.Counter(pred) & collections.Counter(gold)
        same = sum(common.values())
        if same:
            p, rc = same / len(pred), same / len(gold)
            best = max(best, 2 * p * rc / (p + rc))
    return best


def match_all(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """Fraction of `answers` that occur in `prediction` as whole words (RULER string_match_all)."""
    if not answers:
        return 0.0
    words = set(normalize_answer(prediction).split())
    return sum(normalize_answer(a) in words or _contains(prediction, a) for a in answers) / len(answers)


def match_list(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """Fraction of `answers` among the first len(answers) words of `prediction` (order-free).

    For list answers (cwe, fwe): only as many words as the list is long count, so writing many context
    words at random does not score; with `match_all`, 13 frequency-weighted random context words found
    0.8 of fwe's three Zipf-top words.
    """
    if not answers:
        return 0.0
    head = normalize_answer(prediction).split()[: len(answers)]
    return len({normalize_answer(a) for a in answers} & set(head)) / len(answers)


def _contains(prediction: str, answer: str) -> bool:
    a = normalize_answer(answer)
    pattern = r"(^|\s)" + re.escape(a) + r"(\s|$)"
    return bool(a) and re.search(pattern, normalize_answer(prediction)) is not None


def chain_accuracy(prediction: str, answers: list[str] | tuple[str, ...]) -> float:
    """Fraction of steps i at which the i-th predicted word equals the i-th expected word."""
    if not answers:
        return 0.0
    # Position-wise, so articles are kept (SQuAD normalisation would shift the steps).
    pred = re.findall(r"\w+", prediction.lower())
    gold = [a.lower() for a in answers]
    return sum(i < len(pred) and pred[i] == g for i, g in enumerate(gold)) / len(gold)


def score(metric: str, prediction: str, answers) -> float:
    if metric == "all":
        return match_all(prediction, answers)
    if metric == "list":
        return match_list(prediction, answers)
    if metric == "chain":
        return chain_accuracy(prediction, answers)
    if metric == "f1":
        return token_f1(prediction, answers)
    if metric == "em":
        return exact_match(prediction, answers)
    raise ValueError(f"unknown metric {metric!r}")


def logit_agreement(logits: np.ndarray, reference: np.ndarray, k: int = 10) -> dict[str, float]:
    """Cosine similarity, top-1 agreement and top-k overlap of two first-token logit vectors [V]."""
    a, b = np.asarray(logits, np.float64).ravel(), np.asarray(reference, np.float64).ravel()
    if np.isnan(a).any():  # only the argmax is known (the engine methods): top-1 agreement alone
        return {"logit_cosine": float("nan"), "top1_agree": float(np.nanargmax(a) == np.argmax(b)),
                f"top{k}_overlap": float("nan")}
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
    top_a, top_b = np.argsort(-a)[:k], np.argsort(-b)[:k]
    return {"logit_cosine": cos, "top1_agree": float(top_a[0] == top_b[0]),
            f"top{k}_overlap": len(set(top_a) & set(top_b)) / k}


def prefill_flops(cfg, num_tokens: int, num_cached: int = 0) -> dict[str, float]:
    """Analytical FLOPs (2 per multiply-add) of prefilling `num_tokens` new tokens after `num_cached`.

    attention = q/k/v/o projections + causal scores and weighted values; ffn = SwiGLU MLP; lm_head is
    left out (one row at the end of a prefill).
    """
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hkv, n = cfg.num_heads, cfg.num_kv_heads, num_tokens
    proj = 2 * n * h * d * (2 * hq + 2 * hkv)
    # Query j (0-based among the new ones) sees num_cached + j + 1 keys.
    keys_seen = n * num_cached + n * (n + 1) / 2
    scores = 2 * 2 * hq * d * keys_seen
    ffn = 2 * n * 3 * h * i
    layers = cfg.num_layers
    attn = layers * (proj + scores)
    return {"attention": float(attn), "ffn": float(layers * ffn), "total": float(attn + layers * ffn)}


def kv_bytes(cfg, num_tokens: int, bytes_per_elem: int = 2) -> int:
    """Bytes of K and V for `num_tokens` tokens in every (layer, KV head)."""
    return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * num_tokens * bytes_per_elem)
