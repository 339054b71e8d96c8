"""jaxkv.load: sharded and bf16 checkpoints, error messages, orbax convert round trip, tokenizer."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from hf_tiny import make_tiny_checkpoint
from safetensors.numpy import load_file, save_file

import jaxkv
from jaxkv.config import UnsupportedConfigError
from jaxkv.convert import convert, main
from jaxkv.loading import CheckpointError
from jaxkv.tokenizer import ChatTemplateError, Tokenizer

IDS = np.random.default_rng(0).integers(0, 300, (2, 20))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    return {
        "llama": make_tiny_checkpoint("llama", root / "llama", seed=3),
        "sharded": make_tiny_checkpoint("llama", root / "sharded", seed=3, shards=True),
        "llama_bf16": make_tiny_checkpoint("llama", root / "llama_bf16", seed=3, dtype="bfloat16"),
        "mistral": make_tiny_checkpoint("mistral", root / "mistral"),
        "qwen2": make_tiny_checkpoint("qwen2", root / "qwen2"),
    }


@pytest.fixture(scope="module")
def llama(ckpts):
    return jaxkv.load(ckpts["llama"])


def copy_of(src, tmp_path):
    return shutil.copytree(src, tmp_path / src.name)


def test_model_fields_and_logits_api(llama, ckpts):
    assert llama.path == ckpts["llama"] and llama.model_id.startswith("llama-")
    assert llama.generation_config["eos_token_id"] == [llama.tokenizer.eos_token_id]
    assert llama.params["embed"].dtype == jnp.float32 and isinstance(llama.params["layers"], list)
    one = llama.logits(list(IDS[0]))
    assert one.shape == (1, 20, llama.config.vocab_size) and one.dtype == np.float32
    np.testing.assert_array_equal(one[0], llama.logits(IDS)[0])
    with pytest.raises(ValueError, match="token ids"):
        llama.logits([0, llama.config.vocab_size])


def test_sharded_loads_identically(llama, ckpts):
    assert (ckpts["sharded"] / "model.safetensors.index.json").exists()
    sharded = jaxkv.load(ckpts["sharded"])
    np.testing.assert_array_equal(sharded.logits(IDS), llama.logits(IDS))


def test_bfloat16(llama, ckpts):
    bf = jaxkv.load(ckpts["llama"], dtype="bfloat16")
    assert bf.params["layers"][0]["wq"].dtype == jnp.bfloat16
    ref = llama.logits(IDS)
    assert np.abs(bf.logits(IDS) - ref).max() / np.abs(ref).max() < 5e-2
    # A bf16 safetensors file (read without safetensors' numpy bf16 support) upcasts exactly.
    from_bf16 = jaxkv.load(ckpts["llama_bf16"], dtype=jnp.float32)
    expected = load_file(ckpts["llama"] / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    got = np.asarray(from_bf16.params["layers"][0]["wq"]).T
    np.testing.assert_allclose(got, expected, rtol=2**-8)


def test_tied_embeddings_have_no_lm_head(ckpts):
    model = jaxkv.load(ckpts["qwen2"])
    assert model.config.tie_word_embeddings and "lm_head" not in model.params


def _corrupt(path, how):
    st = path / "model.safetensors"
    if how == "no_config":
        (path / "config.json").unlink()
    elif how == "bad_json":
        (path / "config.json").write_text("{not json")
    elif how == "no_weights":
        st.unlink()
    elif how == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        st.write_bytes(b"\xff" * 64)
    elif how == "missing_tensor":
        tensors = load_file(st)
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, st)
    elif how == "wrong_shape":
        cfg = json.loads((path / "config.json").read_text())
        cfg["intermediate_size"] += 8
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "how, match",
    [
        ("no_config", "config.json not found"),
        ("bad_json", "config.json is not valid JSON"),
        ("no_weights", "model.safetensors"),
        ("truncated", "model.safetensors is truncated"),
        ("garbage", "model.safetensors is not a valid safetensors"),
        ("missing_tensor", "model.layers.1.mlp.up_proj.weight"),
        ("wrong_shape", r"mlp.gate_proj.weight.*has shape \(96, 64\), config.json implies \(104, 64\)"),
    ],
)
def test_checkpoint_errors_name_the_file(ckpts, tmp_path, how, match):
    path = copy_of(ckpts["llama"], tmp_path)
    _corrupt(path, how)
    with pytest.raises(CheckpointError, match=match):
        jaxkv.load(path)


def test_missing_shard_and_untied_without_lm_head(ckpts, tmp_path):
    path = copy_of(ckpts["sharded"], tmp_path)
    (path / "model-00003-of-00012.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00003-of-00012.safetensors"):
        jaxkv.load(path)
    path = copy_of(ckpts["qwen2"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=False)))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        jaxkv.load(path)


def test_unsupported_config_and_bad_args(ckpts, tmp_path):
    path = copy_of(ckpts["mistral"], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    with pytest.raises(UnsupportedConfigError, match="config.json.*hidden_act='gelu'"):
        jaxkv.load(path)
    with pytest.raises(CheckpointError, match="not a directory"):
        jaxkv.load(tmp_path / "nope")
    with pytest.raises(ValueError, match="dtype"):
        jaxkv.load(ckpts["llama"], dtype="int8")


def test_convert_round_trip(llama, ckpts, tmp_path):
    out = convert(ckpts["llama"], tmp_path / "f32", dtype="float32")
    restored = jaxkv.load(out)
    np.testing.assert_array_equal(restored.logits(IDS), llama.logits(IDS))
    assert restored.tokenizer.encode("hello world") == llama.tokenizer.encode("hello world")
    assert restored.generation_config == llama.generation_config
    with pytest.raises(FileExistsError):
        convert(ckpts["llama"], out)

    main([str(ckpts["llama"]), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
    bf_direct = jaxkv.load(ckpts["llama"], dtype="bfloat16")
    bf_restored = jaxkv.load(tmp_path / "bf16", dtype="bfloat16")
    assert bf_restored.params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(bf_restored.logits(IDS), bf_direct.logits(IDS))

    shutil.rmtree(out / "params")
    with pytest.raises(CheckpointError, match="params"):
        jaxkv.load(out)


MESSAGES = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the answer"},
    {"role": "user", "content": "red or blue?"},
]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tokenizer_matches_transformers(ckpts, family):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(ckpts[family])
    tok = Tokenizer.from_dir(ckpts[family])
    text = "hello world, the cache head page attention xyz!"
    assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    ids = tok.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok.eos_token_id == hf.eos_token_id and tok.eos_token_ids[0] == hf.eos_token_id


def test_tokenizer_special_ids_and_template_errors(ckpts, tmp_path):
    qwen = Tokenizer.from_dir(ckpts["qwen2"])
    assert qwen.bos_token_id is None and qwen.eos_token_ids == (
        qwen.token_to_id("<|im_end|>"),
        qwen.pad_token_id,
    )
    mistral = Tokenizer.from_dir(ckpts["mistral"])
    with pytest.raises(ChatTemplateError, match="alternate"):
        mistral.apply_chat_template(MESSAGES[1:])

    path = copy_of(ckpts["llama"], tmp_path)
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    del tcfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(dict(tcfg, add_bos_token=False)))
    tok = Tokenizer.from_dir(path)
    assert tok.encode("hello")[0] != tok.bos_token_id
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    assert Tokenizer.from_dir(path).apply_chat_template(MESSAGES) == "hello world|the answer|red or blue?|"
