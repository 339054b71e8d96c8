"""Tensor parallelism over KV heads (docs/parallel.md).

* `mesh.py`       the `tp` mesh, the one logical-axis -> mesh-axis table for parameters, the page pool and
                  the step metadata, and `shard_params` / `shard_pool`.
* `placement.py`  head-class-aware KV-head placement: a per-layer permutation that spreads global heads
                  evenly over the shards, applied once to the weights and to the head-class map.
* `allocator.py`  `ShardedPageAllocator`: one page-id space, a contiguous range of it per shard.
* `shard.py`      `tp_call`: runs an engine step body per shard under `shard_map`.
* `methods.py`    the KV methods per shard: compression presses, segment reuse, retrieval.

Importing this package imports nothing heavy; the host-only modules (`placement`, `allocator`) never
import jax.
"""


def setup_engine(model, head_classes):
    """Engine hook for a model loaded with a mesh: checks the model splits over the mesh, puts the
    head-class map (checkpoint order) into the model's placed KV-head order; -> (map, tp)."""
    from jaxkv.parallel.mesh import check_divisible, tp_size
    from jaxkv.parallel.placement import permute_head_classes

    tp = tp_size(model.mesh)
    check_divisible(model.config, tp)
    perm = getattr(model, "kv_head_perm", None)
    if perm is not None:
        head_classes = permute_head_classes(head_classes, perm)
    return head_classes, tp


def place_and_shard(params, cfg, mesh, head_classes=None, placement: str = "balanced"):
    """Load-time hook: the KV-head permutation for `placement` ("balanced" | "contiguous"), applied to
    the host parameter tree, then the tree placed on the mesh; -> (params, perm [L, Hkv])."""
    from jaxkv.cache.head_classes import all_global
    from jaxkv.parallel.mesh import shard_params, tp_size
    from jaxkv.parallel.placement import balanced_permutation, contiguous_permutation, permute_params

    tp = tp_size(mesh)
    if head_classes is None:
        head_classes = all_global(cfg.num_layers, cfg.num_kv_heads)
    if placement == "balanced":
        perm = balanced_permutation(head_classes, tp)
    elif placement == "contiguous":
        perm = contiguous_permutation(cfg.num_layers, cfg.num_kv_heads)
    else:
        raise ValueError(f"placement must be 'balanced' or 'contiguous' (got {placement!r})")
    return shard_params(permute_params(params, cfg, perm), cfg, mesh), perm
