"""The dense and engine methods of the eval harness.

A method turns one prompt (given as its pieces: prefix ids, segment ids, suffix ids, so reuse methods can
cache segments) into a greedy completion plus the numbers the harness reports. ``full`` is the reference:
full recompute of the whole prompt, then greedy decoding over a dense KV cache, all jitted (prefill per
power-of-two prompt bucket, one compiled decode step). The interface and the registry itself live in
`jaxkv.eval.registry`; this module defines the dense and engine methods. `all_methods()` gives the whole
registry (these, the segment-reuse methods and the retrieval methods); new methods register with
`register_method`.
"""

from __future__ import annotations

import gc
import time
import zlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine.buckets import pow2_bucket
from jaxkv.eval import metrics
from jaxkv.eval.registry import (
    METHODS,
    Method,
    MethodOutput,
    PromptPieces,
    all_methods,
    get_method,
    register_method,
)
from jaxkv.models import llama
from jaxkv.models.attention import dense_attention

__all__ = ["METHODS", "DuoHeadClasses", "EngineMethod", "FullRecompute", "Method", "MethodOutput",
           "PromptPieces", "RandomCopy", "all_methods", "get_method", "register_method"]


def _cache_attend(cfg, write_pos):
    """AttendFn over a dense per-layer cache: write k, v at `write_pos`, attend with causal positions.
    `layer` may be traced (layers under a scan): the windows are an [L] array it indexes."""
    windows = tuple(cfg.layer_windows)
    per_layer = jnp.asarray(windows, jnp.int32) if any(windows) else None

    def attend(layer, q, k, v, state):
        kc, vc, kpos = state  # [L, 1, S, Hkv, D] x2, [1, S] (-1 = empty)
        at = (0, write_pos, 0, 0)
        kc = kc.at[layer].set(jax.lax.dynamic_update_slice(kc[layer], k.astype(kc.dtype), at))
        vc = vc.at[layer].set(jax.lax.dynamic_update_slice(vc[layer], v.astype(vc.dtype), at))
        t = q.shape[1]
        q_pos = write_pos + jnp.arange(t, dtype=jnp.int32)[None]
        kp = jnp.where(jnp.arange(kpos.shape[1])[None] < write_pos + t, jnp.arange(kpos.shape[1])[None], -1)
        window = 0 if per_layer is None else per_layer[layer]
        out = dense_attention(q, kc[layer], vc[layer], q_pos, kp, window=window)
        return out, (kc, vc, kpos)

    return attend


@partial(jax.jit, static_argnums=(1,), donate_argnums=(3, 4))
def _prefill(params, cfg, tokens, kc, vc, n_valid):
    """tokens [1, Tb] (padded) -> logits of position n_valid-1, updated cache."""
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    kpos = jnp.zeros((1, kc.shape[2]), jnp.int32)
    hidden, (kc, vc, _) = llama.forward(params, cfg, tokens, pos, _cache_attend(cfg, 0), (kc, vc, kpos))
    last = jax.lax.dynamic_slice_in_dim(hidden, n_valid - 1, 1, axis=1)
    return llama.lm_head(params, cfg, last)[0, 0], kc, vc


@partial(jax.jit, static_argnums=(1,), donate_argnums=(3, 4))
def _decode(params, cfg, token, kc, vc, pos):
    """One greedy step: token [1, 1] at position pos -> logits [V], cache."""
    kpos = jnp.zeros((1, kc.shape[2]), jnp.int32)
    hidden, (kc, vc, _) = llama.forward(params, cfg, token, jnp.full((1, 1), pos, jnp.int32),
                                        _cache_attend(cfg, pos), (kc, vc, kpos))
    return llama.lm_head(params, cfg, hidden)[0, 0], kc, vc


