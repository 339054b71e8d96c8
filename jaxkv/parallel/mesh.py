"""The `tp` mesh and the one logical-axis table for parameters, the page pool and step metadata.

Every array that a tensor-parallel step touches names its axes logically; `LOGICAL_TO_MESH` maps a
logical axis to the mesh axis that shards it (None = replicated). Megatron layout: column-parallel
Q/K/V/gate/up (their output features are sharded), row-parallel O/down (their input features are
sharded, an all-reduce follows), the LM head split over the vocabulary (an all-gather follows), the
embedding and norms replicated. The page pool is split over its page axis (each device owns the pages
of its KV heads, see `allocator.py`), the per-head step metadata over its KV-head axis, everything else
(tokens, positions, sampling parameters) replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP = "tp"

LOGICAL_TO_MESH: dict[str, str | None] = {
    "q_heads": TP,      # Hq * D features, GQA groups kept with their KV head
    "kv_heads": TP,     # Hkv (* D) features / the KV-head axis of step metadata
    "mlp": TP,          # intermediate features
    "vocab": TP,        # LM-head output features
    "pages": TP,        # page axis of the pool
    "embed": None, "vocab_in": None, "head_dim": None, "slot": None, "norm": None,
    "seq": None, "layer": None, "page_list": None, "token": None, "step": None,
}

# Parameter name -> logical axes (weights stored [in, out]); the leaves under "layers" carry a leading
# "layer" axis (stacked for the layer scan).
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab_in", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
    "attn_norm": ("embed",), "mlp_norm": ("embed",),
    "wq": ("embed", "q_heads"), "wk": ("embed", "kv_heads"), "wv": ("embed", "kv_heads"),
    "bq": ("q_heads",), "bk": ("kv_heads",), "bv": ("kv_heads",),
    "wo": ("q_heads", "embed"), "bo": ("embed",),
    "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
}

# Pool fields and step-metadata arrays (by the runner's batch key) -> logical axes.
POOL_AXES = {"k": ("pages", "slot", "head_dim"), "v": ("pages", "slot", "head_dim"), "pos": ("pages", "slot"),
             "bias": ("pages", "slot")}
# Step metadata, compression and reuse inputs: per-(layer, KV head) tables are split with their heads.
BATCH_AXES = {
    "page_table": ("seq", "layer", "kv_heads", "page_list"),
    "lengths": (..., "kv_heads"), "prev_lengths": (..., "kv_heads"), "slots": (..., "kv_heads"),
    "sink": ("layer", "kv_heads"), "window": ("layer", "kv_heads"),
    "compressible": ("layer", "kv_heads"), "lower": ("layer", "kv_heads"), "upper": ("layer", "kv_heads"),
    "is_global": ("layer", "kv_heads"),
}


def spec(axes, ndim: int | None = None) -> P:
    """Logical axes -> PartitionSpec through LOGICAL_TO_MESH; a leading `...` pads to `ndim`."""
    axes = tuple(axes)
    if axes and axes[0] is ...:
        axes = (None,) * (ndim - len(axes) + 1) + axes[1:]
    return P(*(LOGICAL_TO_MESH[a] if a is not None else None for a in axes))


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh of `tp` devices on axis "tp" (the first `tp` of `jax.devices()` by default; with
    `jax.distributed.initialize` these span all processes)."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} devices; {len(devices)} are visible")
    return Mesh(np.array(devices[:tp]), (TP,))


def tp_size(mesh) -> int:
    return 1 if mesh is None else int(mesh.shape[TP])


def check_divisible(cfg, tp: int) -> None:
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {name}={getattr(cfg, name)}")


def _vocab_sharded(cfg, tp: int) -> bool:
    return cfg.vocab_size % tp == 0


def param_specs(params: dict, cfg, tp: int):
    """PartitionSpec tree matching `params` (the LM head stays replicated if tp does not divide the
    vocabulary)."""

    def one(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        axes = PARAM_AXES[name]
        if name == "lm_head" and not _vocab_sharded(cfg, tp):
            axes = ("embed", "vocab_in")
        if np.ndim(leaf) == len(axes) + 1:  # stacked layers: a leading layer axis
            axes = ("layer", *axes)
        return spec(axes)

    return jax.tree_util.tree_map_with_path(one, params)


def put(a, sharding):
    """One array onto `sharding`: host arrays through `make_array_from_callback` (each process hands over
    only its own devices' blocks, so this works under `jax.distributed` too), device arrays by device_put."""
    if isinstance(a, jax.Array):
        return a if a.sharding == sharding else jax.device_put(a, sharding)
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def shard_params(params: dict, cfg, mesh: Mesh) -> dict:
    """Places a parameter tree (host or device arrays) on the mesh by the table."""
    tp = tp_size(mesh)
    check_divisible(cfg, tp)
    specs = param_specs(params, cfg, tp)
    return jax.tree.map(lambda a, s: put(a, NamedSharding(mesh, s)), params, specs)


def pool_specs(pool):
    """PartitionSpec pytree for a KVPool (same dataclass, specs in its data fields; a pool without a logit
    bias keeps None there)."""
    return dataclasses.replace(pool, **{f: spec(a) for f, a in POOL_AXES.items()
                                        if getattr(pool, f) is not None})


def pool_shardings(pool_or_specs, mesh: Mesh):
    specs = pool_specs(pool_or_specs)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def init_sharded_pool(num_pages: int, page_size: int, head_dim: int, dtype, mesh: Mesh, bias: bool = False):
    """An empty pool created directly in its shards (never whole on one device); `bias`: with a per-slot
    logit bias (merging compression, `Engine(kv_merge=True)`), split like the positions."""
    from jaxkv.cache.pool import init_pool

    shape = jax.eval_shape(lambda: init_pool(num_pages, page_size, head_dim, dtype, bias=bias))
    make = jax.jit(lambda: init_pool(num_pages, page_size, head_dim, dtype, bias=bias),
                   out_shardings=pool_shardings(shape, mesh))
    return make()


def batch_specs(batch: dict) -> dict:
    return {k: spec(BATCH_AXES[k], np.ndim(v)) if k in BATCH_AXES else P() for k, v in batch.items()}


def local_config(cfg, tp: int):
    """The per-shard model config: heads and MLP width divided by tp (head_dim, vocab unchanged)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp, num_kv_heads=cfg.num_kv_heads // tp,
                               intermediate_size=cfg.intermediate_size // tp)
