"""Tiny random Hugging Face checkpoints for tests, built in-process (nothing is downloaded).

`make_tiny_checkpoint(family, path)` writes a complete Hugging Face directory: config.json,
model.safetensors (or a sharded index), tokenizer.json trained with `tokenizers`, tokenizer_config.json
with a jinja2 chat template, and generation_config.json. Weights are random with a larger spread than
HF's default init (and random norm weights / biases) so every parameter matters and greedy decoding
is not decided by near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_WORDS = (
    "the of and to in is was for on that with as by at from his her he she it they we you this "
    "which are be or an had not but were have has their its one all been two more when who can "
    "there after other first also time new into only some these may over would most such about "
    "three between city during year years later many part under then made state world while "
    "known both where before through four since school house river water music film game team "
    "long small large great high old young early late north south east west king queen war peace "
    "cache head page token model layer query key value window sink prefix segment attention "
    "red green blue black white light dark fast slow hot cold open close begin end start stop "
    "hello world question answer user assistant system tool call result document chapter story"
).split()

_SPECIALS = {
    "llama": {
        "bos": "<s>",
        "eos": "</s>",
        "pad": "<pad>",
        "extra": ["<|user|>", "<|assistant|>", "<|system|>"],
    },
    "mistral": {"bos": "<s>", "eos": "</s>", "pad": None, "extra": ["[INST]", "[/INST]"]},
    "qwen2": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "extra": ["<|im_start|>"]},
    "qwen3": {"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "extra": ["<|im_start|>"]},
}

_TEMPLATES = {
    "llama": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
        "{{ '<|' + message['role'] + '|>' }} {{ message['content'] | trim }}{{ eos_token }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "qwen2": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
        "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}
_TEMPLATES["qwen3"] = _TEMPLATES["qwen2"]

_BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    tie_word_embeddings=False,
)

_FAMILY_DEFAULTS = {
    "llama": dict(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": dict(rope_theta=10000.0, sliding_window=8, head_dim=16),
    "qwen2": dict(
        rope_theta=1000000.0,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(rope_theta=1000000.0, head_dim=24, num_attention_heads=6, num_key_value_heads=2),
}


def hf_config(family: str, **overrides):
    """The transformers config object for a tiny model of `family` (overrides win)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kw = {**_BASE, **_FAMILY_DEFAULTS[family], **overrides}
    # transformers 5 folds rope_theta / rope_scaling into rope_parameters.
    rope = dict(kw.pop("rope_scaling", None) or {"rope_type": "default"})
    rope["rope_theta"] = kw.pop("rope_theta", 10000.0)
    kw["rope_parameters"] = rope
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    return cls(**kw)


def _train_tokenizer(family: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    sp = _SPECIALS[family]
    specials = [t for t in ("<unk>", sp["bos"], sp["eos"], sp["pad"]) if t] + sp["extra"]
    specials = list(dict.fromkeys(specials))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(0, len(_WORDS), 7)]
    tok.train_from_iterator(corpus, trainer)
    if sp["bos"]:
        bos_id = tok.token_to_id(sp["bos"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{sp['bos']} $A",
            pair=f"{sp['bos']} $A {sp['bos']} $B",
            special_tokens=[(sp["bos"], bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_tiny_checkpoint(
    family: str, path, seed: int = 0, *, shards: bool = False, dtype: str = "float32", **config_overrides
) -> Path:
    """Write a random tiny Hugging Face checkpoint of `family` into `path` and return it.

    family: "llama" (llama3 rope scaling), "mistral" (sliding window 8), "qwen2" (QKV bias, window 8 on
    layers >= 1, tied embeddings), "qwen3" (q/k norm, head_dim 24 != hidden/heads). All use GQA 2-3.
    shards: save a model.safetensors.index.json with several shards. dtype: "float32" or "bfloat16".
    config_overrides: any transformers config field (rope_theta / rope_scaling are accepted too).
    """
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(family, **config_overrides)
    tok = _train_tokenizer(family, min(cfg.vocab_size, 320))
    sp = _SPECIALS[family]
    cfg.bos_token_id = tok.token_to_id(sp["bos"]) if sp["bos"] else None
    cfg.eos_token_id = tok.token_to_id(sp["eos"])
    cfg.pad_token_id = tok.token_to_id(sp["pad"]) if sp["pad"] else None

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(cfg.initializer_range * torch.randn(p.shape, generator=gen))
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    elif dtype != "float32":
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB" if shards else "10GB")

    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sp["bos"],
        "eos_token": sp["eos"],
        "pad_token": sp["pad"],
        "unk_token": "<unk>",
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": _TEMPLATES[family],
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    eos = [cfg.eos_token_id] + ([tok.token_to_id(sp["pad"])] if family.startswith("qwen") else [])
    gen_cfg = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_new_tokens": 64,
    }
    if cfg.pad_token_id is not None:
        gen_cfg["pad_token_id"] = cfg.pad_token_id
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    return path


def sharp_gqa_toy(path: Path, seed: int) -> Path:
    """A random 3-layer GQA model (4 query / 2 KV heads of 8) in HF layout, from `tools.train_tiny`, with
    Q/K projections scaled 6x over the 0.02 init: attention sharp enough that page or token selections
    change the output (retrieval policy tests)."""
    from tools import train_tiny as tt

    root = Path(__file__).resolve().parents[1]
    conf = json.loads((root / "configs" / "tiny_default.json").read_text())["model"]
    conf.update(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8)
    cfg = tt.hf_config(conf)
    params = tt.init_params(cfg, seed)
    params = {k: v * (6.0 if "q_proj" in k or "k_proj" in k else 1.0) for k, v in params.items()}
    tt.export_hf(params, cfg, path)
    return path
