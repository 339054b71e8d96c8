"""The one module that runs device steps: a jitted forward + sample over the per-head paged cache.

The host hands over a `StepBatch` of numpy arrays padded to buckets; the runner pads nothing itself
and never inspects request objects. The KV pool is donated into every step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.pool import init_pool, write_kv
from jaxkv.models import llama
from jaxkv.sampling import sample
from pallas_kernels.paged_attention.api import paged_attention


@dataclasses.dataclass
class StepBatch:
    """Host-built inputs of one step. S = seq bucket, T = token bucket, P = page bucket."""

    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    q_seq: np.ndarray  # [T] int32, row of the token's sequence in this step, -1 = padding
    slots: np.ndarray  # [T, L, Hkv] int32 flat slot ids, -1 = skip
    page_table: np.ndarray  # [S, L, Hkv, P] int32, -1 = padding
    lengths: np.ndarray  # [S, L, Hkv] int32, after this step's writes
    logits_index: np.ndarray  # [S] int32, flat token index whose logits are sampled for row s
    temperature: np.ndarray  # [S] float32
    top_k: np.ndarray  # [S] int32
    top_p: np.ndarray  # [S] float32
    seeds: np.ndarray  # [S] uint32
    counters: np.ndarray  # [S] int32, output index being sampled (PRNG stream position)


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl"), donate_argnames=("pool",))
def _step(params, pool, b, cfg, attn_impl=None):
    """One ragged step: write K/V and attend per layer, then sample one token per sequence row.

    Module level (not a closure) so engines over the same model share compilations. `attn_impl` picks the
    paged-attention implementation (None: the Pallas kernel on GPU, the jnp twin elsewhere).
    """
    scale = cfg.head_dim ** -0.5

    def attend(layer, q, k, v, pool):
        pool = write_kv(pool, k[0], v[0], b["positions"], b["slots"][:, layer])
        out, _ = paged_attention(
            q[0], pool.k, pool.v, pool.pos, b["page_table"][:, layer], b["lengths"][:, layer],
            b["q_seq"], b["positions"], b["sink"][layer], b["window"][layer], scale=scale,
            implementation=attn_impl)
        return out[None], pool

    hidden, pool = llama.forward(params, cfg, b["tokens"][None], b["positions"][None], attend, pool)
    logits = llama.lm_head(params, cfg, hidden[0, b["logits_index"]])
    tokens, logprobs = sample(logits.astype(jnp.float32), b["temperature"], b["top_k"], b["top_p"],
                              b["seeds"], b["counters"])
    return tokens, logprobs, pool


def num_compilations() -> int:
    """Compiled variants of the step so far (one per bucket and model); tests use it to prove no retrace."""
    return _step._cache_size()


class ModelRunner:
    def __init__(self, model, *, num_pages: int, page_size: int, sink: np.ndarray, window: np.ndarray,
                 kv_dtype=None, attn_impl: str | None = None):
        self.cfg = model.config
        self.params = model.params
        dtype = kv_dtype or jax.tree_util.tree_leaves(model.params)[0].dtype
        self.pool = init_pool(num_pages, page_size, self.cfg.head_dim, dtype)
        self._heads = {"sink": jnp.asarray(sink, jnp.int32), "window": jnp.asarray(window, jnp.int32)}
        self.attn_impl = attn_impl

    def run(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns sampled tokens [S] and their logprobs [S] (host arrays)."""
        arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}  # numpy: jit transfers
        tokens, logprobs, self.pool = _step(self.params, self.pool, {**arrays, **self._heads}, cfg=self.cfg,
                                         attn_impl=self.attn_impl)
        return np.asarray(tokens), np.asarray(logprobs)
