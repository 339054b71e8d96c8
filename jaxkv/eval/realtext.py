"""Long-context tasks over real English prose, for any model's tokenizer (RULER-style, names ``real_*``).

The prose is the Python language reference that ships with the standard library
(`pydoc_data.topics.topics`, ~465K characters, always installed): paragraphs of running text are kept, code
samples, grammar blocks and headings dropped, reST markup removed. It is the haystack filler and the source
of real words (needle keys, the word lists of `real_cwe` / `real_fwe`). Its text follows the running
Python's documentation, so instances are deterministic per Python minor version.

Every instance is an `Instance` (``prefix | segments | suffix``, `jaxkv.eval.tasks`) sized with the model's
own tokenizer: prompt ids (prefix, segments, suffix tokenized one by one, as the harness does) plus the
reference answer come within a few percent of ``context`` tokens. With a chat template
(``tokenizer.chat_template``) the prompt is one user turn plus the generation prompt: the template is
rendered around a placeholder, the text before the placeholder opens the prefix and the text after it closes
the suffix, so segments are plain prose whose ids equal their standalone tokenization (each segment ends
in a newline and the next piece starts with a letter, so no BPE merge crosses a boundary). Without a
template the prompt is plain text (the tokenizer's BOS text first, when it adds one). Like RULER, an
answer prefix follows the generation prompt ("The pass key is"), so the answer is the next thing written.

Tasks: ``real_passkey``, ``real_niah_single``, ``real_niah_multikey``, ``real_niah_multivalue``,
``real_niah_multiquery``, ``real_vt``, ``real_cwe``, ``real_fwe``, ``real_rag`` (documents as segments,
for the reuse methods). ``real_fidelity`` is no task: see `fidelity_sample`.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections.abc import Callable

from jaxkv.eval.tasks import Instance

PLACEHOLDER = "\u2063JAXKV_USER_CONTENT\u2063"

_HEADING_RULE = re.compile(r"^[*=\-~^\"]{3,}$")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])")
_WORD = re.compile(r"^[a-z]{5,11}$")


def _clean(par: str) -> str:
    """One paragraph of reST-ish text -> one line of plain prose."""
    text = " ".join(line.strip() for line in par.splitlines())
    text = re.sub(r"\*\*?([^*]+)\*\*?", r"\1", text)       # *emphasis*, **strong**
    text = re.sub(r"``?([^`]+)``?", r"\1", text)           # `literal`
    text = re.sub(r"\[\d+\]", "", text)                    # footnote marks
    return " ".join(text.split())


def _is_prose(par: str) -> bool:
    lines = par.splitlines()
    if not lines or any(line.startswith((" ", "\t")) for line in lines):  # code, grammar, nested lists
        return False
    if any(_HEADING_RULE.match(line.strip()) for line in lines):
        return False
    text = _clean(par)
    words = text.split()
    if len(words) < 12 or not text.endswith(".") or ">>>" in text or "::=" in text:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) > 0.85 and text[0].isupper()


@functools.cache
def documents() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(title, prose paragraphs) per reference topic with any prose, in a fixed order."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        raw = topics[key]
        title = raw.strip().splitlines()[0].strip()
        pars = tuple(_clean(p) for p in re.split(r"\n\s*\n", raw) if _is_prose(p))
        if pars:
            out.append((title, pars))
    return tuple(out)


@functools.cache
def sentences() -> tuple[str, ...]:
    """Every prose sentence of the reference, in reading order."""
    return tuple(s for _, pars in documents() for p in pars for s in _SENTENCE_END.split(p) if s)


@functools.cache
def words() -> tuple[str, ...]:
    """Distinct plain lowercase words (5-11 letters) of the prose, sorted: the real-word pool."""
    seen = {w.strip(string.punctuation) for s in sentences() for w in s.split()}
    return tuple(sorted(w for w in seen if _WORD.match(w)))


# ---- prompt rendering ----------------------------------------------------------------------------------


def chat_frame(tok) -> tuple[str, str]:
    """(text before, text after) the user content: the chat template rendered around a placeholder as one
    user turn with the generation prompt, or plain text (the BOS text when the tokenizer adds one, a newline
    between the question and the answer prefix)."""
    template = getattr(tok, "chat_template", None)
    if template:
        text = tok.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True)
        if text.count(PLACEHOLDER) != 1:
            raise ValueError("the chat template does not render the user content verbatim exactly once")
        head, tail = text.split(PLACEHOLDER)
        return head, tail
    bos = getattr(tok, "bos_token", None)
    probe = tok.encode("a", add_special_tokens=True)
    adds_bos = bos and tok.token_to_id(bos) is not None and probe[:1] == [tok.token_to_id(bos)]
    return (bos if adds_bos else ""), "\n"


def count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False)) if text else 0


def pieces_tokens(tok, inst: Instance) -> int:
    """Prompt tokens as the harness feeds them: prefix, segments and suffix tokenized one by one."""
    return count(tok, inst.prefix) + sum(count(tok, s) for s in inst.segments) + count(tok, inst.suffix)


def _segments_of(items: list[str], num_segments: int) -> list[str]:
    """Sentences (or list items) -> `num_segments` newline-ended segments of about equal item counts."""
    n = max(1, min(num_segments, len(items)))
    bounds = [round(i * len(items) / n) for i in range(n + 1)]
    return [" ".join(items[bounds[i]:bounds[i + 1]]) + "\n" for i in range(n)]


def default_segments(context: int) -> int:
    return max(2, min(8, context // 1024))


class _Builder:
    """Fits filler (a function of an item count) to a token budget measured with the tokenizer."""

    def __init__(self, tok, context: int):
        self.tok, self.context = tok, context

    def total(self, inst: Instance) -> int:
        return pieces_tokens(self.tok, inst) + count(self.tok, inst.target)

    def fit(self, build: Callable[[int], Instance], per_item: float) -> Instance:
        """`build(n)` -> instance with n filler items: the largest n whose prompt + answer fits `context`
        (bracketed from an estimate, then bisected: more items never give fewer tokens)."""
        fits = lambda n: self.total(build(n)) <= self.context  # noqa: E731
        if not fits(1):
            raise ValueError(f"context {self.context} is too small for this task with this tokenizer")
        lo, hi = 1, max(2, int(self.context / per_item))
        while fits(hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return build(lo)


def _sentence_run(rng: random.Random, n: int) -> list[str]:
    """n consecutive sentences of the reference from a random start (wrapping around)."""
    sents = sentences()
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(n)]


def _prose(rng: random.Random, num_words: int) -> list[str]:
    """Consecutive sentences from a random start holding `num_words` words in all, the last one cut short
    (ended with a period): filler with word granularity, so a long sentence does not miss the budget."""
    sents = sentences()
    start, out, have = rng.randrange(len(sents)), [], 0
    while have < num_words:
        words_ = sents[(start + len(out)) % len(sents)].split()
        take = min(len(words_), num_words - have)
        cut = " ".join(words_[:take])
        out.append(cut if take == len(words_) else cut.rstrip(string.punctuation) + ".")
        have += take
    return out


def _insert(rng: random.Random, filler: list[str], items: list[str], keep_order: bool = False) -> list[str]:
    """`items` inserted at random sentence boundaries of `filler` (in order when keep_order)."""
    slots = sorted(rng.randint(0, len(filler)) for _ in items)
    if not keep_order:
        items = rng.sample(items, len(items))
    out, j = [], 0
    for i in range(len(filler) + 1):
        while j < len(items) and slots[j] == i:
            out.append(items[j])
            j += 1
        if i < len(filler):
            out.append(filler[i])
    return out


def _haystack_instance(tok, rng: random.Random, context: int, task: str, intro: str, items: list[str],
                       question: str, answer_prefix: str, answers: tuple[str, ...], metric: str,
                       num_segments: int | None, meta: dict, keep_order: bool = False) -> Instance:
    head, tail = chat_frame(tok)
    ns = num_segments or default_segments(context)
    seed = rng.random()
    target = ", ".join(answers)

    def build(n: int) -> Instance:
        r = random.Random(seed)  # same draw for every n: only the amount of filler changes
        hay = _insert(r, _prose(r, n), items, keep_order)
        return Instance(task, head + intro + "\n", tuple(_segments_of(hay, ns)),
                        question + tail + answer_prefix, target, answers, metric, meta)

    return _Builder(tok, context).fit(build, per_item=_tokens_per_word(tok))


@functools.lru_cache(maxsize=8)
def _tokens_per_sentence(tok) -> float:
    sample = sentences()[::97]
    return max(1.0, sum(count(tok, s) + 1 for s in sample) / len(sample))


@functools.lru_cache(maxsize=8)
def _tokens_per_word(tok) -> float:
    sample = sentences()[::97]
    return max(0.1, sum(count(tok, s) + 1 for s in sample) / sum(len(s.split()) for s in sample))


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _keys(rng: random.Random, n: int) -> list[str]:
    """n distinct two-word keys of real words (``iterator-boundary``): absent from the prose itself."""
    pool = words()
    keys: list[str] = []
    while len(keys) < n:
        k = f"{rng.choice(pool)}-{rng.choice(pool)}"
        if k not in keys:
            keys.append(k)
    return keys


NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.")


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is: {value}."


# ---- tasks ---------------------------------------------------------------------------------------------


def passkey(tok, rng, context, num_segments=None) -> Instance:
    key = _number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return _haystack_instance(
        tok, rng, context, "real_passkey",
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.", [needle],
        "What is the pass key?", "The pass key is", (key,), "all", num_segments, {})


def niah_single(tok, rng, context, num_segments=None) -> Instance:
    key, value = _keys(rng, 1)[0], _number(rng, 7)
    return _haystack_instance(
        tok, rng, context, "real_niah_single", NIAH_INTRO, [_needle(key, value)],
        f"What is the special magic number for {key} mentioned in the provided text?",
        f"The special magic number for {key} mentioned in the provided text is", (value,), "all",
        num_segments, {"keys": [key]})


def niah_multikey(tok, rng, context, num_segments=None, num_keys: int = 4) -> Instance:
    keys = _keys(rng, num_keys)
    values = [_number(rng, 7) for _ in keys]
    asked = rng.randrange(num_keys)
    return _haystack_instance(
        tok, rng, context, "real_niah_multikey", NIAH_INTRO,
        [_needle(k, v) for k, v in zip(keys, values, strict=True)],
        f"What is the special magic number for {keys[asked]} mentioned in the provided text?",
        f"The special magic number for {keys[asked]} mentioned in the provided text is", (values[asked],),
        "all", num_segments, {"keys": [keys[asked]]})


def niah_multivalue(tok, rng, context, num_segments=None, num_values: int = 4) -> Instance:
    key = _keys(rng, 1)[0]
    values = [_number(rng, 7) for _ in range(num_values)]
    return _haystack_instance(
        tok, rng, context, "real_niah_multivalue", NIAH_INTRO, [_needle(key, v) for v in values],
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are", tuple(values), "all",
        num_segments, {"keys": [key]})


def niah_multiquery(tok, rng, context, num_segments=None, num_keys: int = 4) -> Instance:
    keys = _keys(rng, num_keys)
    values = [_number(rng, 7) for _ in keys]
    listed = ", ".join(keys[:-1]) + f", and {keys[-1]}"
    return _haystack_instance(
        tok, rng, context, "real_niah_multiquery", NIAH_INTRO,
        [_needle(k, v) for k, v in zip(keys, values, strict=True)],
        f"What are all the special magic numbers for {listed} mentioned in the provided text?",
        f"The special magic numbers for {listed} mentioned in the provided text are", tuple(values), "all",
        num_segments, {"keys": keys})


def vt(tok, rng, context, num_segments=None, num_chains: int = 2, num_hops: int = 4) -> Instance:
    """Variable tracking: ``VAR ABCDE = 12345.`` then ``VAR FGHIJ = VAR ABCDE.`` ... inside the prose,
    one distractor chain; asks every variable holding the first chain's value."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    chains = [names[c * (num_hops + 1):(c + 1) * (num_hops + 1)] for c in range(num_chains)]
    values = rng.sample(range(10000, 99999), num_chains)
    stmts = []
    for c, chain in enumerate(chains):
        stmts.append([f"VAR {chain[0]} = {values[c]}."]
                     + [f"VAR {chain[h + 1]} = VAR {chain[h]}." for h in range(num_hops)])
    merged, heads = [], [0] * num_chains   # chains interleaved, each in its own order
    while any(h < len(s) for h, s in zip(heads, stmts, strict=True)):
        c = rng.choice([i for i in range(num_chains) if heads[i] < len(stmts[i])])
        merged.append(stmts[c][heads[c]])
        heads[c] += 1
    return _haystack_instance(
        tok, rng, context, "real_vt",
        "Memorize and track the chain(s) of variable assignment hidden in the following text.", merged,
        f"Question: Find all variables that are assigned the value {values[0]} in the text above.",
        f"Answer: According to the chain(s) of variable assignment in the text above, {num_hops + 1} "
        f"variables are assigned the value {values[0]}, they are:", tuple(chains[0]), "all", num_segments,
        {"value": values[0]}, keep_order=True)


