"""The one module that runs device steps: jitted forward + sample over the per-head paged cache.

The host hands over numpy arrays padded to buckets; the runner pads nothing itself and never inspects
request objects. The KV pool is donated into every call. Two entry points:

* `run(StepBatch)`: one ragged step (prefill chunks and/or single decode tokens), one token per row.
* `decode(DecodeBatch)`: `K` decode steps in one `lax.scan` (one dispatch, one host sync for K tokens);
  the slots of all K steps were reserved by the host beforehand, and a row stops on the device when it
  samples a stop token or uses up its reserved steps (off the GPU, steps after every row stopped are
  skipped). It returns a `PendingDecode` without waiting: the
  engine may dispatch the next call (fed from `last` on the device) before it reads these results. With
  the Pallas kernel each step writes the pool once, after all layers (each layer merges its token's own
  K/V by the lse).

With the Pallas kernel, the paged-attention metadata is one multi-layer plan per step (built before any
K/V write: the engine's rings are unordered, so the plan never reads slot positions). A step made of one
fresh prompt (positions 0..n-1) attends through `head_class_prefill` instead (global heads dense flash,
local heads sink + window) and only writes its K/V into the pages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.pool import init_pool, write_kv
from jaxkv.engine import programs
from jaxkv.models import llama, rope
from jaxkv.parallel import shard as tp_shard
from jaxkv.sampling import sample, top_logprobs
from pallas_kernels.head_class_prefill.api import head_class_prefill
from pallas_kernels.paged_attention.api import (
    paged_attention,
    paged_attention_plan,
    paged_attention_with_plan,
)
from pallas_kernels.rows_attention import rows_attention


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
    fresh: bool = False  # the step is one fresh prompt at positions 0..n-1 (row 0): head_class_prefill
    top_width: int = 0  # static: > 0 returns the top-`top_width` alternatives of every row (logprobs)
    # [T] int32, or None: the prompt token after each position whose log-probability the step returns
    # (-1: none); a static variant of its own (prompt logprobs, jaxkv.sampling.SamplingParams)
    prompt_next: np.ndarray | None = None
    # Steps that start at layer `from_layer` (> 0, static) from residual streams computed before: token t's
    # stream is row hidden_rows[t] of `hidden` [N, hidden] (a device buffer; -1 = padding). A selecting reuse
    # method's sparse phase (jaxkv/engine/reuse_steps.py); `tokens` are then unused.
    hidden: Any = None
    hidden_rows: np.ndarray | None = None
    from_layer: int = 0
    # [P x page size] int32 with `from_layer`: the storage slot (in row 0's page table) of the key at each
    # position, -1 = none; row 0's keys are read in position order through it (`_sequence_rows`)
    key_storage: np.ndarray | None = None


# The fields of a StepBatch that are not arrays every step takes (static choices, a variant's own inputs).
STEP_OPTIONS = ("fresh", "top_width", "prompt_next", "hidden", "hidden_rows", "from_layer", "key_storage")


@dataclasses.dataclass
class DecodeBatch:
    """Host-built inputs of K decode steps of S rows (one token per row per step)."""

    tokens: np.ndarray  # [S] int32, the token fed at step 0 (the last known token of each row)
    positions: np.ndarray  # [S] int32, its position; step k feeds position + k
    slots: np.ndarray  # [K, S, L, Hkv] int32, reserved slots of each step, -1 = none
    lengths: np.ndarray  # [K, S, L, Hkv] int32, stored slots after step k's write
    prev_lengths: np.ndarray  # [K, S, L, Hkv] int32, stored slots before step k's write
    active: np.ndarray  # [K, S] bool, step k of row s was reserved (padding rows: never)
    page_table: np.ndarray  # [S, L, Hkv, P] int32 after the reservation of all K steps
    stop_ids: np.ndarray  # [S, M] int32, tokens that end a row (EOS, stop_token_ids), -1 = none
    temperature: np.ndarray  # [S] float32
    top_k: np.ndarray  # [S] int32
    top_p: np.ndarray  # [S] float32
    seeds: np.ndarray  # [S] uint32
    counters: np.ndarray  # [S] int32, output index sampled at step 0
    top_width: int = 0  # static: > 0 returns the top-`top_width` alternatives of every row and step


@dataclasses.dataclass
class PendingDecode:
    """A dispatched multi-step decode whose results are still on the device. `last` [S] is each row's last
    sampled token, so a next call can start from it without a host round trip; `result()` waits for the
    call and brings tokens, logprobs and ran ([K, S] each) to the host, then runs `on_result(ran)` (host
    bookkeeping that needs the results, e.g. retrieval statistics)."""

    tokens: jax.Array
    logprobs: jax.Array
    ran: jax.Array
    last: jax.Array | None
    on_result: object = None  # callable(ran) or None
    top: tuple | None = None  # (ids, logprobs) [K, S, W]: the top-W alternatives, when the call computed them

    def top_result(self) -> tuple[np.ndarray, np.ndarray] | None:
        return None if self.top is None else jax.device_get(self.top)

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens, logprobs, ran = np.asarray(self.tokens), np.asarray(self.logprobs), np.asarray(self.ran)
        if self.on_result is not None:
            self.on_result(ran)
            self.on_result = None
        return tokens, logprobs, ran


def _greedy(logits):
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]


def _sample(logits, b, greedy: bool):
    """`greedy` (static): a program for batches without a sampled row, an argmax only
    (`EngineConfig.greedy_programs`). Otherwise one program serves both: a `lax.cond` on whether any row
    samples skips the sampler for greedy batches (H100, 1B, 32 rows: 2.13-2.21 ms a decode step against
    2.12-2.14 ms for the argmax program; docs/engine.md, "How many variants")."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return _greedy(logits)

    def draw(x):
        return sample(x, b["temperature"], b["top_k"], b["top_p"], b["seeds"], b["counters"])

    return jax.lax.cond(jnp.any(b["temperature"] > 0), draw, _greedy, logits)


