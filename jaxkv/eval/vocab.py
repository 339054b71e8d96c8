"""Closed vocabulary of the synthetic task suite and the embedded model's tokenizer.

Every word the task generators emit is a whole token, numbers are split into digits (WordPiece ``##``
continuations) and punctuation is its own token, so a prompt's token count is known without tokenizing
(`count_tokens`). The synthetic words are two- or three-syllable nonsense words drawn once from a fixed
seed: the pools (noise, keys, variables, entities, ...) are disjoint slices of that list.
"""

from __future__ import annotations

import functools
import itertools
import random

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PAD, BOS, EOS, UNK = SPECIAL_TOKENS[:4]
END_OF_TURN = "<|end|>"

PUNCT = list(".,:;?!'\"()-=>#/[]*+")
DIGITS = [str(d) for d in range(10)]

# Template words used by task instructions and questions (real English, lower case).
FUNCTION_WORDS = """
a an the is are was were be been of in on at to for from by with and or not no yes it its this that these
those there here what which who whom whose where when how why all any each every some many most more less
few one two three four five six seven eight nine ten first second third last next previous number numbers
special magic hidden text below above read remember memorize find list answer question given value values
variable variables var assign assigned assignment chain follow following word words common frequent
frequency frequently appear appears appeared times time coded code top most output only please
document documents passage passages context based born city country lives live located capital works work
job person people name named my your our i you we me he she they his her their them user assistant
noted okay ok sure thanks thank hello hi got will keep mind favorite color pet car food sport hobby
friend lucky secret password tell told about ask track assignments links helpful b form write best than
hides tells others say said earlier before after then start starting step steps
continue until end ends stop note notes long short story key keys return returns mapping maps map goes
go item items line lines as so if else do does did can could should would must
""".split()

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables


@functools.lru_cache(maxsize=1)
def synthetic_words() -> list[str]:
    """Deterministic list of distinct nonsense words, disjoint from `FUNCTION_WORDS`."""
    rng = random.Random(1234)
    two = ["".join(p) for p in itertools.product(SYLLABLES, repeat=2)]
    rng.shuffle(two)
    taken = set(FUNCTION_WORDS)
    out = [w for w in two if w not in taken]
    return out[:POOL_TOTAL]


POOL_SIZES = {
    "noise": 500,
    "keys": 200,
    "vars": 200,
    "cwe": 300,
    "persons": 120,
    "cities": 120,
    "countries": 60,
    "attr_values": 200,
}
POOL_TOTAL = sum(POOL_SIZES.values())


@functools.lru_cache(maxsize=1)
def pools() -> dict[str, list[str]]:
    words = synthetic_words()
    out, start = {}, 0
    for name, size in POOL_SIZES.items():
        out[name] = words[start : start + size]
        start += size
    return out


def vocabulary() -> list[str]:
    """Token strings in id order: specials, punctuation, digits and their continuations, words."""
    toks = SPECIAL_TOKENS + PUNCT + DIGITS + ["##" + d for d in DIGITS] + FUNCTION_WORDS + synthetic_words()
    seen, out = set(), []
    for t in toks:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def count_tokens(words: list[str]) -> int:
    """Tokens of a list of whitespace-free pieces as the tokenizer will cut them (digits one each)."""
    return sum(len(w) if w.isdigit() else 1 for w in words)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer():
    """The embedded model's `tokenizers.Tokenizer` (WordPiece over the closed vocabulary)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(vocabulary())}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=UNK, continuing_subword_prefix="##",
                                     max_input_chars_per_word=100))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END_OF_TURN,
        "pad_token": PAD,
        "unk_token": UNK,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": True,
        "chat_template": CHAT_TEMPLATE,
    }