def cwe(tok, rng, context, num_segments=None, num_common: int = 5, common_freq: int = 12,
        rare_freq: int = 2) -> Instance:
    """Common-words extraction (RULER cwe): a numbered list of real words, `num_common` of them repeated
    `common_freq` times, the rest `rare_freq` times."""
    head, tail = chat_frame(tok)
    ns = num_segments or default_segments(context)
    seed = rng.random()

    def build(n_rare: int) -> Instance:
        r = random.Random(seed)
        chosen = r.sample(words(), min(len(words()), num_common + n_rare))
        common, rare = chosen[:num_common], chosen[num_common:]
        items = common * common_freq + rare * rare_freq
        r.shuffle(items)
        listed = [f"{i + 1}. {w}" for i, w in enumerate(items)]
        return Instance("real_cwe", head + "Below is a numbered list of words. In these words, some appear "
                        "more often than others. Memorize the ones that appear most often.\n",
                        tuple(_segments_of(listed, ns)),
                        f"Question: What are the {num_common} most common words in the above list?" + tail
                        + f"Answer: The top {num_common} words that appear most often in the list are:",
                        ", ".join(common), tuple(common), "all", {"common_freq": common_freq})

    per = rare_freq * (count(tok, " 123. " + words()[len(words()) // 2]))
    return _Builder(tok, context).fit(build, per_item=per)


def fwe(tok, rng, context, num_segments=None, alpha: float = 1.3, vocab: int = 60) -> Instance:
    """Frequent-words extraction (RULER fwe) over real words drawn from a Zipf(alpha) law; the top 3."""
    head, tail = chat_frame(tok)
    ns = num_segments or default_segments(context)
    seed = rng.random()

    def build(n: int) -> Instance:
        r = random.Random(seed)
        pool = r.sample(words(), vocab)
        drawn = r.choices(pool, weights=[1.0 / (k + 1) ** alpha for k in range(vocab)], k=n)
        counts = {w: drawn.count(w) for w in pool}
        top = tuple(sorted(pool, key=lambda w: (-counts[w], pool.index(w)))[:3])
        chunks = [" ".join(drawn[i:i + 10]) + " ..." for i in range(0, n, 10)]
        return Instance("real_fwe", head + "Read the following coded text and track the frequency of each "
                        "coded word. Find the three most frequently appeared coded words.\n",
                        tuple(_segments_of(chunks, ns)),
                        "Question: Do not provide any explanation. Please ignore the dots '....'. What are "
                        "the three most frequently appeared words in the above coded text?" + tail
                        + "Answer: According to the coded text above, the three most frequently appeared "
                        "words are:", ", ".join(top), top, "all", {"counts": [counts[w] for w in top]})

    per = count(tok, " " + " ".join(words()[100:110]) + " ...") / 10
    return _Builder(tok, context).fit(build, per_item=per)


def rag(tok, rng, context, num_segments=None) -> Instance:
    """RAG layout: `num_segments` reference sections as documents (the segments), each holding its own
    access code at a random sentence; the question names one section by title and asks its code."""
    head, tail = chat_frame(tok)
    nd = num_segments or max(4, min(16, context // 256))
    docs = documents()
    if nd > len(docs):
        raise ValueError(f"real_rag has at most {len(docs)} documents, got {nd}")
    chosen = rng.sample(range(len(docs)), nd)
    codes = [_number(rng, 7) for _ in chosen]
    gold = rng.randrange(nd)
    title = docs[chosen[gold]][0]
    seed = rng.random()

    def build(n: int) -> Instance:
        r = random.Random(seed)
        segs = []
        for d, (idx, code) in enumerate(zip(chosen, codes, strict=True)):
            doc_title, pars = docs[idx]
            per_doc = n // nd + (d < n % nd)  # n sentences in all, spread evenly
            sents = [s for p in pars for s in _SENTENCE_END.split(p)]
            sents = (sents * (per_doc // len(sents) + 1))[:per_doc]  # short sections repeat
            body = _insert(r, sents, [f"The access code of this section is {code}."])
            segs.append(f"Document {d + 1} ({doc_title}): " + " ".join(body) + "\n")
        return Instance("real_rag", head + "Answer the question based on the documents below.\n", tuple(segs),
                        f"Question: What is the access code of the section titled \"{title}\"?" + tail
                        + "Answer: The access code is", codes[gold], (codes[gold],), "all",
                        {"gold_doc": gold, "title": title})

    return _Builder(tok, context).fit(build, per_item=_tokens_per_sentence(tok))


TASKS: dict[str, Callable[..., Instance]] = {
    "real_passkey": passkey, "real_niah_single": niah_single, "real_niah_multikey": niah_multikey,
    "real_niah_multivalue": niah_multivalue, "real_niah_multiquery": niah_multiquery, "real_vt": vt,
    "real_cwe": cwe, "real_fwe": fwe, "real_rag": rag,
}
MIN_CONTEXT = 512


def make_instances(task: str, tok, context: int, num: int, seed: int = 0, **kwargs) -> list[Instance]:
    """`num` deterministic instances of a real-text task sized with `tok` (prompt + answer <= context)."""
    if task not in TASKS:
        raise ValueError(f"unknown real-text task {task!r}; choose from {sorted(TASKS)}")
    if context < MIN_CONTEXT:
        raise ValueError(f"context must be >= {MIN_CONTEXT} tokens, got {context}")
    return [TASKS[task](tok, random.Random(f"{task}:{context}:{seed}:{i}"), context, **kwargs)
            for i in range(num)]


# ---- next-token fidelity -------------------------------------------------------------------------------

FIDELITY_TASK = "real_fidelity"


def fidelity_sample(tok, context: int, continuation: int, seed: int,
                    index: int) -> tuple[list[int], list[int]]:
    """(prompt ids, continuation ids): `context` tokens of running prose from a random sentence, then the
    next `continuation` tokens of the same text (cut at token level, so the continuation is the real one)."""
    rng = random.Random(f"{FIDELITY_TASK}:{context}:{seed}:{index}")
    head, _ = chat_frame_plain(tok)
    sents = _sentence_run(rng, int((context + continuation) / _tokens_per_sentence(tok) * 1.5) + 8)
    ids = tok.encode(head + " ".join(sents), add_special_tokens=False)
    if len(ids) < context + continuation:
        raise ValueError(f"not enough prose for {context} + {continuation} tokens")
    return ids[:context], ids[context:context + continuation]


def chat_frame_plain(tok) -> tuple[str, str]:
    """The plain-text frame (BOS text when the tokenizer adds one): fidelity feeds raw prose, no chat turn."""
    class _NoTemplate:
        chat_template = None

        def __getattr__(self, name):
            return getattr(tok, name)

    return chat_frame(_NoTemplate())


def reference_logprobs(model, prompt: list[int], forced: list[int]):
    """Full-attention log-probabilities [len(forced), V] of the token after prompt + forced[:j], j = 1..n:
    one dense causal forward over prompt + forced[:-1] (float32 on the host)."""
    import jax
    import numpy as np

    from jaxkv.models import llama

    ids = np.asarray(prompt + forced[:-1], np.int32)[None]
    logits = llama.dense_logits(model.params, model.config, jax.numpy.asarray(ids))[0, len(prompt):]
    return np.asarray(jax.nn.log_softmax(logits.astype("float32"), axis=-1))


def engine_forced_top(model, policy, head_classes, prompt: list[int], forced: list[int]):
    """Per forced token after the first, the engine's top-`MAX_LOGPROBS` (ids, logprobs) of the next token,
    with the request's cache as `policy` leaves it (prefill-time policies compress after the first token).

    Teacher forcing: one decode step per call, no pipelining, and before each step the request's last
    output token is set to the real one, so the next step's input is the real continuation (the engine
    reads a decode step's input token from the request)."""
    from jaxkv.engine.buckets import pow2_bucket
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import MAX_LOGPROBS, SamplingParams

    eng = Engine(model, max_num_seqs=1, max_model_len=pow2_bucket(len(prompt) + len(forced) + 1),
                 head_classes=head_classes, enable_prefix_caching=False, kv_policy=policy, decode_steps=1,
                 pipeline_decode=False)
    sp = SamplingParams(temperature=0.0, max_tokens=len(forced), ignore_eos=True, logprobs=MAX_LOGPROBS)
    rid = eng.add_request(prompt, sp)
    req = eng._requests[rid]
    tops = []
    while eng.has_unfinished():
        for out in eng.step():
            k = len(req.output_ids)
            if k > 1:  # the first token comes from the prefill, before any compression
                tops.append(out.new_top_logprobs[0])
            if k <= len(forced):
                req.output_ids[-1] = forced[k - 1]
    return tops


def forced_agreement(ref_logprobs, tops) -> dict[str, float]:
    """Top-1 agreement and KL(full || method) per position, averaged.

    The method's distribution is known on its top-K tokens only (the engine's alternatives), so the KL is
    computed on the coarse-grained distributions over {full's top-K tokens} + {every other token}: exact
    when the method's top-K holds full's top-K, else a token missing from it gets the method's K-th logprob
    (an upper bound of its true value). Coarse-graining never raises a KL: this reads as an estimate from
    below of the true KL."""
    import numpy as np

    agree, kls = [], []
    for ref, top in zip(ref_logprobs, tops, strict=True):
        ids = [int(i) for i, _ in top]
        lps = dict(top)
        agree.append(float(int(np.argmax(ref)) == ids[0]))
        k = len(top)
        ref_top = np.argsort(-ref)[:k]
        floor = min(lps.values())
        p = np.exp(ref[ref_top])
        q = np.exp(np.asarray([lps.get(int(i), floor) for i in ref_top]))
        p_rest, q_rest = max(1.0 - p.sum(), 1e-12), max(1.0 - q.sum(), 1e-12)
        kl = np.sum(p * (np.log(p) - np.log(q))) + p_rest * (np.log(p_rest) - np.log(q_rest))
        kls.append(max(float(kl), 0.0))  # >= 0 up to float rounding
    return {"top1_agree": float(np.mean(agree)), "kl": float(np.mean(kls))}
