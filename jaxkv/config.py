"""ModelConfig: a normalised, validated view of a Hugging Face Llama-family config.json.

One dataclass covers Llama 2/3/3.1/3.2 (llama3 RoPE scaling), Mistral (sliding window), Qwen2/2.5
(QKV bias, per-layer sliding window) and Qwen3 (q/k RMSNorm, explicit head_dim). Anything the model
cannot compute exactly raises `UnsupportedConfigError` naming the field and its value, so a checkpoint
never loads into a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "llama3")


class UnsupportedConfigError(ValueError):
    """A config.json field has a value jaxkv cannot run (or a required field is missing)."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs; hashable, so it can be a static jit argument."""

    family: str  # HF model_type: llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3"
    rope_factor: float = 1.0  # llama3 scaling parameters (unused for "default")
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    layer_windows: tuple[int, ...] = ()  # per layer; 0 = full attention (empty = all full)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                f"{self.num_kv_heads}"
            )
        if self.family not in FAMILIES:
            raise UnsupportedConfigError(
                f"model_type={self.family!r} is not supported; expected one of {FAMILIES}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedConfigError(
                f"rope_type={self.rope_type!r} is not supported; expected {ROPE_TYPES}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for RoPE")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        windows = tuple(int(w) for w in self.layer_windows)
        if len(windows) != self.num_layers or any(w < 0 for w in windows):
            raise UnsupportedConfigError(
                f"layer_windows={self.layer_windows!r} must hold {self.num_layers} non-negative ints"
            )
        object.__setattr__(self, "layer_windows", windows)
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in self.eos_token_ids))

    @property
    def num_groups(self) -> int:
        """GQA group size G: query head q uses KV head q // G."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a config.json (or a directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf(json.loads(path.read_text()))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face config.json dict; raise UnsupportedConfigError for what we cannot run."""
        if not isinstance(hf, dict):
            raise UnsupportedConfigError(f"config must be a JSON object, got {type(hf).__name__}")
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise UnsupportedConfigError(
                f"model_type={family!r} is not supported; expected one of {FAMILIES}"
            )

        def req(name):
            if hf.get(name) is None:
                raise UnsupportedConfigError(
                    f"required field {name!r} is missing from config.json ({family})"
                )
            return hf[name]

        _reject_unsupported(hf, family)
        num_layers = int(req("num_hidden_layers"))
        hidden, heads = int(req("hidden_size")), int(req("num_attention_heads"))
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
        if head_dim is None:
            raise UnsupportedConfigError(
                f"head_dim is missing and hidden_size={hidden} is not divisible by "
                f"num_attention_heads={heads}"
            )
        # Mistral's attention has no biases whatever the config says (as in transformers).
        bias = family != "mistral" and bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        return cls(
            family=family,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            **_rope_fields(hf),
            layer_windows=_layer_windows(hf, family, num_layers),
            qkv_bias=True if family == "qwen2" else bias,
            o_bias=False if family == "qwen2" else bias,
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            pad_token_id=hf.get("pad_token_id"),
        )


def _reject_unsupported(hf: dict, family: str) -> None:
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedConfigError(f"hidden_act={act!r} is not supported (only 'silu')")
    for name in ("mlp_bias", "quantization_config", "attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(name):
            raise UnsupportedConfigError(f"{name}={hf[name]!r} is not supported")
    factor = hf.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        raise UnsupportedConfigError(f"partial_rotary_factor={factor!r} is not supported (only 1.0)")


def _rope_fields(hf: dict) -> dict:
    # transformers < 5 writes rope_theta + rope_scaling; transformers >= 5 writes rope_parameters
    # (which carries rope_theta). Either may name the type under "rope_type" or the older "type".
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    field = "rope_parameters" if params is not None else "rope_scaling"
    rope = params if params is not None else scaling
    rope = dict(rope or {})
    if rope and not all(isinstance(v, int | float | str | type(None)) for v in rope.values()):
        raise UnsupportedConfigError(f"{field}={rope!r} is not supported (per-layer-type RoPE parameters)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfigError(
            f"{field}.rope_type={rope_type!r} is not supported; expected one of {ROPE_TYPES}"
        )
    if rope.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise UnsupportedConfigError(
            f"{field}.partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported (only 1.0)"
        )
    out = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type == "llama3":
        names = {
            "factor": "rope_factor",
            "low_freq_factor": "rope_low_freq_factor",
            "high_freq_factor": "rope_high_freq_factor",
            "original_max_position_embeddings": "rope_original_max_len",
        }
        for hf_name, name in names.items():
            if rope.get(hf_name) is None:
                raise UnsupportedConfigError(f"{field}.{hf_name} is required for rope_type='llama3'")
            out[name] = int(rope[hf_name]) if name == "rope_original_max_len" else float(rope[hf_name])
        if out["rope_high_freq_factor"] == out["rope_low_freq_factor"]:
            raise UnsupportedConfigError(f"{field}.high_freq_factor must differ from low_freq_factor")
    return out


def _window_value(hf: dict) -> int:
    w = hf.get("sliding_window")
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
        raise UnsupportedConfigError(f"sliding_window={w!r} must be a positive integer")
    return w


def _layer_windows(hf: dict, family: str, num_layers: int) -> tuple[int, ...]:
    if family == "llama":
        return (0,) * num_layers
    if family == "mistral":
        return (0,) * num_layers if hf.get("sliding_window") is None else (_window_value(hf),) * num_layers
    # Qwen2/Qwen3: windows only when use_sliding_window; which layers from layer_types, else the
    # layers at index >= max_window_layers (transformers' own rule).
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return (0,) * num_layers
    window = _window_value(hf)
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", num_layers))
        return tuple(window if i >= first else 0 for i in range(num_layers))
    if len(types) != num_layers:
        raise UnsupportedConfigError(
            f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}"
        )
    kinds = {"full_attention": 0, "sliding_attention": window}
    for t in types:
        if t not in kinds:
            raise UnsupportedConfigError(f"layer_types entry {t!r} is not supported; expected {tuple(kinds)}")
    return tuple(kinds[t] for t in types)
