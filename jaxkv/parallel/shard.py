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

from jaxkv.parallel.mesh import TP, batch_specs, local_config, param_specs, pool_specs, tp_size

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


def tp_call(body, mesh, params, pool, batch: dict, cfg, out_specs):
    """`body(params, pool, batch, local_cfg)` per shard. `out_specs` names the outputs, with the string
    "pool" standing for the pool's specs and None for a replicated output."""
    tp = tp_size(mesh)
    lcfg = local_config(cfg, tp)
    pspec = pool_specs(pool)
    outs = tuple(pspec if o == "pool" else P() for o in out_specs)

    def inner(params, pool, batch):
        return body(params, pool, localize(batch, pool.k.shape[0], pool.page_size), lcfg)

    f = shard_map(inner, mesh, (param_specs(params, cfg, tp), pspec, batch_specs(batch)), outs)
    return f(params, pool, batch)