@register_method("full")
class FullRecompute(Method):
    """Full attention over the whole prompt recomputed from scratch (the quality reference)."""

    name = "full"

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]) -> MethodOutput:
        cfg, params = self.model.config, self.model.params
        ids = pieces.ids
        n = len(ids)
        tb = pow2_bucket(n)
        size = pow2_bucket(n + max_new_tokens)
        dtype = jax.tree.leaves(params)[0].dtype
        shape = (cfg.num_layers, 1, size, cfg.num_kv_heads, cfg.head_dim)
        kc, vc = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
        toks = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, tb - n))[None])
        t0 = time.perf_counter()
        logits, kc, vc = _prefill(params, cfg, toks, kc, vc, jnp.int32(n))
        first = np.asarray(logits)
        ttft = time.perf_counter() - t0
        out: list[int] = []
        tok = int(first.argmax())
        loaded = metrics.kv_bytes(cfg, n * (n + 1) // 2, dtype.itemsize)
        while tok not in stop_ids and len(out) < max_new_tokens:
            out.append(tok)
            if len(out) == max_new_tokens:
                break
            pos = n + len(out) - 1
            logits, kc, vc = _decode(params, cfg, jnp.full((1, 1), tok, jnp.int32), kc, vc, jnp.int32(pos))
            loaded += metrics.kv_bytes(cfg, pos + 1, dtype.itemsize)
            tok = int(jnp.argmax(logits))
        return MethodOutput(out, first, ttft, metrics.kv_bytes(cfg, n + len(out), dtype.itemsize), loaded,
                            metrics.prefill_flops(cfg, n))


class EngineMethod(Method):
    """The paged engine that serves (`jaxkv.engine`): full cache, or a KV compression policy.

    With no policy it must equal `full` token for token (the eval's check that the serving path is the
    oracle's). First-token logits are not returned by the engine, so only top-1 agreement is reported for
    it (its first token against `full`'s argmax); prefill-time policies compress after the first token.
    """

    name = "engine"
    policy_name: str | None = None
    head_classes = "global"  # "global": the policy owns every head; "model": the model's head_classes.json

    def __init__(self, model, budget: float | None = None, **policy_fields):
        super().__init__(model)
        from jaxkv.policies import get_policy

        if self.policy_name is None and (budget is not None or policy_fields):
            raise ValueError(f"method {self.name!r} takes no budget; pick a KV policy method")
        fields = dict(policy_fields) | ({} if budget is None else {"budget": budget})
        self.policy = get_policy(self.policy_name, **fields) if self.policy_name else None
        self._engine = None

    def _engine_for(self, total: int):
        if self._engine is None or self._engine.max_model_len < total:
            self._engine = None  # release the old pool before sizing the new one
            self._engine = self._build_engine(total, max_num_seqs=1)
        return self._engine

    def _build_engine(self, total: int, max_num_seqs: int, kv_cache_bytes: int | None = None,
                      max_step_tokens: int | None = None):
        """An engine for sequences of up to `total` tokens (a power-of-two bucket), this method's head classes
        and policy, no prefix sharing (every instance is computed on its own)."""
        from jaxkv.cache.head_classes import all_global
        from jaxkv.engine.engine import Engine

        cfg = self.model.config
        hc = self.head_classes  # "global", "model" (None: the engine reads the file beside the model), a map
        if hc == "global":
            hc = all_global(cfg.num_layers, cfg.num_kv_heads)
        elif hc == "model":
            hc = None
        sizing = {} if kv_cache_bytes is None else {"kv_cache_bytes": kv_cache_bytes}
        if max_step_tokens is not None:
            sizing["max_step_tokens"] = max_step_tokens
        return Engine(self.model, max_num_seqs=max_num_seqs, max_model_len=pow2_bucket(total),
                      head_classes=hc, enable_prefix_caching=False, kv_policy=self.policy, **sizing)

    def _batch_kv_bytes(self, max_model_len: int, max_num_seqs: int, page_size: int) -> int:
        """Pool bytes for `max_num_seqs` sequences of `max_model_len` tokens on every head (K + V in the
        parameters' dtype, the int32 slot position, a float32 logit bias), at most what the device allows
        (on the CPU, which reports no allocator limit: the engine's default)."""
        from jaxkv.engine.config import DEFAULT_KV_CACHE_BYTES
        from jaxkv.engine.memory import device_kv_bytes

        cfg = self.model.config
        itemsize = jax.tree.leaves(self.model.params)[0].dtype.itemsize
        per_page = page_size * (2 * cfg.head_dim * itemsize + 4 + 4)
        pages = max_num_seqs * cfg.num_layers * cfg.num_kv_heads * -(-max_model_len // page_size)
        allowed = device_kv_bytes(0.9) or DEFAULT_KV_CACHE_BYTES
        return min(pages * per_page, allowed)

    def run_many(self, prompts: list[tuple[list[int], int]], stop_ids: tuple[int, ...],
                 max_num_seqs: int = 32, max_step_tokens: int | None = None) -> list[list[int]]:
        """Greedy completions of many (prompt ids, max_new_tokens) at once, `max_num_seqs` rows a step (the
        rest queue in the engine): the same tokens as `run` one by one, without one engine step per token
        per instance. Token ids only, the stop token stripped as `run` strips it. `max_step_tokens`: prompt
        tokens per engine step (None: the engine's default; prompts longer than a step still prefill
        whole)."""
        from jaxkv.engine.config import EngineConfig
        from jaxkv.sampling import SamplingParams

        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"run_many: max_num_seqs must be a positive integer (got {max_num_seqs!r})")
        if not prompts:
            return []
        total = max(len(ids) + max_new for ids, max_new in prompts) + 1
        rows = min(max_num_seqs, len(prompts))
        self._engine = None  # one engine at a time on the device (the device's free memory sizes the pool)
        gc.collect()  # an engine is a reference cycle: its pool goes only when collected
        kv_bytes = self._batch_kv_bytes(pow2_bucket(total), rows, EngineConfig.page_size)
        eng = self._build_engine(total, max_num_seqs=rows, kv_cache_bytes=kv_bytes,
                                 max_step_tokens=max_step_tokens)
        rids = []
        for ids, max_new in prompts:
            sp = SamplingParams(temperature=0.0, max_tokens=max_new, stop_token_ids=list(stop_ids),
                                ignore_eos=True)
            rids.append(eng.add_request(list(ids), sp, kv_policy=self._request_policy(len(ids))))
        outs: dict[str, list[int]] = {rid: [] for rid in rids}
        while eng.has_unfinished():
            for o in eng.step():
                outs[o.request_id].extend(o.new_token_ids)
        result = []
        for rid in rids:
            out = outs[rid]
            result.append(out[:-1] if out and out[-1] in stop_ids else out)
        del eng
        gc.collect()  # this batch's pool leaves the device before the next method sizes its own
        return result

    def _request_policy(self, num_prompt: int):
        """The KV policy of one request of `num_prompt` tokens (None: the engine's own)."""
        return None

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]) -> MethodOutput:
        from jaxkv.sampling import SamplingParams

        cfg = self.model.config
        ids = pieces.ids
        eng = self._engine_for(len(ids) + max_new_tokens + 1)
        itemsize = eng.runner.pool.k.dtype.itemsize
        # K + V per slot, plus the float32 logit bias of a merging policy's pool
        bias_bytes = 4 if eng.runner.pool.bias is not None else 0
        page_bytes = eng.page_size * (2 * cfg.head_dim * itemsize + bias_bytes)
        sp = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                            ignore_eos=True)
        free0 = eng.allocator.num_free
        t0 = time.perf_counter()
        rid = eng.add_request(ids, sp, kv_policy=self._request_policy(len(ids)))
        out, ttft, peak_pages, loaded_slots = [], None, 0, 0
        while eng.has_unfinished():
            for o in eng.step():
                out.extend(o.new_token_ids)
                ttft = ttft if ttft is not None else time.perf_counter() - t0
            if rid in eng.tables and ttft is not None:  # held while decoding (after any prefill compression)
                peak_pages = max(peak_pages, free0 - eng.allocator.num_free)
                loaded_slots += int(eng.tables.lengths(rid).sum())
        if out and out[-1] in stop_ids:
            out = out[:-1]
        first = np.full(cfg.vocab_size, np.nan, np.float32)
        first_id = out[0] if out else (list(stop_ids) or [0])[0]
        first[first_id] = 0.0  # only the argmax is known; see the class docstring
        return MethodOutput(out, first, ttft or 0.0, peak_pages * page_bytes,
                            loaded_slots * cfg.head_dim * 2 * itemsize, metrics.prefill_flops(cfg, len(ids)))


