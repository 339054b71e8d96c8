"""Synthetic long-context tasks with explicit reuse structure.

Every instance is ``prefix | segments | suffix`` plus the expected ``answers``:

* ``prefix``   instructions (starts the chat: ``<s><|user|>`` or a system turn),
* ``segments`` reusable blocks (haystack chunks, documents, chat history); each ends in a newline so the
  token ids of the pieces tokenized one by one concatenate to the ids of the whole prompt,
* ``suffix``   the question, closing the user turn and opening the assistant turn,
* ``target``   the reference completion (what the model is trained to write, ended by ``<|end|>``),
* ``answers``  the items the metric looks for in a completion.

Generation is deterministic in ``(task, context, seed, index)``. ``context`` is the token budget of
prompt plus reference completion. Tasks (RULER-style unless noted):

* ``mq_niah``  several keys, one needle each, spread over the segments; asks for a subset of keys.
* ``vt``       variable-tracking chains whose links are spread over (and cross) the segments.
* ``cwe`` / ``fwe`` common-word / frequent-coded-word extraction.
* ``qa``       two-hop QA over N documents (RAG layout, gold documents at random positions).
* ``chat``     multi-turn memory: facts stated in early turns, asked at the end.
* ``chain``    long generation: follow a word chain stored in the context for hundreds of steps; each
  output token retrieves the link of the token the model itself wrote just before.

The ``real_*`` tasks over real prose, sized with a model's tokenizer, live in `jaxkv.eval.realtext`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from jaxkv.eval.vocab import END_OF_TURN, count_tokens, pools

MIN_CONTEXT = 512


@dataclasses.dataclass(frozen=True)
class Instance:
    task: str
    prefix: str
    segments: tuple[str, ...]
    suffix: str
    target: str
    answers: tuple[str, ...]
    metric: str  # "all" (fraction of answers found), "list" (... among the first len(answers) words), "chain"
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.prefix + "".join(self.segments) + self.suffix

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"segments": list(self.segments), "answers": list(self.answers)}

    @classmethod
    def from_json(cls, d: dict) -> Instance:
        d = dict(d)
        d["segments"] = tuple(d["segments"])
        d["answers"] = tuple(d["answers"])
        return cls(**d)


USER_OPEN = "<s><|user|>\n"
ASSISTANT_OPEN = f"{END_OF_TURN}\n<|assistant|>\n"


def _num(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _noise_sentence(rng: random.Random) -> list[str]:
    words = pools()["noise"]
    return [rng.choice(words) for _ in range(rng.randint(4, 10))] + ["."]


def _fill(rng: random.Random, budget: int, items: list[list[str]], keep_order: bool = True) -> list[str]:
    """Noise sentences around `items` (token lists) inserted at random sentence boundaries."""
    need = budget - sum(count_tokens(it) for it in items)
    sents = []
    while need > 0:
        s = _noise_sentence(rng)
        if len(s) > need:
            s = s[: max(1, need - 1)] + ["."]
        sents.append(s)
        need -= len(s)
    slots = sorted(rng.randint(0, len(sents)) for _ in items)
    if not keep_order:
        items = rng.sample(items, len(items))
    out: list[str] = []
    j = 0
    for i in range(len(sents) + 1):
        while j < len(items) and slots[j] == i:
            out += items[j]
            j += 1
        if i < len(sents):
            out += sents[i]
    return out


def _join(words: list[str]) -> str:
    return " ".join(words) + "\n"


def _spread(rng: random.Random, items: list[list[str]], num_segments: int, budget: int,
            keep_order: bool) -> list[str]:
    """Distribute items over segments (in order if keep_order) and fill each segment to `budget`."""
    if keep_order:
        cuts = sorted(rng.randint(0, num_segments - 1) for _ in items)
    else:
        cuts = [rng.randint(0, num_segments - 1) for _ in items]
    per = [[it for it, c in zip(items, cuts, strict=True) if c == s] for s in range(num_segments)]
    return [_join(_fill(rng, budget, p, keep_order)) for p in per]


def _layout(context: int, prefix: str, suffix_words: list[str], target_tokens: int, num_segments: int) -> int:
    fixed = count_tokens(prefix.split()) + 2 + count_tokens(suffix_words) + 4 + target_tokens + 1
    budget = (context - fixed) // num_segments
    if budget < 16:
        raise ValueError(f"context {context} is too small for this task layout")
    return budget


def _default_segments(context: int) -> int:
    return max(2, min(8, context // 1024))


def mq_niah(rng: random.Random, context: int, num_segments: int | None = None,
            num_queries: int | None = None) -> Instance:
    """Needles ``... number KEY NUMBER KEY .``; the question lists 1-4 keys side by side and the answer
    re-lists them as ``KEY NUMBER KEY``: every answer token follows a unique token (the key just written:
    its number in the needle, the next queried key in the question) or continues the copied needle."""
    ns = num_segments or _default_segments(context)
    keys = rng.sample(pools()["keys"], 6)
    nums = [_num(rng, 6) for _ in keys]
    nq = num_queries or rng.randint(1, 4)
    queried = rng.sample(range(len(keys)), nq)
    needles = [["the", "special", "magic", "number", k, n, k, "."] for k, n in zip(keys, nums, strict=True)]
    prefix = USER_OPEN + ("some special magic numbers are hidden in the text below . "
                          "memorize them , i will ask about them .\n")
    qk = [keys[i] for i in queried]
    q = ["what", "are", "the", "special", "magic", "numbers", "for", *qk, "?"]
    tgt = []
    for i, k in enumerate(qk):
        tgt += [k, nums[queried[i]], k]
    budget = _layout(context, prefix, q, count_tokens(tgt), ns)
    segs = _spread(rng, needles, ns, budget, keep_order=False)
    return Instance("mq_niah", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    tuple(nums[i] for i in queried), "all", {"keys": qk})


def vt(rng: random.Random, context: int, num_segments: int | None = None, num_chains: int = 2,
       num_hops: int = 4) -> Instance:
    ns = num_segments or _default_segments(context)
    names = rng.sample(pools()["vars"], num_chains * (num_hops + 1))
    chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
    values = rng.sample(pools()["attr_values"], num_chains)
    # Source-first statements ``var SRC DST .`` (DST takes the value of SRC): every name is the left
    # element of exactly one statement, so each hop is the word right after the word just written.
    stmts = []
    for c, chain in enumerate(chains):
        s = [["var", values[c], chain[0], "."]]
        s += [["var", chain[h], chain[h + 1], "."] for h in range(num_hops)]
        stmts.append(s)
    # Interleave chains while keeping each chain's order: merged sequence, then spread in order.
    merged, heads = [], [0] * num_chains
    while any(h < len(s) for h, s in zip(heads, stmts, strict=True)):
        c = rng.choice([i for i in range(num_chains) if heads[i] < len(stmts[i])])
        merged.append(stmts[c][heads[c]])
        heads[c] += 1
    prefix = USER_OPEN + ("memorize and track the chain of variable assignments hidden in the text below .\n")
    q = ["find", "all", "variables", "that", "are", "assigned", "the", "value", values[0], "."]
    tgt = [values[0], *chains[0]]
    budget = _layout(context, prefix, q, count_tokens(tgt), ns)
    segs = _spread(rng, merged, ns, budget, keep_order=True)
    return Instance("vt", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    tuple(chains[0]), "all", {"value": values[0]})


def _other_words() -> list[str]:
    p = pools()
    return p["cwe"] + p["noise"] + p["keys"] + p["vars"] + p["persons"] + p["cities"] + p["attr_values"]


def cwe(rng: random.Random, context: int, num_segments: int | None = None, num_common: int = 5) -> Instance:
    ns = num_segments or _default_segments(context)
    prefix = USER_OPEN + "below is a long list of words . some words appear many more times than others .\n"
    q = ["what", "are", "the", "five", "most", "common", "words", "in", "the", "list", "?"]
    common = rng.sample(pools()["cwe"], num_common)
    tgt = []
    for i, w in enumerate(common):
        tgt += [w] + ([","] if i < num_common - 1 else [])
    budget = _layout(context, prefix, q, count_tokens(tgt), ns)
    total = budget * ns
    rare = [w for w in _other_words() if w not in set(common)]
    freq = max(8, int(4 * total / len(rare)))
    words = [w for w in common for _ in range(freq)]
    words += [rng.choice(rare) for _ in range(total - len(words))]
    rng.shuffle(words)
    segs = [_join(words[s * budget : (s + 1) * budget]) for s in range(ns)]
    # Reference order: first appearance in the text.
    first = {w: words.index(w) for w in common}
    order = sorted(common, key=first.get)
    tgt = []
    for i, w in enumerate(order):
        tgt += [w] + ([","] if i < num_common - 1 else [])
    return Instance("cwe", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    tuple(order), "list", {"freq": freq})


def fwe(rng: random.Random, context: int, num_segments: int | None = None, alpha: float = 1.3) -> Instance:
    ns = num_segments or _default_segments(context)
    prefix = USER_OPEN + ("read the coded text below and track the frequency of each coded word .\n")
    q = ["find", "the", "three", "most", "frequently", "appeared", "coded", "words", "."]
    coded = rng.sample(pools()["cwe"], 60)
    weights = [1.0 / (r + 1) ** alpha for r in range(len(coded))]
    budget = _layout(context, prefix, q, 6, ns)
    total = budget * ns
    words = rng.choices(coded, weights=weights, k=total)
    counts = {w: 0 for w in coded}
    for w in words:
        counts[w] += 1
    top = sorted(coded, key=lambda w: -counts[w])[:3]
    segs = [_join(words[s * budget : (s + 1) * budget]) for s in range(ns)]
    tgt = [top[0], ",", top[1], ",", top[2]]
    return Instance("fwe", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    tuple(top), "list", {})


def qa(rng: random.Random, context: int, num_segments: int | None = None) -> Instance:
    """Two-hop QA: person -> birth city (one document) -> country (another document)."""
    ns = num_segments or max(4, min(64, context // 512))
    p = pools()
    nf = min(2 * ns, 100)
    persons = rng.sample(p["persons"], nf)
    cities = rng.sample(p["cities"], nf)
    countries = [rng.choice(p["countries"]) for _ in cities]
    # ``person P C`` (P was born in city C) and ``city C K`` (city C is located in country K): each hop is
    # the word right after the word just written.
    facts = [["person", persons[i], cities[i], "born", "."] for i in range(nf)]
    facts += [["city", cities[i], countries[i], "located", "."] for i in range(nf)]
    rng.shuffle(facts)
    gold_p = rng.randrange(nf)
    # Person fact and city fact of the gold person go to two different random documents.
    gold_docs = rng.sample(range(ns), 2)
    docs: list[list[list[str]]] = [[] for _ in range(ns)]
    for f in facts:
        if f[1] == persons[gold_p]:
            docs[gold_docs[0]].append(f)
        elif f[0] == "city" and f[1] == cities[gold_p]:
            docs[gold_docs[1]].append(f)
        else:
            docs[rng.randrange(ns)].append(f)
    prefix = USER_OPEN + "answer the question based on the documents below .\n"
    q = ["in", "which", "country", "was", "person", persons[gold_p], "born", "?"]
    tgt = [persons[gold_p], cities[gold_p], countries[gold_p]]
    budget = _layout(context, prefix, q, count_tokens(tgt), ns) - 3
    segs = [_join(["document", str(d + 1), ":"] + _fill(rng, budget, docs[d], keep_order=False))
            for d in range(ns)]
    return Instance("qa", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    (countries[gold_p],), "all", {"gold_docs": gold_docs, "bridge": cities[gold_p]})


CHAT_ATTRS = [["favorite", "color"], ["pet"], ["car"], ["favorite", "food"], ["favorite", "sport"],
              ["hobby"], ["best", "friend"], ["lucky", "number"], ["secret", "password"], ["city"]]


def chat(rng: random.Random, context: int, num_segments: int | None = None) -> Instance:
    ns = num_segments or _default_segments(context)
    prefix = "<s><|system|>\nyou are a helpful assistant . remember what the user tells you .<|end|>\n"
    attrs = rng.sample(range(len(CHAT_ATTRS)), 4)
    vals = [_num(rng, 4) if CHAT_ATTRS[a] == ["lucky", "number"] else rng.choice(pools()["attr_values"])
            for a in attrs]
    facts = []
    for a, v in zip(attrs, vals, strict=True):
        facts.append(["<|user|>", "my", *CHAT_ATTRS[a], v, ".", END_OF_TURN, "<|assistant|>",
                      "okay", ",", "i", "will", "keep", "that", "in", "mind", ".", END_OF_TURN])
    asked = rng.sample(range(4), 2)
    q = ["<|user|>", "what", "are", "my", *CHAT_ATTRS[attrs[asked[0]]], "and", "my",
         *CHAT_ATTRS[attrs[asked[1]]], "?"]
    # The answer is the question with each value right after its attribute (as stated in the facts).
    tgt = ["my", *CHAT_ATTRS[attrs[asked[0]]], vals[asked[0]], "and", "my",
           *CHAT_ATTRS[attrs[asked[1]]], vals[asked[1]]]
    budget = _layout(context, prefix, q, count_tokens(tgt), ns)
    # Facts land in the first 3/4 of the history; filler turns are noise chit-chat.
    cuts = sorted(rng.randint(0, max(0, (3 * ns) // 4 - 1)) for _ in facts)
    segs = []
    for s in range(ns):
        items = [f for f, c in zip(facts, cuts, strict=True) if c == s]
        toks, need = [], budget - sum(count_tokens(f) for f in items)
        turns = []
        while need > 0:
            t = ["<|user|>", *_noise_sentence(rng), END_OF_TURN,
                 "<|assistant|>", *_noise_sentence(rng), END_OF_TURN]
            if len(t) > need and turns:  # stop under the budget rather than overshoot it
                break
            turns.append(t)
            need -= len(t)
        slots = sorted(rng.randint(0, len(turns)) for _ in items)
        j = 0
        for i in range(len(turns) + 1):
            while j < len(items) and slots[j] == i:
                toks += items[j]
                j += 1
            if i < len(turns):
                toks += turns[i]
        segs.append(_join(toks))
    return Instance("chat", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    (vals[asked[0]], vals[asked[1]]), "all", {})


def chain(rng: random.Random, context: int, num_segments: int | None = None, steps: int | None = None
          ) -> Instance:
    ns = num_segments or _default_segments(context)
    n = steps or max(16, min(256, context // 32))
    p = pools()
    words = rng.sample(p["keys"] + p["vars"] + p["persons"], n + 1)
    links = [["go", words[i], words[i + 1], "."] for i in range(n)]
    prefix = USER_OPEN + ("the text below hides links of the form go a b . "
                          "follow the chain of links and write each next word .\n")
    q = ["start", "from", words[0], "and", "follow", "the", "chain", "for", str(n), "steps", "."]
    tgt = words  # the start word, then one word per step (each follows the word just written)
    budget = _layout(context, prefix, q, n + 1, ns)
    if budget * ns < 6 * n:
        raise ValueError(f"context {context} is too small for {n} chain steps")
    segs = _spread(rng, links, ns, budget, keep_order=False)
    return Instance("chain", prefix, tuple(segs), " ".join(q) + " " + ASSISTANT_OPEN, " ".join(tgt),
                    tuple(tgt), "chain", {"steps": n})


TASKS: dict[str, Callable[..., Instance]] = {
    "mq_niah": mq_niah, "vt": vt, "cwe": cwe, "fwe": fwe, "qa": qa, "chat": chat, "chain": chain,
}


def make_instance(task: str, context: int, seed: int, index: int, **kwargs) -> Instance:
    if task.startswith("real_"):
        raise ValueError(f"{task!r} is a real-text task: it needs the model's tokenizer "
                         f"(jaxkv.eval.realtext.make_instances)")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    if context < MIN_CONTEXT:
        raise ValueError(f"context must be >= {MIN_CONTEXT} tokens, got {context}")
    rng = random.Random(f"{task}:{context}:{seed}:{index}")
    return TASKS[task](rng, context, **kwargs)


def make_instances(task: str, context: int, num: int, seed: int = 0, tokenizer=None,
                   **kwargs) -> list[Instance]:
    """`num` deterministic instances of `task` at `context` tokens (prompt + reference completion). A
    real-text task (`real_*`, jaxkv/eval/realtext.py) is sized with the model's `tokenizer`."""
    if task.startswith("real_"):
        if tokenizer is None:
            raise ValueError(f"{task!r} is a real-text task: pass the model's tokenizer")
        from jaxkv.eval import realtext

        return realtext.make_instances(task, tokenizer, context, num, seed=seed, **kwargs)
    return [make_instance(task, context, seed, i, **kwargs) for i in range(num)]

