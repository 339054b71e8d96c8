"""Runs an engine step body per shard under `shard_map` over the `tp` axis.

The body is the single-device step (`jaxkv.engine.runner`) called with the per-shard config (Hq / tp,
Hkv / tp, I / tp heads and MLP width), the shard's parameter slices, its block of the page pool and its
KV heads' step metadata, with page ids and slot ids made local to the shard's pool block. It all-reduces
after the O and down projections (`reduce`) and all-gathers vocabulary-split logits (`gather_logits`);
both are XLA collectives (`lax.psum`, `lax.all_gather`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxkv.parallel.mesh import TP, batch_specs, local_config, param_specs, pool_specs, spec, tp_size

try:  # jax >= 0.7
    from jax import shard_map as _shard_map

    def shard_map(f, mesh, in_specs, out_specs):
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    def shard_map(f, mesh, in_specs, out_specs):
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def reduce(x):
    """Sum of the shards' partial results (after a row-parallel projection)."""
    return jax.lax.psum(x, TP)


def gather_logits(logits, vocab_size: int):
    """Vocabulary-split logits [..., V / tp] -> full [..., V] (no-op when the LM head is replicated)."""
    if logits.shape[-1] == vocab_size:
        return logits
    return jax.lax.all_gather(logits, TP, axis=logits.ndim - 1, tiled=True)


def shard_index():
    return jax.lax.axis_index(TP)


def gather_heads(x, axis: int):
    """This shard's KV-head slice of `x` (heads on `axis`) -> every shard's, in placed head order."""
    return jax.lax.all_gather(x, TP, axis=axis, tiled=True)


def own_heads(x, axis: int, local: int):
    """The `local` KV heads of this shard out of an array holding every head on `axis`."""
    return jax.lax.dynamic_slice_in_dim(x, shard_index() * local, local, axis=axis)


def localize_pages(ids, pages_per_shard: int):
    """Global page ids -> ids into this shard's pool block; ids another shard owns (and -1) become -1.
    For page lists that mix every head's pages (a segment's page copies, pages to blank)."""
    off = shard_index().astype(jnp.int32) * pages_per_shard
    mine = (ids >= off) & (ids < off + pages_per_shard)
    return jnp.where(mine, ids - off, -1)


def localize(batch: dict, pages_per_shard: int, page_size: int) -> dict:
    """Global page / slot ids of this shard's heads -> ids into its own pool block (-1 stays -1)."""
    off = shard_index().astype(jnp.int32) * pages_per_shard
    out = dict(batch)
    if "page_table" in out:
        pt = out["page_table"]
        out["page_table"] = jnp.where(pt >= 0, pt - off, -1)
    if "slots" in out:
        sl = out["slots"]
        out["slots"] = jnp.where(sl >= 0, sl - off * page_size, -1)
    return out


def per_shard(branches, *args):
    """Runs branch `s` on shard `s` (static per-shard arguments, e.g. head classes for a kernel)."""
    if len(branches) == 1 or all(b is branches[0] for b in branches):
        return branches[0](*args)
    return jax.lax.switch(shard_index(), branches, *args)


def tp_call(body, mesh, params, pool, batch: dict, cfg, out_specs, extra=None, extra_specs=None):
    """`body(params, pool, batch, local_cfg)` per shard. `out_specs` names the outputs: the string "pool"
    for the pool's specs, None for a replicated output, or a tuple of logical axes (mesh.LOGICAL_TO_MESH,
    e.g. ("seq", "layer", "kv_heads") for per-head counts). `extra` (a pytree with `extra_specs`, e.g.
    retrieval state split over its head axis) is passed through as `body(..., extra)`."""
    tp = tp_size(mesh)
    lcfg = local_config(cfg, tp)
    pspec = pool_specs(pool)
    outs = tuple(pspec if o == "pool" else P() if o is None else o if isinstance(o, P) else spec(o)
                 for o in out_specs)

    def inner(params, pool, batch, *rest):
        return body(params, pool, localize(batch, pool.k.shape[0], pool.page_size), lcfg, *rest)

    specs = (param_specs(params, cfg, tp), pspec, batch_specs(batch))
    if extra is None:
        return shard_map(inner, mesh, specs, outs)(params, pool, batch)
    return shard_map(inner, mesh, (*specs, extra_specs), outs)(params, pool, batch, extra)
