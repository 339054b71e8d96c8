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

ACTIVATION_RESERVE = 2 << 30  # bytes kept free for the device tables, compile temporaries and the like


def step_activation_bytes(cfg, tokens: int, itemsize: int) -> int:
    """Device memory a step of `tokens` prompt tokens needs for its activations, estimated from the model's
    shape: one layer's live tensors (the residual, q / k / v and the attention output, the FFN's gate, up and
    their product) in the parameters' dtype plus a float32 norm; XLA reuses them from layer to layer. An
    H100 1B-shaped step of 32,768 tokens needed 2.39 GiB by XLA's memory analysis; this gives 2.5 GiB.

    The server keeps this free beside the pool (on top of `ACTIVATION_RESERVE`), so its largest step
    fits: with the fixed reserve alone a 1B server on an H100 sized its pool until 0.69 GiB were left."""
    qkv_out = 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = (3 * cfg.hidden_size + 3 * cfg.intermediate_size + qkv_out) * itemsize + 4 * cfg.hidden_size
    return int(tokens) * per_token


def retrieval_state_bytes(policies, model, num_seqs: int, slots: int) -> int:
    """Device bytes the per-request states of retrieval `policies` take beside the pool
    (`RetrievalPolicy.init_state`: a row of `slots` slots for each of `num_seqs` sequences; SpeContext's
    keys of the 8B shape at 256 x 32K are ~17 GB), from their shapes alone (nothing allocated); 0 for a
    stateless method. A server sizing its pool from memory keeps them free: they are made after the pool."""
    import numpy as np

    from jaxkv.engine.engine import _resolve_policy

    total = 0
    for policy in {_resolve_policy(p, None, model) for p in policies}:
        head = policy.load_params(model)
        shapes = jax.eval_shape(lambda policy=policy, head=head: policy.init_state(head, num_seqs, slots))
        total += sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))
    return total


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
