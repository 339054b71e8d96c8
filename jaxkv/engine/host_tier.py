"""Host memory placement for the engine's host tiers (segment tiers): `jaxkv.cache.memory_kinds`. The
retrieval host tier (selection buffer loads, host mirror) is `jaxkv.policies.retrieve.host_tier`."""

from jaxkv.cache.memory_kinds import device_sharding, host_memory_kind, host_sharding, to_host

__all__ = ["device_sharding", "host_memory_kind", "host_sharding", "to_host"]
