"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: config dict, float32 tensors, tokenizer.

A GGUF holds in one file what a Hugging Face directory spreads over several: the config as `{arch}.*`
metadata, the weights (usually block-quantized) under llama.cpp's tensor names, and the tokenizer as
`tokenizer.ggml.*` arrays plus `tokenizer.chat_template`. `read_gguf` turns each back into what
transformers' `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` would hold, so `jaxkv.load`
continues exactly as for a safetensors checkpoint. Where transformers drops something the file states
(Llama 3 RoPE scaling in `rope_freqs`, llama attention biases, SmolLM's digit split), llama.cpp and the
original checkpoint are followed instead. Dequantization is gguf-py's (`gguf.quants.dequantize`); anything
the model cannot compute exactly is refused with a `CheckpointError`, never approximated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxkv.tokenizer import Tokenizer

# GGUF `general.architecture` -> the transformers class that runs it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED_LAYER = (
    "attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
)  # fmt: skip
_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")
# Layer tensors each architecture may hold beyond `_REQUIRED_LAYER`; any other tensor is refused.
_OPTIONAL_LAYER = {
    "llama": _BIASES,
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": _BIASES + ("attn_q_norm.weight", "attn_k_norm.weight"),
}

# llama.cpp token types (`tokenizer.ggml.token_type`).
_CONTROL, _USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` -> the split regex its merges were learned with (llama.cpp's table, as transformers
# copies it). "smollm" and the GPT-2 names use the GPT-2 regex of the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's LLAMA3 group: whole-word vocabulary hits skip the merges (`ignore_merges`, as in Llama 3's
# tokenizer.json), and BOS is added unless the file says otherwise.
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3")
_PRE_SPLITS = {
    **dict.fromkeys(_LLAMA3_PRES, _LLAMA3_SPLIT),
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
}
_PRE_GPT2 = ("default", "gpt2", "gpt-2")
_PRE_DIGITS = ("smollm",)  # GPT-2 regex after splitting every digit, as SmolLM's tokenizer.json does


def _error(message: str) -> Exception:
    # Imported here: jaxkv.loading wires read_gguf in, so a module-level import would be circular.
    from jaxkv.loading import CheckpointError

    return CheckpointError(message)


@dataclasses.dataclass
class GGUFCheckpoint:
    """A GGUF file in Hugging Face terms (see `read_gguf`)."""

    hf_config: dict  # config.json-style dict for the transformers class in ARCHITECTURES
    tensors: Mapping[str, np.ndarray]  # HF name -> float32 array in HF layout, dequantized on access
    tokenizer: Tokenizer | None  # None when the file has no tokenizer.ggml.* metadata
    generation_config: dict  # bos/eos/pad ids, eos including llama.cpp's end-of-turn ids


class GGUFTensors(Mapping):
    """HF-named tensors of a GGUF file, dequantized to float32 when read.

    Lazy so that a quantized file is never held whole in float32 twice; every access dequantizes again.
    A name the file lacks raises `CheckpointError` (not `KeyError`) naming the file and the GGUF name.
    """

    def __init__(self, path: Path, entries: dict[str, tuple[Any, Any]], gguf_names: dict[str, str]):
        self._path = path
        self._entries = entries  # HF name -> (ReaderTensor, transform or None)
        self._gguf_names = gguf_names  # HF name -> GGUF name, for error messages

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._entries:
            where = f" (GGUF {self._gguf_names[name]!r})" if name in self._gguf_names else ""
            raise _error(f"tensor {name!r}{where} not found in {self._path}")
        tensor, transform = self._entries[name]
        array = _dequantize(tensor, self._path)
        return transform(array) if transform is not None else array

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name, default=None):
        return self[name] if name in self._entries else default

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def gguf_type(self, name: str) -> str:
        """The GGML storage type of `name` (e.g. "Q4_K"), for reporting."""
        return self._entries[name][0].tensor_type.name


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Config, tensors, tokenizer and generation defaults of a llama / qwen2 / qwen3 GGUF file."""
    path = Path(path)
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise _error(
            f"{path}: GGUF architecture {arch!r} is not supported; expected one of {tuple(ARCHITECTURES)}"
        )
    experts = meta.get(f"{arch}.expert_count")
    if experts:
        raise _error(f"{path}: mixture-of-experts GGUF ({arch}.expert_count={experts}) is not supported")
    by_name = {t.name: t for t in reader.tensors}
    hf_config = _hf_config(meta, arch, by_name, path)
    tensors = _tensor_map(arch, by_name, hf_config, path)
    generation_config = _generation_config(meta)
    tokenizer = _tokenizer(meta, hf_config, generation_config, path)
    return GGUFCheckpoint(hf_config, tensors, tokenizer, generation_config)


# ---------------------------------------------------------------- file and metadata


def _open(path: Path):
    if not path.is_file():
        raise _error(f"GGUF file {path} not found")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise _error(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError, struct/numpy errors for truncated or corrupt files
        raise _error(f"cannot read GGUF file {path} (truncated or corrupt?): {type(e).__name__}: {e}") from e


class _Metadata:
    """Typed access to GGUF key/values, decoding only the keys that are asked for."""

    def __init__(self, reader, path: Path):
        self._fields = reader.fields
        self._path = path
        self._cache: dict[str, Any] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default=None):
        if key not in self._fields:
            return default
        if key not in self._cache:
            self._cache[key] = self._decode(key, self._fields[key])
        return self._cache[key]

    def require(self, key: str):
        if key not in self._fields:
            raise _error(f"{self._path}: GGUF metadata {key!r} is missing")
        return self.get(key)

    def _decode(self, key, field):
        from gguf import GGUFValueType

        def scalar(index, vtype):
            part = field.parts[index]
            if vtype == GGUFValueType.STRING:
                return bytes(part).decode("utf-8")
            return part[0].item()

        try:
            if field.types[0] == GGUFValueType.ARRAY:
                if len(field.types) != 2:  # nested arrays: nothing read here uses them
                    return None
                return [scalar(i, field.types[1]) for i in field.data]
            return scalar(field.data[0], field.types[0])
        except (IndexError, UnicodeDecodeError) as e:
            raise _error(f"{self._path}: cannot decode GGUF metadata {key!r}: {e}") from e


# ---------------------------------------------------------------- config


def _hf_config(meta: _Metadata, arch: str, by_name: dict, path: Path) -> dict:
    """The config.json transformers builds from this metadata, plus what it leaves out (RoPE scaling)."""
    key = lambda name: meta.require(f"{arch}.{name}")  # noqa: E731
    heads = int(key("attention.head_count"))
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    ffn = key("feed_forward_length")
    for name, value in (("attention.head_count_kv", kv_heads), ("feed_forward_length", ffn)):
        if isinstance(value, list):  # per-layer values: only uniform ones fit one config
            if len(set(value)) != 1:
                raise _error(f"{path}: per-layer {arch}.{name}={value} is not supported")
    kv_heads = int(kv_heads[0] if isinstance(kv_heads, list) else kv_heads)
    ffn = int(ffn[0] if isinstance(ffn, list) else ffn)
    for name in ("token_embd.weight", "blk.0.attn_q.weight"):
        if name not in by_name:
            raise _error(f"{path}: tensor {name!r} is missing")
    embed = by_name["token_embd.weight"]
    # GGML shapes are innermost-first: [hidden, vocab] is a [vocab, hidden] matrix.
    hidden, vocab = (int(d) for d in embed.shape[:2])
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = int(by_name["blk.0.attn_q.weight"].shape[1]) // heads
    head_dim = int(head_dim)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [ARCHITECTURES[arch]],
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in by_name,
        "torch_dtype": _float_dtype(meta),
    }
    if arch != "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in by_name
    else:
        config["use_sliding_window"] = False
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        config["partial_rotary_factor"] = int(rope_dim) / head_dim  # refused by ModelConfig.from_hf
    scaling = _rope_scaling(meta, arch, by_name, theta, head_dim, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for name, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            config[name] = int(value)
    return config


def _float_dtype(meta: _Metadata) -> str:
    """The dtype of a float (unquantized) file; quantized files dequantize to float32."""
    file_type = meta.get("general.file_type")
    return {1: "float16", 32: "bfloat16"}.get(file_type, "float32")


def _rope_scaling(meta: _Metadata, arch: str, by_name: dict, theta: float, head_dim: int, path: Path):
    """`rope_scaling` from `{arch}.rope.scaling.*`, or Llama 3's from its `rope_freqs` tensor.

    llama.cpp writes Llama 3.x's frequency scaling as per-frequency divisors (`rope_freqs.weight`), not as
    parameters; they are matched against the llama3 formula so the model recomputes them exactly.
    """
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind}
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if factor is not None:
            scaling["factor"] = float(factor)
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if "rope_freqs.weight" not in by_name:
        return None
    divisors = _dequantize(by_name["rope_freqs.weight"], path).reshape(-1)
    if np.all(divisors == 1.0):
        return None
    factor = float(divisors.max())
    # Llama 3.1 / 3.2 values; llama.cpp always writes 8192 as the original context length.
    candidate = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}  # fmt: skip
    expected = _llama3_divisors(theta, head_dim, **candidate)
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-4):
        raise _error(
            f"{path}: tensor 'rope_freqs.weight' holds RoPE frequency factors that do not match llama3 "
            f"scaling (factor {factor}, low/high frequency factors 1/4, original context 8192); "
            "other RoPE scalings are not supported"
        )
    return {"rope_type": "llama3", **candidate}


def _llama3_divisors(theta, dim, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """llama.cpp's `rope_freqs` for llama3 scaling (convert_hf_to_gguf.py, LlamaModel)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _generation_config(meta: _Metadata) -> dict:
    """bos/eos/pad ids; eos also lists end-of-turn / end-of-message ids, which llama.cpp stops on too."""
    out = {}
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        out["bos_token_id"] = int(bos)
    ends = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(int(e) for e in ends if e is not None))
    if ends:
        out["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = int(pad)
    return out


# ---------------------------------------------------------------- tensors


def _tensor_map(arch: str, by_name: dict, config: dict, path: Path) -> GGUFTensors:
    """Map GGUF names to HF names; check every tensor is known, present, and of a readable type."""
    layers = config["num_hidden_layers"]
    allowed = set(_REQUIRED_LAYER) | set(_OPTIONAL_LAYER[arch])
    transforms = {}
    if arch == "llama":
        # llama.cpp's LlamaModel permutes Q/K rows (weights and biases) from HF's rotate-half RoPE layout to
        # GGML's interleaved one; qwen2/qwen3 use GGML's NeoX RoPE and are stored unpermuted.
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        transforms = {"attn_q": lambda w: _unpermute(w, heads), "attn_k": lambda w: _unpermute(w, kv_heads)}
    entries: dict[str, tuple[Any, Any]] = {}
    gguf_names: dict[str, str] = {}
    for gguf_name, hf_name in _GLOBAL_TENSORS.items():
        gguf_names[hf_name] = gguf_name
        if gguf_name in by_name:
            entries[hf_name] = (by_name[gguf_name], None)
    for i in range(layers):
        for leaf, hf_leaf in _LAYER_TENSORS.items():
            gguf_names[f"model.layers.{i}.{hf_leaf}"] = f"blk.{i}.{leaf}"
    for name, tensor in by_name.items():
        if name in _GLOBAL_TENSORS or name == "rope_freqs.weight":
            continue
        block, _, leaf = name.partition(".")[2].partition(".")
        if not (name.startswith("blk.") and block.isdigit() and int(block) < layers and leaf in allowed):
            raise _error(f"{path}: tensor {name!r} is not used by GGUF architecture {arch!r}; not supported")
        hf_name = f"model.layers.{block}.{_LAYER_TENSORS[leaf]}"
        entries[hf_name] = (tensor, transforms.get(leaf.split(".")[0]))
    required = ["token_embd.weight", "output_norm.weight"]
    required += [f"blk.{i}.{leaf}" for i in range(layers) for leaf in _REQUIRED_LAYER]
    if arch == "qwen2":
        required += [f"blk.{i}.{b}" for i in range(layers) for b in _OPTIONAL_LAYER["qwen2"]]
    if arch == "qwen3":
        required += [f"blk.{i}.attn_{x}_norm.weight" for i in range(layers) for x in "qk"]
    if config.get("attention_bias"):
        required += [f"blk.{i}.{b}" for i in range(layers) for b in _BIASES]
    for name in required:
        if name not in by_name:
            raise _error(f"{path}: tensor {name!r} is missing")
    for tensor in by_name.values():
        if not _can_dequantize(tensor.tensor_type):
            raise _error(
                f"{path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which gguf-py "
                "cannot dequantize; not supported"
            )
    return GGUFTensors(path, entries, gguf_names)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` on rows (transformers' `reverse_permute_weights`)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_SUPPORTED_TYPES: dict[int, bool] = {}


def _can_dequantize(qtype) -> bool:
    """Probe gguf-py once per type with one zero block (its support differs between versions)."""
    if qtype not in _SUPPORTED_TYPES:
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        try:
            dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
            _SUPPORTED_TYPES[qtype] = True
        except (NotImplementedError, KeyError, ValueError):
            _SUPPORTED_TYPES[qtype] = False
    return _SUPPORTED_TYPES[qtype]


def _dequantize(tensor, path: Path) -> np.ndarray:
    """A float32 copy (never a view of the memory map) in numpy order: GGML shape reversed."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
        return np.array(values, dtype=np.float32).reshape(shape)
    except Exception as e:  # a truncated file maps fewer bytes than the tensor needs
        raise _error(
            f"{path}: cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}): {e}"
        ) from e


# ---------------------------------------------------------------- tokenizer


def _tokenizer(meta: _Metadata, hf_config: dict, generation_config: dict, path: Path) -> Tokenizer | None:
    """A `tokenizers.Tokenizer` rebuilt from `tokenizer.ggml.*`, with special tokens and chat template."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        tok, byte_level = _byte_level_bpe(meta, tokens, path), True
    elif model == "llama":
        tok, byte_level = _sentencepiece_bpe(meta, tokens, path), False
    else:
        raise _error(
            f"{path}: GGUF tokenizer model tokenizer.ggml.model={model!r} is not supported; "
            "expected 'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE)"
        )
    config: dict[str, Any] = {}
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            config[f"{name}_token"] = tokens[int(index)]
    # llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies unless the file says otherwise
    # (transformers only for SentencePiece). Only True is passed on: the rebuilt tokenizer adds nothing
    # itself, and Tokenizer reads an explicit False as "strip a leading BOS", which would eat a
    # <|im_start|>-style BOS written in the text.
    default_bos = model == "llama" or meta.get("tokenizer.ggml.pre") in _LLAMA3_PRES
    if meta.get("tokenizer.ggml.add_bos_token", default_bos):
        config["add_bos_token"] = True
    if meta.get("tokenizer.ggml.add_eos_token", False):
        config["add_eos_token"] = True
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    _add_special_tokens(tok, tokens, types, config, byte_level)
    return Tokenizer(tok, config, generation_config, hf_config)


def _byte_level_bpe(meta: _Metadata, tokens: list[str], path: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are stored in the byte alphabet (Ġ for space); a few converters store raw text instead.
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    pre = meta.get("tokenizer.ggml.pre", "default")
    ignore_merges = pre in _LLAMA3_PRES
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=ignore_merges,
        )
    )
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _PRE_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    elif pre in _PRE_GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        known = sorted([*_PRE_SPLITS, *_PRE_DIGITS, *_PRE_GPT2])
        raise _error(
            f"{path}: GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported; expected one of {known}"
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: _Metadata, tokens: list[str], path: Path):
    """Llama 2-style vocabulary: BPE with byte fallback over ▁-marked pieces, merges ranked by score."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise _error(f"{path}: SentencePiece GGUF vocabulary has neither merges nor scores")
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two vocabulary pieces, best piece score first (transformers'
    `generate_merges`, which SentencePiece-derived GGUF vocabularies need: they store scores, not merges)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok, tokens: list[str], types: list[int], config: dict, byte_level: bool) -> None:
    """Control tokens and bos/eos/unk/pad match whole and are skipped on decode; user-defined tokens match
    whole but are kept. In a byte-level vocabulary a "control" token spelled outside the byte alphabet is
    a converter mislabel and is left alone (adding it would grow the vocabulary)."""
    from tokenizers import AddedToken

    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    special = [
        t for t, kind in zip(tokens, types) if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    special += [config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in config]
    special = list(dict.fromkeys(special))
    if special:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tok.get_vocab(with_added_tokens=False)
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))
