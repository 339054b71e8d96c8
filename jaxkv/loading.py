"""jaxkv.load(path) -> Model, from a Hugging Face directory or a directory written by jaxkv.convert.

Hugging Face: config.json + model.safetensors or model.safetensors.index.json shards (read with the
safetensors numpy API; bf16 tensors through a memory map with ml_dtypes, which safetensors' numpy API
cannot return) + tokenizer files + generation_config.json. Converted: the same metadata plus orbax
params under `params/`. Every missing or corrupt input raises `CheckpointError` naming the file/tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import ModelConfig, UnsupportedConfigError
from jaxkv.models import llama
from jaxkv.tokenizer import Tokenizer

CONVERT_META = "jaxkv_convert.json"
CONVERT_FORMAT = "jaxkv.convert/v1"


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, or does not match config.json."""


@dataclasses.dataclass
class Model:
    """A loaded model: config, parameter pytree, tokenizer and generation defaults."""

    config: ModelConfig
    params: dict
    tokenizer: Tokenizer | None
    generation_config: dict
    model_id: str
    path: Path
    mesh: Any = None  # tensor parallel over KV heads (jaxkv.parallel); None = one device
    kv_head_perm: Any = None  # [L, Hkv] placed KV-head order (position j holds checkpoint head perm[l, j])

    def logits(self, token_ids) -> np.ndarray:
        """Dense forward over positions 0..T-1: token ids [T] or [B, T] -> np.float32[B, T, vocab]."""
        tokens = np.asarray(token_ids, dtype=np.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2 or tokens.shape[1] == 0:
            raise ValueError(f"token_ids must be [T] or [B, T] with T > 0, got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise ValueError(
                f"token ids must be in [0, {self.config.vocab_size}), got {tokens.min()}..{tokens.max()}"
            )
        return np.asarray(_dense_logits(self.params, self.config, jnp.asarray(tokens)))


@partial(jax.jit, static_argnums=1)
def _dense_logits(params, cfg, tokens):
    return llama.dense_logits(params, cfg, tokens)


def resolve_dtype(dtype) -> jnp.dtype:
    """ "float32" | "bfloat16" | "float16" | a jnp dtype -> jnp dtype."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"dtype={dtype!r} is not a dtype") from e
    if dt not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"dtype={dtype!r} is not supported; use float32, bfloat16 or float16")
    return dt


def read_json(path: Path, required: bool = True) -> dict:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path} not found")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_config(path: Path) -> tuple[ModelConfig, dict]:
    hf = read_json(path / "config.json")
    try:
        return ModelConfig.from_hf(hf), hf
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{path / 'config.json'}: {e}") from e


def load(path: str | Path, dtype="float32", *, mesh=None, placement: str = "balanced",
         head_classes=None) -> Model:
    """Load a Hugging Face checkpoint directory, a jaxkv.convert output directory, a llama.cpp GGUF file, or
    a model by name (`jaxkv.models.catalog`: "smollm2", "synthetic").

    dtype: parameter dtype on device ("float32", "bfloat16", or a jnp dtype); norms/RoPE/softmax stay fp32.
    mesh: a `jaxkv.parallel.make_mesh(tp)` mesh: parameters are sharded over its "tp" axis after the KV
    heads are permuted by `placement` ("balanced" spreads the global heads of `head_classes` -- default
    the model's head_classes.json -- evenly over the shards; "contiguous" keeps checkpoint order).
    """
    from jaxkv.models.catalog import resolve

    path = resolve(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path, dtype, mesh=mesh, placement=placement, head_classes=head_classes)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (nor a .gguf file)")
    dt = resolve_dtype(dtype)
    cfg, _ = load_config(path)
    if (path / CONVERT_META).exists():
        params = restore_params(path, cfg, dt)
    elif mesh is None:
        params = jax.tree.map(lambda a: jnp.asarray(a, dt), read_hf_params(path, cfg))
    else:  # stay on the host until each shard goes to its device
        params = jax.tree.map(lambda a: np.asarray(a).astype(dt), read_hf_params(path, cfg))
    perm = None
    if mesh is not None:
        from jaxkv.cache.head_classes import HeadClassMap, load_or_default
        from jaxkv.parallel import place_and_shard

        if head_classes is None:
            hc = load_or_default(path, cfg.num_layers, cfg.num_kv_heads)
        else:
            hc = head_classes if isinstance(head_classes, HeadClassMap) else HeadClassMap.load(head_classes)
        params, perm = place_and_shard(params, cfg, mesh, hc, placement)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12]
    return Model(
        cfg,
        params,
        tokenizer,
        read_json(path / "generation_config.json", required=False),
        f"{path.resolve().name}-{digest}",
        path,
        mesh,
        perm,
    )


def restore_params(path: Path, cfg: ModelConfig, dtype) -> dict:
    """Restore the orbax params of a converted directory, cast to `dtype`."""
    import orbax.checkpoint as ocp

    meta = read_json(path / CONVERT_META)
    if meta.get("format") != CONVERT_FORMAT:
        raise CheckpointError(f"{path} was converted in format {meta.get('format')!r}; this jaxkv reads "
                              f"{CONVERT_FORMAT!r}: convert the source checkpoint again")
    saved = resolve_dtype(meta.get("dtype", "float32"))
    params_dir = path.resolve() / "params"
    if not params_dir.exists():
        raise CheckpointError(f"{params_dir} not found (converted checkpoint without params)")
    target = jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, saved),
        llama.param_shapes(cfg),
        is_leaf=lambda s: isinstance(s, tuple),
    )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(params_dir, target)
    except Exception as e:  # orbax raises several error types for missing/mismatched trees
        raise CheckpointError(f"cannot restore orbax params from {params_dir}: {e}") from e
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


def load_gguf(path: Path, dtype="float32", *, mesh=None, placement: str = "balanced",
              head_classes=None) -> Model:
    """A llama.cpp GGUF file (weights dequantized to `dtype`, tokenizer and chat template from the file)."""
    from jaxkv.gguf import read_gguf

    if mesh is not None:
        raise CheckpointError("tensor parallelism from a GGUF file is not supported: convert it to a "
                              "directory first")
    dt = resolve_dtype(dtype)
    ck = read_gguf(path)
    try:
        cfg = ModelConfig.from_hf(ck.hf_config)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{path}: {e}") from e
    params = params_from_tensors(ck.tensors.__getitem__, cfg, source=str(path))
    params = jax.tree.map(lambda a: jnp.asarray(a, dt), params)
    digest = hashlib.sha256(json.dumps(ck.hf_config, sort_keys=True).encode()).hexdigest()[:12]
    return Model(cfg, params, ck.tokenizer, ck.generation_config, f"{path.stem}-{digest}", path.parent)


# ---------------------------------------------------------------- Hugging Face safetensors


def hf_name_map(cfg: ModelConfig) -> dict[str, tuple]:
    """HF tensor name -> (path into the params tree, transpose?)."""
    names = {"model.embed_tokens.weight": (("embed",), False), "model.norm.weight": (("final_norm",), False)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (("lm_head",), True)
    proj = {
        "wq": "self_attn.q_proj",
        "wk": "self_attn.k_proj",
        "wv": "self_attn.v_proj",
        "wo": "self_attn.o_proj",
        "w_gate": "mlp.gate_proj",
        "w_up": "mlp.up_proj",
        "w_down": "mlp.down_proj",
    }
    keys = llama.param_shapes(cfg)["layers"][0]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for key in keys:
            if key in proj:
                hf = proj[key] + ".weight"
            elif key in ("bq", "bk", "bv", "bo"):
                hf = proj["w" + key[1]] + ".bias"
            else:
                hf = {
                    "attn_norm": "input_layernorm",
                    "mlp_norm": "post_attention_layernorm",
                    "q_norm": "self_attn.q_norm",
                    "k_norm": "self_attn.k_norm",
                }[key] + ".weight"
            names[pre + hf] = (("layers", i, key), key in proj)
    return names


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file that holds it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.exists():
                raise CheckpointError(f"shard {f} listed in {index} not found")
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(
            f"no weights in {path}: expected model.safetensors or model.safetensors.index.json"
        )
    return {name: single for name in _safetensors_header(single)}


def _safetensors_header(file: Path) -> dict:
    """Parse and validate the header (names, dtypes, shapes, offsets) against the file size."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds file size {size}")
            header = json.loads(f.read(n))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not a valid safetensors file: {e}") from e
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{file} is truncated: tensors need {8 + n + end} bytes, file has {size}")
    return header


def _read_tensor(file: Path, name: str, header: dict) -> np.ndarray:
    from safetensors import safe_open

    if header[name]["dtype"] != "BF16":
        with safe_open(str(file), framework="np") as f:
            return f.get_tensor(name)
    # safetensors' numpy API has no bfloat16: read the raw bytes as ml_dtypes.bfloat16.
    import ml_dtypes

    start, stop = header[name]["data_offsets"]
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n + start)
        buf = f.read(stop - start)
    return np.frombuffer(buf, dtype=ml_dtypes.bfloat16).reshape(header[name]["shape"])