# Prompt positions whose logits one pass of the prompt-logprobs map computes ([C, V] float32 at a time, never
# [T, V]: a 32K prompt of a 128K vocabulary would be 16 GiB).
PROMPT_LOGITS_CHUNK = 256


def _extras(params, cfg, hidden, b, logits, top_width: int, prompt_lp: bool, tp: bool) -> dict:
    """What a step returns beyond the sampled tokens, only in the variants that ask (static): the rows' top
    alternatives (`top`) and, with `prompt_lp`, log p(next prompt token) at every position (`prompt`, [T])
    plus its alternatives (`prompt_top`, [T, W]). Empty for ordinary steps: their program is unchanged."""
    out = {}
    if top_width:
        out["top"] = top_logprobs(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), top_width)
    if prompt_lp:
        out.update(_prompt_logprobs(params, cfg, hidden, b["prompt_next"], top_width, tp))
    return out


def _prompt_logprobs(params, cfg, hidden, next_ids, top_width: int, tp: bool) -> dict:
    """log p(next_ids[t] | tokens up to t) for every position t (hidden [T, D]; next_ids [T], -1: none),
    PROMPT_LOGITS_CHUNK positions of logits at a time."""
    t = hidden.shape[0]
    c = min(t, PROMPT_LOGITS_CHUNK)
    pad = -t % c
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, c, hidden.shape[-1])
    n = jnp.pad(next_ids, (0, pad), constant_values=-1).reshape(-1, c)

    def one(args):
        h, n = args
        lp = jax.nn.log_softmax(_logits(params, cfg, h, tp).astype(jnp.float32), axis=-1)
        tok = jnp.take_along_axis(lp, jnp.maximum(n, 0)[:, None], axis=-1)[:, 0]
        return (tok, top_logprobs(lp, top_width)) if top_width else (tok, None)

    tok, top = jax.lax.map(one, (h, n))
    out = {"prompt": tok.reshape(-1)[:t]}
    if top is not None:
        out["prompt_top"] = tuple(x.reshape(-1, top_width)[:t] for x in top)
    return out


def _layer_meta(b, lengths_key="lengths") -> dict:
    """The step metadata the layer scan slices per layer: `[L, ...]` arrays, layer-major."""
    return {"slots": b["slots"].transpose(1, 0, 2), "page_table": b["page_table"].transpose(1, 0, 2, 3),
            "lengths": b[lengths_key].transpose(1, 0, 2), "sink": b["sink"], "window": b["window"]}


def fresh_attend(fresh_heads, scale: float, tp: bool):
    """head_class_prefill with each layer's static head classes. `fresh_heads`: per-layer (sink, window)
    tuples, or one such tuple per shard with `tp`. A static layer (the unrolled loop) compiles only its own
    classes; a traced one (the scan) switches over the model's distinct classes."""
    shards = fresh_heads if tp else (fresh_heads,)
    configs = sorted({cls for shard in shards for cls in shard})
    index = jnp.asarray([[configs.index(cls) for cls in shard] for shard in shards], jnp.int32)  # [tp, L]
    prefill = {cls: functools.partial(_prefill, sink=cls[0], window=cls[1], scale=scale) for cls in configs}

    def attend(layer, q, k, v):
        if isinstance(layer, int):
            return tp_shard.per_shard([prefill[shard[layer]] for shard in shards], q, k, v)
        if len(configs) == 1:
            return prefill[configs[0]](q, k, v)
        row = tp_shard.shard_index() if tp and len(shards) > 1 else 0
        return jax.lax.switch(index[row, layer], [prefill[c] for c in configs], q, k, v)

    return attend


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """What a method adds to the ragged step's forward (the retrieval tap), all applied while tracing:
    `state` threads through the layers beside the pool; `on_write(layer, k, slots, pool, state)` -> state
    runs after each layer's K/V write (k [T, Hkv, D], slots [T, Hkv]); `tap(x, state)` -> state reads the
    residual stream x [T, hidden] before layer `tap_layer` (none at or past the last layer)."""

    state: Any = None
    on_write: Callable | None = None
    tap: Callable | None = None
    tap_layer: int = 0


