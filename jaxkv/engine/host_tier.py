"""SpeContext's host tier, building block (issue 12 item 2): the K/V of offloaded layers in ``pinned_host``
memory and the elastic diff prefetch of a selection into a device buffer.

Not wired into the engine's decode yet (docs/specontext.md, "The host-tier plan"). What is here:

* `to_host(x)`: places an array in the ``pinned_host`` memory kind of its device (JAX memory kinds).
* `diff_plan(buf_pos, idx, count, cap)`: per (sequence, KV head), which selected positions the device
  buffer lacks (``load``) and which buffer slots hold positions no longer selected (``dest``, where they
  go), padded to a static churn cap ``cap``; ``n_load`` says how many are real.
* `elastic_update(...)`: one jitted call that gathers only the ``cap`` missing rows per (sequence, host
  layer, KV head) **on the host** (`compute_on("device_host")` over the pinned-host arrays), moves that block
  to the device and scatters it into the donated buffer in place. A head whose churn exceeds ``cap`` this
  step is reloaded in full by `full_update` (the caller checks ``n_load`` once per step).

Layouts: host K/V ``[Lh, num_slots, D]`` (the pool's flat slots of the offloaded layers), page table
``[S, Lh, Hkv, P]`` of those layers; the buffer ``[S, Lh, Hkv, B, D]`` with ``buf_pos [S, Hkv, B]``
(the position each buffer slot holds, shared by the host layers because the selection is; -1 = empty).
The selection's positions are storage indices of global heads (slot = page_table[pos // ps] * ps + pos % ps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on
from jax.sharding import SingleDeviceSharding


def host_sharding(device=None) -> SingleDeviceSharding:
    return SingleDeviceSharding(device or jax.devices()[0], memory_kind="pinned_host")


def device_sharding(device=None) -> SingleDeviceSharding:
    return SingleDeviceSharding(device or jax.devices()[0], memory_kind="device")


def to_host(x, device=None):
    """x placed in pinned host memory (the host tier's storage)."""
    return jax.device_put(x, host_sharding(device))


def _first(mask, n: int):
    """Indices of the True entries of mask [..., B] first (stable), the first n of them: [..., n]."""
    order = jnp.argsort(~mask, axis=-1, stable=True)
    return order[..., :n]


def diff_plan(buf_pos, idx, count, cap: int):
    """buf_pos [S, Hkv, B] (-1 empty), idx [S, Hkv, B] selected positions with count [S, Hkv] ->
    (load_pos [S, Hkv, cap] positions to fetch (-1 = none), dest [S, Hkv, cap] buffer slots they go to,
    n_load [S, Hkv] how many the buffer lacks; a head with n_load > cap needs `full_update`)."""
    b = idx.shape[-1]
    sel = jnp.arange(b) < count[..., None]
    held = jnp.any((idx[..., :, None] == buf_pos[..., None, :]) & (buf_pos >= 0)[..., None, :], axis=-1)
    need = sel & ~held  # [S, Hkv, B] over the selection
    keep = jnp.any((buf_pos[..., :, None] == idx[..., None, :]) & sel[..., None, :], axis=-1) & (buf_pos >= 0)
    n_load = jnp.sum(need, axis=-1).astype(jnp.int32)
    cap = min(cap, b)
    take = _first(need, cap)
    real = jnp.arange(cap) < n_load[..., None]
    load_pos = jnp.where(real, jnp.take_along_axis(idx, take, axis=-1), -1)
    dest = jnp.where(real, _first(~keep, cap), -1)
    return load_pos.astype(jnp.int32), dest.astype(jnp.int32), n_load


def _slots(page_table, pos, page_size: int):
    """page_table [S, Lh, Hkv, P], pos [S, Hkv, C] (-1 none) -> flat slots [S, Lh, Hkv, C] (0 where none)."""
    p = jnp.maximum(pos, 0)[:, None]
    shape = page_table.shape[:3] + p.shape[-1:]
    page = jnp.take_along_axis(page_table, jnp.broadcast_to(p // page_size, shape), axis=-1)
    return jnp.where((pos >= 0)[:, None] & (page >= 0), page * page_size + p % page_size, 0)


@compute_on("device_host")
@jax.jit
def _host_gather(host_k, host_v, rows):
    """On the host: host_k/v [Lh, N, D], rows [...] flat indices into [Lh * N] -> [..., D] each."""
    d = host_k.shape[-1]
    return host_k.reshape(-1, d)[rows], host_v.reshape(-1, d)[rows]


@functools.partial(jax.jit, static_argnames=("page_size",), donate_argnames=("buf_k", "buf_v", "buf_pos"))
def elastic_update(host_k, host_v, buf_k, buf_v, buf_pos, page_table, load_pos, dest, *, page_size: int):
    """Fetches only `load_pos` (from `diff_plan`) of every host layer into the buffer slots `dest`.
    Returns (buf_k, buf_v, buf_pos). Moves [S, Lh, Hkv, cap, D] K and V from host to device."""
    lh_off = jnp.arange(host_k.shape[0], dtype=jnp.int32)[None, :, None, None] * host_k.shape[1]
    rows = jax.device_put(_slots(page_table, load_pos, page_size) + lh_off, host_sharding())
    k, v = _host_gather(host_k, host_v, rows)
    k, v = jax.device_put(k, device_sharding()), jax.device_put(v, device_sharding())
    s, lh, hkv, _, _ = buf_k.shape
    b = buf_k.shape[3]
    d_oob = jnp.where(dest >= 0, dest, b)[:, None]  # [S, 1, Hkv, cap]: -1 -> dropped
    si = jnp.arange(s)[:, None, None, None]
    li = jnp.arange(lh)[None, :, None, None]
    hi = jnp.arange(hkv)[None, None, :, None]
    buf_k = buf_k.at[si, li, hi, d_oob].set(k.astype(buf_k.dtype), mode="drop")
    buf_v = buf_v.at[si, li, hi, d_oob].set(v.astype(buf_v.dtype), mode="drop")
    buf_pos = buf_pos.at[jnp.arange(s)[:, None, None], jnp.arange(hkv)[None, :, None],
                         jnp.where(dest >= 0, dest, b)].set(load_pos, mode="drop")
    return buf_k, buf_v, buf_pos


def full_update(host_k, host_v, buf_k, buf_v, buf_pos, page_table, idx, count, *, page_size: int):
    """Re-fetches the whole selection (the baseline, and the fallback when a head's churn exceeds the cap):
    buffer slot i holds selected position idx[..., i]."""
    b = idx.shape[-1]
    load = jnp.where(jnp.arange(b) < count[..., None], idx, -1)
    dest = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32), idx.shape)
    buf_pos = jnp.full_like(buf_pos, -1)
    return elastic_update(host_k, host_v, buf_k, buf_v, buf_pos, page_table, load, dest, page_size=page_size)


def transfer_bytes(num_seqs: int, host_layers: int, num_kv_heads: int, rows: int, head_dim: int,
                   itemsize: int) -> int:
    """Host -> device bytes of one update moving `rows` rows per (sequence, host layer, KV head), K + V."""
    return 2 * num_seqs * host_layers * num_kv_heads * rows * head_dim * itemsize