register_method("engine")(EngineMethod)


@register_method("duo")
class DuoHeadClasses(EngineMethod):
    """DuoAttention-style head classes from our profiler (`head_classes.json` beside the model, or the file
    `head_classes=PATH` names, e.g. `tools.profile_heads --out` for a GGUF model): retrieval heads keep the
    full cache, streaming heads sink + window, no other policy."""

    name = "duo"
    head_classes = "model"

    def __init__(self, model, budget: float | None = None, head_classes: str | None = None, **fields):
        super().__init__(model, budget, **fields)
        if head_classes is not None:
            from jaxkv.cache.head_classes import HeadClassMap

            self.head_classes = HeadClassMap.load(head_classes)


def _register_policy_methods():
    from jaxkv.policies import POLICIES

    for name in POLICIES:
        register_method(name)(type(f"Engine_{name}", (EngineMethod,), {"name": name, "policy_name": name}))


_register_policy_methods()


@register_method("random_copy")
class RandomCopy(Method):
    """Chance level: copy tokens drawn at random positions of the segments (frequency-weighted, so frequent
    words are as likely as they are common), as many as the budget allows. No model runs; the tasks'
    "clearly above chance" bar is measured with it through the same scoring as every other method."""

    name = "random_copy"
    compare_to_full = False

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]) -> MethodOutput:
        pool = np.asarray([t for s in pieces.segments for t in s] or pieces.ids, np.int64)
        rng = np.random.default_rng(zlib.crc32(np.asarray(pieces.ids, np.int32).tobytes()))
        out = [int(t) for t in rng.choice(pool, size=max_new_tokens) if int(t) not in stop_ids]
        first = np.full(self.model.config.vocab_size, -1e9, np.float32)
        ids, counts = np.unique(pool, return_counts=True)
        first[ids] = np.log(counts / counts.sum())
        return MethodOutput(out, first, 0.0, 0, 0, {"attention": 0.0, "ffn": 0.0})