def _forward_sample(params, pool, b, cfg, attn_impl, use_plan: bool, greedy: bool, fresh_heads=None,
                    tp: bool = False, top_width: int = 0, prompt_lp: bool = False,
                    hooks: StepHooks | None = None, rolled: bool = False, from_layer: int = 0):
    """Shared body of a step: per layer (under the layer loop) write K/V then attend; sample one token per
    row. `tp`: runs per shard under shard_map (jaxkv.parallel); `fresh_heads` is then one per-layer tuple
    per shard. `hooks`: a method's additions (`StepHooks`). `rolled`: the layers as one rolled loop
    (`EngineConfig.rolled_from_tokens`). -> tokens, logprobs, extras (`_extras`), pool, and the hooks'
    state when given."""
    scale = cfg.head_dim ** -0.5
    meta = _layer_meta(b)
    plan = None
    # a step from a selection layer on a GPU: one sequence's scattered rows over its whole history
    rows_split = bool(from_layer) and use_plan
    if use_plan and fresh_heads is None and not rows_split:
        plan = paged_attention_plan(
            pool.pos, meta["page_table"], meta["lengths"], b["q_seq"], b["positions"], b["sink"],
            b["window"], num_q_heads=cfg.num_heads, ordered=False)
    fresh = fresh_attend(fresh_heads, scale, tp) if fresh_heads is not None else None
    on_write = hooks.on_write if hooks is not None else None

    def attend(layer, q, k, v, state, m):
        pool, extra = state
        pool = write_kv(pool, k[0], v[0], b["positions"], m["slots"])
        if on_write is not None:
            extra = on_write(layer, k[0], m["slots"], pool, extra)
        if fresh is not None:
            out = fresh(layer, q[0], k[0], v[0])
        elif rows_split:
            rows = jnp.where(b["q_seq"] >= 0, b["positions"], -1)
            out = _sequence_rows(q[0], pool, m["page_table"][0], b["key_storage"], rows, scale,
                                 "pallas" if attn_impl == "pallas" else None)
        else:
            out, _ = _pool_attention(plan, layer, q[0], pool, meta["page_table"], m, b, scale, attn_impl)
        return out[None], (pool, extra)

    if from_layer:
        x = b["hidden"][jnp.maximum(b["hidden_rows"], 0)][None]
    else:
        x = params["embed"][b["tokens"]][None]
    run = functools.partial(llama.run_layers, params["layers"], cfg, positions=b["positions"][None],
                            freqs=rope.inv_freq(cfg), attend=attend, reduce=tp_shard.reduce if tp else None,
                            layer_xs=meta, rolled=rolled)
    state = (pool, hooks.state if hooks is not None else None)
    split = hooks.tap_layer if hooks is not None and hooks.tap is not None else cfg.num_layers
    if from_layer:
        if hooks is not None:
            raise ValueError("a step from a later layer takes no method hooks")
        x, state = run(x=x, state=state, start=from_layer)
    elif split < cfg.num_layers:  # the layer loop in two ranges around the tap (one traced layer body)
        x, (pool, extra) = run(x=x, state=state, stop=split)
        state = (pool, hooks.tap(x[0], extra))
        x, state = run(x=x, state=state, start=split)
    else:
        x, state = run(x=x, state=state)
    pool, extra = state
    hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = _logits(params, cfg, hidden[0, b["logits_index"]], tp)
    tokens, logprobs = _sample(logits, b, greedy)
    out = (tokens, logprobs, _extras(params, cfg, hidden[0], b, logits, top_width, prompt_lp, tp), pool)
    return out if hooks is None else (*out, extra)


def _pool_attention(plan, layer, q, pool, pt_layers, m, b, scale, attn_impl):
    """Layer `layer`'s paged attention of q over the pool -> (out, lse): through the step's multi-layer
    `plan` (built over `pt_layers`) when there is one, else `paged_attention` on the layer's metadata `m`."""
    if plan is not None:
        return _with_plan(plan, layer, q, pool, pt_layers, m["page_table"], scale)
    return paged_attention(q, pool.k, pool.v, pool.pos, m["page_table"], m["lengths"], b["q_seq"],
                           b["positions"], m["sink"], m["window"], scale=scale, implementation=attn_impl,
                           slot_bias=pool.bias)


def _with_plan(plan, layer, q, pool, pt_layers, pt_layer, scale):
    """Layer `layer` of the step's multi-layer plan. A static layer (the unrolled loop) reads its metadata
    and page-table rows in place (`layer=`: no per-layer slice copies, ~1.6 us each on an H200 decode
    step); a traced one (the scan) takes the layer's slice."""
    if isinstance(layer, int):
        return paged_attention_with_plan(plan, q, pool.k, pool.v, pool.pos, pt_layers, scale=scale,
                                         layer=layer, slot_bias=pool.bias)
    return paged_attention_with_plan(plan.layer(layer), q, pool.k, pool.v, pool.pos, pt_layer, scale=scale,
                                     slot_bias=pool.bias)


