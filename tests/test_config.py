"""ModelConfig.from_hf: normalisation of real-world config.json variants and clear refusals."""

import copy

import pytest

from jaxkv.config import ModelConfig, UnsupportedConfigError

LLAMA31 = {  # transformers < 5 layout (rope_theta + rope_scaling), as shipped with Llama 3.1 8B
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
}

QWEN25 = {  # Qwen2.5-7B-Instruct: sliding fields present but disabled
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
    "eos_token_id": 151645,
}


def with_(base, **kw):
    cfg = copy.deepcopy(base)
    cfg.update(kw)
    return cfg


def test_llama31_old_layout():
    cfg = ModelConfig.from_hf(LLAMA31)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_groups) == (32, 8, 128, 4)
    assert cfg.rope_type == "llama3" and cfg.rope_factor == 8.0 and cfg.rope_original_max_len == 8192
    assert cfg.rope_theta == 500000.0 and cfg.layer_windows == (0,) * 32
    assert cfg.eos_token_ids == (128001, 128008, 128009) and not cfg.qkv_bias
    hash(cfg)  # static jit argument


def test_transformers5_rope_parameters_and_type_key():
    rope = dict(LLAMA31["rope_scaling"], rope_theta=123.0)
    cfg = ModelConfig.from_hf(with_(LLAMA31, rope_parameters=rope, rope_scaling=None, rope_theta=None))
    assert cfg.rope_theta == 123.0 and cfg.rope_type == "llama3"
    old = dict(LLAMA31["rope_scaling"])
    old["type"] = old.pop("rope_type")
    assert ModelConfig.from_hf(with_(LLAMA31, rope_scaling=old)).rope_type == "llama3"


def test_llama2_default_rope_and_mha():
    cfg = ModelConfig.from_hf(
        with_(LLAMA31, rope_scaling=None, rope_theta=10000.0, num_key_value_heads=None, eos_token_id=2)
    )
    assert cfg.rope_type == "default" and cfg.num_kv_heads == 32 and cfg.eos_token_ids == (2,)


def test_llama_attention_bias_has_o_bias():
    cfg = ModelConfig.from_hf(with_(LLAMA31, attention_bias=True))
    assert cfg.qkv_bias and cfg.o_bias


def test_mistral_window():
    hf = with_(LLAMA31, model_type="mistral", rope_scaling=None, sliding_window=4096, num_hidden_layers=3)
    assert ModelConfig.from_hf(hf).layer_windows == (4096,) * 3
    assert ModelConfig.from_hf(with_(hf, sliding_window=None)).layer_windows == (0,) * 3


def test_qwen2_windows():
    cfg = ModelConfig.from_hf(QWEN25)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.layer_windows == (0,) * 28
    on = with_(QWEN25, use_sliding_window=True, sliding_window=4096, max_window_layers=26)
    assert ModelConfig.from_hf(on).layer_windows == (0,) * 26 + (4096,) * 2
    types = ["full_attention", "sliding_attention"] * 14
    cfg = ModelConfig.from_hf(with_(on, layer_types=types))
    assert cfg.layer_windows == (0, 4096) * 14


def test_qwen3_head_dim_and_qk_norm():
    hf = with_(
        QWEN25,
        model_type="qwen3",
        head_dim=128,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=8,
        attention_bias=False,
    )
    cfg = ModelConfig.from_hf(hf)
    assert cfg.qk_norm and cfg.head_dim == 128 and not cfg.qkv_bias


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_type='linear'"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}), "rope_parameters.rope_type"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(model_type="gemma2"), "model_type='gemma2'"),
        (dict(model_type=None), "model_type=None"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(vocab_size=None), "vocab_size"),
        (dict(num_key_value_heads=5), "num_key_value_heads=5"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_unsupported_llama_fields_are_named(change, field):
    with pytest.raises(UnsupportedConfigError, match=field.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf(with_(LLAMA31, **change))


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(use_sliding_window=True, sliding_window=0), "sliding_window=0"),
        (dict(use_sliding_window=True, layer_types=["chunked_attention"] * 28), "chunked_attention"),
        (dict(use_sliding_window=True, layer_types=["full_attention"]), "layer_types"),
    ],
)
def test_unsupported_qwen_fields_are_named(change, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        ModelConfig.from_hf(with_(QWEN25, **change))


def test_unsupported_is_value_error():
    assert issubclass(UnsupportedConfigError, ValueError)
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_hf([1, 2])
