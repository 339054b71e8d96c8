"""How large the KV pool may be on a device: what the server gives the engine when no size is asked for.

The engine's own default is a fixed 1 GiB pool (`Engine(kv_cache_bytes=...)`), right for tests, the CPU and
processes that hold several engines. A server owns its accelerator: like vLLM's
`gpu_memory_utilization`, it sizes the pool from the device allocator's limit, less what is already in
use (the weights) and a reserve for a step's activations and compiled temporaries. A 1 GiB pool holds
about two 1B-shaped sequences at 16K tokens, so a long-context server with the fixed default would
preempt and re-prefill most requests (docs/specontext.md, "The 1B shape").
"""

from __future__ import annotations

import jax

ACTIVATION_RESERVE = 2 << 30  # bytes kept free for step activations and compile temporaries


def pool_bytes(stats: dict, utilization: float, reserve: int = ACTIVATION_RESERVE) -> int:
    """KV bytes from allocator stats (``bytes_limit``, ``bytes_in_use``): utilization x limit - in use -
    reserve. A clear error where nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"memory utilization must lie in (0, 1] (got {utilization!r})")
    limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    free = int(utilization * limit) - used - reserve
    if free <= 0:
        raise ValueError(f"no device memory left for the KV pool: {utilization:g} x {limit / 2**30:.1f} GiB "
                         f"limit - {used / 2**30:.1f} GiB in use - {reserve / 2**30:.1f} GiB reserve <= 0; "
                         f"raise the utilization or give --num-pages")
    return free


def device_kv_bytes(utilization: float, device=None, reserve: int = ACTIVATION_RESERVE) -> int | None:
    """`pool_bytes` for `device` (default: the first), per device; None where the backend reports no
    allocator stats (the CPU): then the engine's fixed default applies."""
    stats = (device or jax.devices()[0]).memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return pool_bytes(stats, utilization, reserve)