def _sequence_rows(q, pool, page_table, key_storage, positions, scale, diagonal_impl):
    """Attention of one sequence's rows (q [T, Hq, D] at ascending `positions`, -1 = padding) over its whole
    history: its keys gathered in position order (key t from storage slot key_storage[t] of page_table
    [H, P]; zeros where -1), then `rows_attention`'s split, cuDNN flash over each row chunk's keys before it
    and the paged kernel on the diagonal. The paged kernel alone scans every page for every query block
    (the ragged step's pages are unordered): with 4K rows over 33K keys a step took 2.6x the reuse pass's
    time for the same rows (H100, 1B; docs/segments.md, "Reuse as steps")."""
    ps = pool.page_size
    st = jnp.maximum(key_storage, 0)
    page = page_table[:, st // ps]                                      # [H, N]
    ok = (key_storage >= 0)[None] & (page >= 0)
    flat = jnp.maximum(page, 0) * ps + (st % ps)[None]

    def by_position(x):  # [num_pages, ps, D] -> this sequence's [N, H, D], key t at position t
        g = x.reshape(-1, x.shape[-1])[flat]
        return jnp.where(ok[..., None], g, 0).astype(q.dtype).transpose(1, 0, 2)

    return rows_attention(q, by_position(pool.k), by_position(pool.v), positions, scale=scale,
                          implementation="split", diagonal_impl=diagonal_impl)[0]


def _prefill(q, k, v, *, sink, window, scale):
    return head_class_prefill(q, k, v, sink, window, scale=scale)[0]


def _logits(params, cfg, hidden, tp: bool):
    logits = llama.lm_head(params, cfg, hidden)
    return tp_shard.gather_logits(logits, cfg.vocab_size) if tp else logits


def _merge_own(out, lse, q, k, v, scale):
    """Adds each query's own new key/value to its paged result (out [T, Hq, D], lse [T, Hq]) by the
    log-sum-exp: exact, since the kernel returns the lse of the same scaled scores (-inf when empty)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(t, hkv, g, d)
    own = jnp.einsum("thgd,thd->thg", qf, k.astype(jnp.float32)).reshape(t, hq) * scale
    m = jnp.maximum(lse, own)
    wp, wo = jnp.exp(lse - m), jnp.exp(own - m)
    vq = jnp.repeat(v.astype(jnp.float32), g, axis=1)  # [T, Hq, D]: query head qh reads KV head qh // G
    merged = (wp[..., None] * out.astype(jnp.float32) + wo[..., None] * vq) / (wp + wo)[..., None]
    return merged.astype(q.dtype)


@dataclasses.dataclass(frozen=True)
class DecodeHooks:
    """What a method adds to the decode step's forward (the retrieval decode), applied while tracing. Layers
    before `tap_layer` attend the whole pool as the runner's decode does. `tap(x, pool, state)` -> (state,
    items) reads the residual stream x [S, hidden] before layer `tap_layer` (`items`: one pytree per layer
    from there on, or None); those layers attend through `attend(layer, q, k, v, pool, state, item)` ->
    (out, state, item) (q [S, Hq, D]; k, v [S, Hkv, D] the token's own, already kept or written), and
    `untap(state, items)` -> state takes the items back after the last layer. `observe(x, state)` -> state
    reads the stream before layer `observe_layer` when that lies past `tap_layer` and before the last layer.
    `on_write(layer, k, slots, pool, state)` -> state runs after each layer's K/V is kept or written.
    `deferred`: every layer's K/V reach the pool in one scatter after the last layer, each layer adding the
    token's own K/V by the lse; else each layer writes its K/V before it attends."""

    state: Any
    tap_layer: int
    tap: Callable
    attend: Callable
    untap: Callable | None = None
    observe: Callable | None = None
    observe_layer: int = 0
    on_write: Callable | None = None
    deferred: bool = True


def _decode_forward(params, pool, b, cfg, greedy: bool, tp: bool = False, top_width: int = 0, *,
                    attn_impl=None, use_plan: bool = True, hooks: DecodeHooks | None = None):
    """A decode step (one token per row) -> tokens, logprobs, extras (`_extras`), pool, and the hooks' state
    with `hooks` (`DecodeHooks`: a method's layers from its tap on).

    Deferred (always without hooks): every layer attends the pool as it was before the step
    (`prev_lengths`: the new slot is not yet valid) and merges the token's own K/V through the lse, and every
    layer's K/V go to the pool with one scatter after the forward: three pool scatters per step instead of
    three per layer, which a decode profile showed costing more than the attention itself. With `use_plan`
    the layers before the tap attend through one multi-layer plan built before the forward; else through
    `paged_attention` per layer."""
    scale = cfg.head_dim ** -0.5
    n_layers, t = cfg.num_layers, b["tokens"].shape[0]
    deferred = hooks.deferred if hooks is not None else True
    first = min(hooks.tap_layer, n_layers) if hooks is not None else n_layers
    meta = _layer_meta(b, "prev_lengths" if deferred else "lengths")
    plan = dense = None
    if use_plan and first > 0:  # the plan of the layers before the tap only
        dense = meta if first == n_layers else jax.tree.map(lambda a: a[:first], meta)
        plan = paged_attention_plan(
            pool.pos, dense["page_table"], dense["lengths"], b["q_seq"], b["positions"], dense["sink"],
            dense["window"], num_q_heads=cfg.num_heads, ordered=False)
    on_write = hooks.on_write if hooks is not None else None

    def keep(layer, k, v, state, m):
        """The token's K/V: kept for the scatter after the last layer (deferred) or written now."""
        pool, ks, vs, extra = state
        if deferred:
            ks, vs = ks.at[layer].set(k.astype(ks.dtype)), vs.at[layer].set(v.astype(vs.dtype))
        else:
            pool = write_kv(pool, k, v, b["positions"], m["slots"])
        if on_write is not None:
            extra = on_write(layer, k, m["slots"], pool, extra)
        return pool, ks, vs, extra

    def attend(layer, q, k, v, state, m):
        state = keep(layer, k[0], v[0], state, m)
        pool = state[0]
        pt_layers = dense["page_table"] if plan is not None else None
        out, lse = _pool_attention(plan, layer, q[0], pool, pt_layers, m, b, scale, attn_impl)
        if deferred:
            out = _merge_own(out, lse, q[0], k[0], v[0], scale)
        return out[None], state

    def method_attend(layer, q, k, v, state, m):
        pool, ks, vs, extra = keep(layer, k[0], v[0], state, m)
        out, extra, _ = hooks.attend(layer, q[0], k[0], v[0], pool, extra, None)
        return out[None], (pool, ks, vs, extra)

    def method_attend_items(layer, q, k, v, state, m):  # with the tap's per-layer items (`per_layer`)
        state, item = state
        pool, ks, vs, extra = keep(layer, k[0], v[0], state, m)
        out, extra, item = hooks.attend(layer, q[0], k[0], v[0], pool, extra, item)
        return out[None], ((pool, ks, vs, extra), item)

    hkv, d = cfg.num_kv_heads, cfg.head_dim
    new = jnp.zeros((n_layers, t, hkv, d), pool.k.dtype) if deferred else None
    state = (pool, new, new, hooks.state if hooks is not None else None)
    x = params["embed"][b["tokens"]][None]
    run = functools.partial(llama.run_layers, params["layers"], cfg, positions=b["positions"][None],
                            freqs=rope.inv_freq(cfg), reduce=tp_shard.reduce if tp else None, layer_xs=meta)
    x, state = run(x=x, attend=attend, state=state, stop=first)
    if first < n_layers:  # the method's layers, from its tap (split where it observes the stream again)
        pool, ks, vs, extra = state
        extra, items = hooks.tap(x[0], pool, extra)
        state = (pool, ks, vs, extra)
        split = hooks.observe_layer if hooks.observe is not None else n_layers
        split = split if first < split < n_layers else n_layers
        fn = method_attend if items is None else method_attend_items
        x, state = run(x=x, attend=fn, state=state, start=first, stop=split,
                       per_layer=None if items is None else items[:split - first])
        state, head = (state, ()) if items is None else state
        if split < n_layers:
            pool, ks, vs, extra = state
            state = (pool, ks, vs, hooks.observe(x[0], extra))
            x, state = run(x=x, attend=fn, state=state, start=split,
                           per_layer=None if items is None else items[split - first:])
            state, tail = (state, ()) if items is None else state
        else:
            tail = ()
        if hooks.untap is not None:
            pool, ks, vs, extra = state
            state = (pool, ks, vs, hooks.untap(extra, tuple(head) + tuple(tail)))
    pool, ks, vs, extra = state
    if deferred:  # every layer's K/V of the step in one scatter (layer-major rows: l * T + i)
        rows, hk, dh = n_layers * t, ks.shape[2], ks.shape[3]
        pool = write_kv(pool, ks.reshape(rows, hk, dh), vs.reshape(rows, hk, dh),
                        jnp.tile(b["positions"], n_layers), meta["slots"].reshape(rows, hk))
    hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = _logits(params, cfg, hidden[0, b["logits_index"]], tp)
    tokens, logprobs = _sample(logits, b, greedy)
    out = (tokens, logprobs, _extras(params, cfg, None, b, logits, top_width, False, tp), pool)
    return out if hooks is None else (*out, extra)


def decode_loop(d, state, step, while_live: bool = False):
    """The K decode steps of `d` (a `DecodeBatch`'s arrays): `step(state, b, live)` -> (state, tokens,
    logprobs, out) runs one, given that step's inputs `b` (tokens fed, positions, the live rows' slots, the
    page table and head lengths, sampling) and the rows it runs `live` [S] (reserved, not stopped). A row
    stops on the device when it samples one of its stop ids. `while_live`: the loop ends at the first step no
    row runs (`scan_while_live`), else a `lax.scan` over every step. -> (state, last [S] (each row's last
    sampled token), (tokens, logprobs, ran, outs) stacked over the steps)."""
    s = d["tokens"].shape[0]
    rows = jnp.arange(s, dtype=jnp.int32)

    def body(carry, xs):
        state, tok, done = carry
        k, slots, lengths, prev_lengths, active = xs
        live = active & ~done
        b = {"tokens": tok, "positions": d["positions"] + k, "q_seq": jnp.where(live, rows, -1),
             "slots": jnp.where(live[:, None, None], slots, -1), "page_table": d["page_table"],
             "lengths": lengths, "prev_lengths": prev_lengths, "logits_index": rows,
             "temperature": d["temperature"], "top_k": d["top_k"], "top_p": d["top_p"], "seeds": d["seeds"],
             "counters": d["counters"] + k, "sink": d["sink"], "window": d["window"]}
        state, tokens, logprobs, out = step(state, b, live)
        stop = jnp.any(tokens[:, None] == d["stop_ids"], axis=-1)
        return (state, jnp.where(live, tokens, tok), done | (live & stop)), (tokens, logprobs, live, out)

    steps = jnp.arange(d["slots"].shape[0], dtype=jnp.int32)
    carry = (state, d["tokens"], jnp.zeros((s,), bool))
    xs = (steps, d["slots"], d["lengths"], d["prev_lengths"], d["active"])
    (state, last, _), outs = (scan_while_live if while_live else jax.lax.scan)(body, carry, xs)
    return state, last, outs


def _step_body(params, pool, b, cfg, attn_impl=None, use_plan=False, greedy=False, fresh_heads=None,
               mesh=None, top_width=0, prompt_lp=False, rolled=False, from_layer=0):
    """One ragged step. Module level (not a closure) so engines over the same model share compilations.

    `attn_impl` picks the paged-attention implementation (None: the Pallas kernel on GPU, the jnp twin
    elsewhere); `fresh_heads` (static per-layer (sink, window) tuples) routes a fresh prompt through
    head_class_prefill. `mesh`: tensor parallel over KV heads, the body runs per shard (jaxkv.parallel).
    `top_width` / `prompt_lp`: the logprob variants (`_extras`); 0 / False compile the ordinary step.
    `rolled`: the layers as one rolled loop (`EngineConfig.rolled_from_tokens`). `from_layer`: a step over
    earlier residual streams (`StepBatch.hidden`), on one device.
    """
    if mesh is not None:
        if from_layer:
            raise ValueError("a step from a later layer runs on one device (no tensor parallelism)")
        body = functools.partial(_tp_sample, attn_impl=attn_impl, use_plan=use_plan, greedy=greedy,
                                 fresh_heads=fresh_heads, top_width=top_width, prompt_lp=prompt_lp,
                                 rolled=rolled)
        return tp_shard.tp_call(body, mesh, params, pool, b, cfg, (None, None, None, "pool"))
    return _forward_sample(params, pool, b, cfg, attn_impl, use_plan, greedy, fresh_heads,
                           top_width=top_width, prompt_lp=prompt_lp, rolled=rolled, from_layer=from_layer)


_STEP_STATIC = dict(static_argnames=("cfg", "attn_impl", "use_plan", "greedy", "fresh_heads", "mesh",
                                     "top_width", "prompt_lp", "rolled", "from_layer"),
                    donate_argnames=("pool",))
_step = jax.jit(_step_body, **_STEP_STATIC)
# Steps of at least GRAPHLESS_TOKENS tokens compile without XLA:GPU command buffers (CUDA graphs). A prompt's
# step is a few hundred long kernels, so a graph saves no launch time, but XLA updates the graph's buffer
# addresses on every call: ~4.4 ms of host time before the first kernel of an 8K prefill on an H200
# (python -m benchmarks.profile_decode --prefill; docs/engine.md). Decode and small ragged steps keep their
# graphs.
GRAPHLESS_TOKENS = 1024
_step_graphless = jax.jit(_step_body, **_STEP_STATIC, compiler_options={"xla_gpu_enable_command_buffer": ""})


def _tp_sample(params, pool, b, cfg, *, attn_impl, use_plan, greedy, fresh_heads, top_width, prompt_lp,
               rolled=False):
    return _forward_sample(params, pool, b, cfg, attn_impl, use_plan, greedy, fresh_heads, tp=True,
                           top_width=top_width, prompt_lp=prompt_lp, rolled=rolled)


@functools.partial(jax.jit, static_argnames=("cfg", "attn_impl", "use_plan", "greedy", "mesh", "top_width"),
                   donate_argnames=("pool",))
def _decode(params, pool, d, cfg, attn_impl=None, use_plan=False, greedy=False, mesh=None, top_width=0):
    """K decode steps in one lax.scan; -> tokens [K, S], logprobs [K, S], ran [K, S] bool, last [S] (each
    row's last sampled token: the next call's input), extras ({"top": (ids, logprobs) [K, S, W]} with
    `top_width`, else empty), pool."""
    if mesh is not None:
        body = functools.partial(_decode_body, attn_impl=attn_impl, use_plan=use_plan, greedy=greedy, tp=True,
                                 top_width=top_width)
        return tp_shard.tp_call(body, mesh, params, pool, d, cfg, (None, None, None, None, None, "pool"))
    return _decode_body(params, pool, d, cfg, attn_impl=attn_impl, use_plan=use_plan, greedy=greedy,
                        top_width=top_width)


def _decode_body(params, pool, d, cfg, *, attn_impl, use_plan, greedy, tp=False, top_width=0):
    def step(pool, b, live):
        if use_plan:
            tokens, logprobs, extras, pool = _decode_forward(params, pool, b, cfg, greedy, tp, top_width)
        else:
            tokens, logprobs, extras, pool = _forward_sample(
                params, pool, b, cfg, attn_impl, use_plan, greedy, tp=tp, top_width=top_width)
        return pool, tokens, logprobs, extras

    # off the GPU the loop ends at the first step no row runs (`scan_while_live`)
    pool, last, (tokens, logprobs, ran, extras) = decode_loop(d, pool, step, jax.default_backend() != "gpu")
    return tokens, logprobs, ran, last, extras, pool


def scan_while_live(step, carry, xs):
    """`lax.scan(step, carry, xs)` over the K decode steps of `_decode_body` that stops at the first step
    no row runs (reserved and not stopped; a row reserves a prefix of the K steps, so none runs after);
    the steps not run return zeros. A request given fewer tokens than K (max_tokens, a stop) would
    otherwise compute the call's remaining steps for nothing (CPU, SmolLM2, 7 tokens in a 16-step call:
    16 steps' time). A while loop, not a `lax.cond` per step: a conditional's branches copy the donated
    pool. `step`'s carry ends with the rows stopped, xs[4] holds the rows reserved per step. The runner's
    decode takes it off the GPU only (XLA:GPU reads a while loop's predicate on the host, a sync per
    step); the retrieval decode everywhere (`jaxkv.engine.retrieval`: a decode token split off a ragged
    step runs one step of the K-step program, not a program of its own)."""
    n = xs[0].shape[0]
    shapes = jax.eval_shape(step, carry, jax.tree.map(lambda x: x[0], xs))[1]
    outs = jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype), shapes)

    def live(state):  # the carry's last entry: rows stopped; xs[4]: rows reserved per step
        k, carry, _ = state
        return (k < n) & jnp.any(xs[4][jnp.minimum(k, n - 1)] & ~carry[-1])

    def body(state):
        k, carry, outs = state
        carry, out = step(carry, jax.tree.map(lambda x: x[k], xs))
        return k + 1, carry, jax.tree.map(lambda o, x: o.at[k].set(x), outs, out)

    _, carry, outs = jax.lax.while_loop(live, body, (jnp.int32(0), carry, outs))
    return carry, outs