def read_hf_params(path: Path, cfg: ModelConfig) -> dict:
    """Read every tensor of `hf_name_map` into a numpy params tree (HF dtype, weights as [in, out])."""
    files = _weight_files(path)
    headers: dict[Path, dict] = {}

    def get(name: str) -> np.ndarray:
        if name not in files:
            raise CheckpointError(f"tensor {name!r} not found in the weights of {path}")
        file = files[name]
        if file not in headers:
            headers[file] = _safetensors_header(file)
        if name not in headers[file]:
            raise CheckpointError(f"tensor {name!r} not found in {file}")
        try:
            return _read_tensor(file, name, headers[file])
        except Exception as e:  # safetensors raises its own error types for corrupt data
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {e}") from e

    return params_from_tensors(get, cfg, source=str(path))


def params_from_tensors(get, cfg: ModelConfig, source: str = "the checkpoint") -> dict:
    """Builds the params tree from tensors in Hugging Face naming and layout: `get(hf_name)` -> array
    ([out, in] weights, as transformers stores them)."""
    shapes = llama.param_shapes(cfg)
    layers = [{} for _ in range(cfg.num_layers)]
    params: dict = {}
    for name, (where, transpose) in hf_name_map(cfg).items():
        array = get(name)
        if transpose:
            array = array.T
        expected = shapes["layers"][where[1]][where[2]] if where[0] == "layers" else shapes[where[0]]
        if tuple(array.shape) != tuple(expected):
            hf_shape = tuple(reversed(expected)) if transpose else tuple(expected)
            raise CheckpointError(
                f"tensor {name!r} in {source} has shape {tuple(array.T.shape if transpose else array.shape)}"
                f", config.json implies {hf_shape}"
            )
        if where[0] == "layers":
            layers[where[1]][where[2]] = array
        else:
            params[where[0]] = array
    params["layers"] = layers
    return params
