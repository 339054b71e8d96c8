"""Where arrays live on a device: its host memory kind and the shardings that place arrays in host or device
memory (the retrieval host tier's mirror, the segment tiers' host copies)."""

from __future__ import annotations

import jax
from jax.sharding import SingleDeviceSharding


def host_memory_kind(device=None) -> str | None:
    """The host memory kind this device offers ("pinned_host", else "unpinned_host"; None = neither)."""
    kinds = {m.kind for m in (device or jax.devices()[0]).addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


def host_sharding(device=None) -> SingleDeviceSharding:
    return SingleDeviceSharding(device or jax.devices()[0], memory_kind=host_memory_kind(device))


def device_sharding(device=None) -> SingleDeviceSharding:
    return SingleDeviceSharding(device or jax.devices()[0], memory_kind="device")


def to_host(x, device=None):
    """x placed in host memory."""
    return jax.device_put(x, host_sharding(device))