def num_compilations() -> int:
    """Compiled variants of the device steps so far (one per bucket and model); tests use it to prove no
    retrace."""
    from jaxkv.engine import device_tables  # the step metadata computed on the device

    return (_step._cache_size() + _step_graphless._cache_size() + _decode._cache_size()
            + programs.installed("runner") + device_tables.num_compilations())


class ModelRunner:
    def __init__(self, model, *, num_pages: int, page_size: int, sink: np.ndarray, window: np.ndarray,
                 kv_dtype=None, attn_impl: str | None = None, mesh=None, kv_merge: bool = False,
                 greedy_programs: bool = False, rolled_from_tokens: int = 0):
        self.cfg = model.config
        # Ragged steps of at least this many tokens run their layers rolled
        # (`EngineConfig.rolled_from_tokens`); only a shared layer body rolls.
        self.rolled_from_tokens = int(rolled_from_tokens) if isinstance(model.params["layers"],
                                                                         llama.SharedLayers) else 0
        # Whether batches of greedy rows only run their own (argmax) programs: `EngineConfig.greedy_programs`.
        self.greedy_programs = greedy_programs
        self.params = model.params
        self.mesh = mesh  # tensor parallel over KV heads (jaxkv.parallel): params + pool sharded on "tp"
        dtype = kv_dtype or jax.tree_util.tree_leaves(model.params)[0].dtype
        if mesh is None:
            self.pool = init_pool(num_pages, page_size, self.cfg.head_dim, dtype, bias=kv_merge)
        self._heads = {"sink": jnp.asarray(sink, jnp.int32), "window": jnp.asarray(window, jnp.int32)}
        # Static per-layer head classes for head_class_prefill of fresh prompts.
        self.fresh_heads = tuple((tuple(int(x) for x in sk), tuple(int(x) for x in wd))
                                 for sk, wd in zip(np.asarray(sink), np.asarray(window)))
        if mesh is not None:
            from jaxkv.parallel.mesh import init_sharded_pool, shard_params, tp_size
            self.params = shard_params(self.params, self.cfg, mesh)
            self.pool = init_sharded_pool(num_pages, page_size, self.cfg.head_dim, dtype, mesh, bias=kv_merge)
            self.fresh_heads = _split_heads(np.asarray(sink), np.asarray(window), tp_size(mesh))
        self.attn_impl = attn_impl
        # The multi-layer plan is the Pallas kernel's; the jnp twin takes the contract's arguments per layer.
        self.use_plan = attn_impl == "pallas" or (attn_impl is None and jax.default_backend() == "gpu")
        # Programs compiled ahead of time (warmup.precompile), called directly by `run` and `decode`.
        self.compiled = programs.Programs("runner", owned=("cfg", "attn_impl", "use_plan", "mesh"))
        # A method's tap that plain ragged steps run through (`Retriever.tap_every_step`: one program for
        # its steps and the plain ones), or None.
        self.step_tap = None

    def greedy_program(self, temperature: np.ndarray) -> bool:
        """Whether a batch of these temperatures runs a greedy program (`greedy_programs`, no sampled row)."""
        return self.greedy_programs and not temperature.any()

    def _kw(self, greedy: bool) -> dict:
        return dict(cfg=self.cfg, attn_impl=self.attn_impl, use_plan=self.use_plan, greedy=bool(greedy),
                    mesh=self.mesh)

    def rolled(self, tokens: int) -> dict:
        """The static argument of a ragged step of `tokens` tokens that rolls its layers, else none (the
        ordinary step's program is unchanged)."""
        n = self.rolled_from_tokens
        return {"rolled": True} if n and tokens >= n else {}

    def run(self, batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns sampled tokens [S] and their logprobs [S] (host arrays)."""
        tokens, logprobs, _ = self.run_extras(batch)
        return tokens, logprobs

    def run_extras(self, batch: StepBatch, programs=None) -> tuple[np.ndarray, np.ndarray, dict]:
        """`run`, plus what the batch's logprob fields asked for (host arrays, `_extras`; empty when none);
        `programs` as `dispatch`."""
        return jax.device_get(self.dispatch(batch, programs))  # one sync (two fetches: ~1 ms more on an H200)

    def dispatch(self, batch: StepBatch, programs=None) -> tuple:
        """Runs one step without waiting for it: (tokens, logprobs, extras) on the device. `programs`:
        another owner's precompiled programs to look the step up in (default the runner's)."""
        if programs is None and self.step_tap is not None and self.step_tap.takes(batch):
            return (*self.step_tap.dispatch_step(batch), {})
        programs = self.compiled if programs is None else programs
        tokens, logprobs, extras, self.pool = programs.call(*self._step_call(batch))
        return tokens, logprobs, extras

    def decode(self, batch: DecodeBatch) -> PendingDecode:
        """Dispatches K decode steps and returns at once (nothing waits for the device). Every input goes
        up as a device array in one `device_put`: `tokens` may already be one (a previous call's `last`),
        and jit keeps numpy and device inputs as separate variants, so all calls must agree on one."""
        tokens, logprobs, ran, last, extras, self.pool = self.compiled.call(*self._decode_call(batch))
        return PendingDecode(tokens, logprobs, ran, last, top=extras.get("top"))

    def _step_call(self, batch: StepBatch):
        arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)
                  if f.name not in STEP_OPTIONS}
        prompt_lp = batch.prompt_next is not None
        if prompt_lp:
            arrays["prompt_next"] = batch.prompt_next
        if batch.from_layer:
            arrays.update(hidden=batch.hidden, hidden_rows=batch.hidden_rows, key_storage=batch.key_storage)
        fresh = self.fresh_heads if batch.fresh and self.use_plan else None
        step = _step_graphless if batch.tokens.shape[0] >= GRAPHLESS_TOKENS else _step
        # Ordinary steps pass neither: the same compiled variant as a server that never saw logprobs.
        extra = {**({"top_width": batch.top_width} if batch.top_width else {}),
                 **({"prompt_lp": True} if prompt_lp else {}), **self.rolled(batch.tokens.shape[0]),
                 **({"from_layer": batch.from_layer} if batch.from_layer else {})}
        return step, (self.params, self.pool, {**arrays, **self._heads}), dict(
            fresh_heads=fresh, **self._kw(self.greedy_program(batch.temperature)), **extra)

    def _decode_call(self, batch: DecodeBatch):
        arrays = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "top_width"}
        extra = {"top_width": batch.top_width} if batch.top_width else {}
        return _decode, (self.params, self.pool, jax.device_put({**arrays, **self._heads})), dict(
            **self._kw(self.greedy_program(batch.temperature)), **extra)

    def call(self, batch: StepBatch | DecodeBatch):
        """(signature, function, arguments, static arguments) of the program `run` / `decode` would call for
        `batch`, nothing traced (`warmup.precompile` lowers it, or loads it from the step cache)."""
        fn, args, static = (self._step_call if isinstance(batch, StepBatch) else self._decode_call)(batch)
        return self.compiled.signature(fn, args, static), fn, args, static


def _split_heads(sink: np.ndarray, window: np.ndarray, tp: int):
    """Per-shard static (sink, window) tuples per layer for head_class_prefill; one entry when all shards
    hold the same classes (no per-shard branch)."""
    per = sink.shape[1] // tp
    shards = tuple(tuple((tuple(int(x) for x in sk[s * per:(s + 1) * per]),
                          tuple(int(x) for x in wd[s * per:(s + 1) * per]))
                         for sk, wd in zip(sink, window)) for s in range(tp))
    return shards[:1] if all(sh == shards[0] for sh in shards) else shards
