"""Head-class-aware KV-head placement (numpy only, never imports jax).

With tensor parallelism over KV heads, shard `s` owns the contiguous KV heads
`[s * Hkv / tp, (s + 1) * Hkv / tp)` of every layer, and a decode step waits at every layer's all-reduce
for the slowest shard. A global head attends over the whole context while a local head reads its sink and
window, so the shard holding most of a layer's global heads sets the layer's time. `balanced_permutation`
deals each layer's heads over the shards class by class (global first), so the number of global heads per
shard differs by at most one in every layer; `permute_params` applies the permutation once at load (a KV
head moves with its K/V projection columns and its GQA group's Q columns and O rows) and
`permute_head_classes` reorders the map the same way. The model's outputs do not change.

A permutation is an int array `perm [L, Hkv]`: position `j` of layer `l` holds original head `perm[l, j]`.
"""

from __future__ import annotations

import numpy as np

# Deal order: heads whose cache grows with the context first (they dominate a long-context step).
_ORDER = {"global": 0, "retrieval": 1, "budget": 2, "local": 3}


def contiguous_permutation(num_layers: int, num_kv_heads: int) -> np.ndarray:
    return np.tile(np.arange(num_kv_heads, dtype=np.int32), (num_layers, 1))


def balanced_permutation(head_classes, tp: int) -> np.ndarray:
    """[L, Hkv] permutation spreading each kind evenly over `tp` shards (global heads first)."""
    kinds = head_classes.kinds() if hasattr(head_classes, "kinds") else np.asarray(head_classes)
    num_layers, hkv = kinds.shape
    if hkv % tp:
        raise ValueError(f"{hkv} KV heads do not split over tp={tp} shards")
    per = hkv // tp
    perm = np.empty((num_layers, hkv), np.int32)
    for layer in range(num_layers):
        # Stable: within a kind heads keep their order. Sorted head i goes to shard i % tp, in turn.
        order = sorted(range(hkv), key=lambda h: (_ORDER.get(str(kinds[layer, h]), 4), h))
        slots = [[] for _ in range(tp)]
        for i, h in enumerate(order):
            slots[i % tp].append(h)
        for s in range(tp):
            perm[layer, s * per:(s + 1) * per] = sorted(slots[s])
    return perm


def global_counts(head_classes, perm: np.ndarray, tp: int, kind: str = "global") -> np.ndarray:
    """[L, tp] number of `kind` heads each shard holds under `perm`."""
    kinds = head_classes.kinds() if hasattr(head_classes, "kinds") else np.asarray(head_classes)
    placed = np.take_along_axis(kinds, np.asarray(perm), axis=1)
    return (placed == kind).reshape(kinds.shape[0], tp, -1).sum(-1)


def permute_head_classes(head_classes, perm: np.ndarray):
    from jaxkv.cache.head_classes import HeadClassMap

    rows = tuple(tuple(head_classes.classes[layer][int(h)] for h in perm[layer])
                 for layer in range(head_classes.num_layers))
    return HeadClassMap(head_classes.num_layers, head_classes.num_kv_heads, rows)


def _take(w, perm_l, axis: int, hkv: int):
    """Reorders the KV-head blocks of axis `axis` of w (that axis = Hkv blocks of equal width)."""
    w = np.asarray(w)
    shape = w.shape
    blocks = w.reshape(*shape[:axis], hkv, shape[axis] // hkv, *shape[axis + 1:])
    return np.take(blocks, perm_l, axis=axis).reshape(shape)


def permute_params(params: dict, cfg, perm: np.ndarray) -> dict:
    """Applies `perm` to a parameter tree (host numpy arrays; weights [in, out], layers stacked). Q columns,
    Q bias and O rows move in GQA groups (query heads h*G .. h*G+G-1 stay with KV head h)."""
    hkv = cfg.num_kv_heads
    stacked = not isinstance(params["layers"], list | tuple)
    per_layer = params["layers"]
    if stacked:  # leaves with a leading layer axis (llama.stack_layers)
        per_layer = [{k: np.asarray(v)[i] for k, v in per_layer.items()} for i in range(len(perm))]
    layers = []
    for layer, p in enumerate(per_layer):
        pl = np.asarray(perm[layer])
        q = dict(p)
        for name, axis in (("wq", 1), ("wk", 1), ("wv", 1), ("wo", 0), ("bq", 0), ("bk", 0), ("bv", 0)):
            if name in q and not (pl == np.arange(hkv)).all():
                q[name] = _take(q[name], pl, axis, hkv)
        layers.append(q)
    if stacked:
        return {**params, "layers": {k: np.stack([p[k] for p in layers]) for k in layers[0]}}
    return {**params, "layers": layers}
