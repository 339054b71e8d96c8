"""Engine side of the retrieval policies: decode attention reads a per-head selection.

A request whose `kv_policy` declares ``kind = "retrieval"`` (engine-wide or per request) prefills with full
attention and keeps its full KV in the pool; each of its decode steps runs a separate jitted variant of the
multi-step decode (`_decode_retrieval`, a loop over K steps like `runner._decode`) in which:

* **shared** policies (``layer_wise`` False, e.g. SpeContext): layers ``[0, tap_layer)`` run the normal
  paged attention; after them the policy scores every past position per KV head (`score_rows`); `select`
  picks the top-B (plus forced tokens); every later layer reads exactly those slots of its own (layer, KV
  head) page list, in place in the pool or through the selection buffer (`jaxkv.policies.retrieve.buffer`).
  The policy records the step's token in its state at ``key_layer`` (the tap itself, before scoring;
  deeper for a method that keys a deeper stream, after the selection);
* **layer-wise** policies (``layer_wise`` True, e.g. Quest): in each layer from ``tap_layer`` on, the
  policy's `read_pages` picks the pages of each head's page list from the layer's query and the per-page
  state it declares (``page_state``, kept here beside the pool and updated at every K write), and
  attention runs over those pages only.

The methods' state lives with them: their device state rows (`init_state`), per-page state (`page_state`),
and the shared methods' selection buffer, host mirror and offload (`SelectionBuffers`). This module holds
the plumbing: state rows, the forwards, splitting steps and grouping decode rows by policy.

Heads the head-class map makes local (sink + window rings) keep their ring attention; the selection
applies to the global heads (where a slot's storage index is its position).

Where a method's device state lives: one per stateful policy class (`init_state`, e.g. a retrieval
head's keys ``[max_num_seqs, max_pages_per_head * page_size, Hkv, Dr]``, a row per running request, slot =
position), made on first use. Rows are handed out on a request's first step and taken back when it no
longer runs. The ragged step (prefill chunks) runs `_step_tap` whenever a chunk of a request with a
device state or a per-page state is in it: the runner's step itself (`runner._forward_sample`) with the
tap's hooks (`runner.StepHooks`): the state's write at its key layer (`observe_tokens`) and the per-page
state's update at every K write. A decode token of a retrieval request that the scheduler put into a
ragged step (next to other requests' prefill) is split off and run through `_decode_retrieval`, whose
loop stops after that one step, so every generated token after the first reads the selection.

Each decode step is the runner's decode forward (`runner._decode_forward`, in the runner's step loop
`runner.decode_loop`) with the policy's `runner.DecodeHooks`: layers before the tap attend the whole pool
as every decode does (through the step's one attention plan on the Pallas path); at the tap the policy
scores, selects and refreshes its buffer; the layers from there attend through the policy's attention (the
selection, or its pages), with the buffer's per-layer arrays as the loop's per-layer items; a deeper key
stream is recorded where the loop is split for it. Per-layer choices (windows, ring heads) are data.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.engine import programs
from jaxkv.engine.runner import (
    GRAPHLESS_TOKENS,
    STEP_OPTIONS,
    DecodeHooks,
    PendingDecode,
    StepHooks,
    _decode_forward,
    _forward_sample,
    _merge_own,
    decode_loop,
)
from jaxkv.policies.retrieve import buffer, host_tier
from jaxkv.policies.retrieve.base import RetrievalPolicy
from jaxkv.policies.retrieve.buffer import SelectionBuffers
from pallas_kernels.paged_attention.api import (
    paged_attention,
    paged_attention_plan,
    paged_attention_with_plan,
)


def is_retrieval(req) -> bool:
    """Whether a request decodes through the retrieval seam (its policy's declared kind)."""
    return getattr(req.kv_policy, "kind", None) == "retrieval"


def gathered_attention(q, k, v, kpos, q_pos, *, window: int, scale: float):
    """One query per row over gathered slots: q [S, Hq, D], k/v [S, Hkv, N, D], kpos [S, Hkv, N] (-1 =
    empty), q_pos [S] -> out [S, Hq, D] (softmax in fp32; a row that sees nothing returns 0). `window`: a
    Python int, or a traced scalar (a shared layer body's window; 0 = whole history)."""
    s, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.astype(jnp.float32).reshape(s, hkv, hq // hkv, d)
    logits = jnp.einsum("shgd,shnd->shgn", qg, k.astype(jnp.float32)) * scale
    p = q_pos[:, None, None]
    vis = (kpos >= 0) & (kpos <= p)
    if not isinstance(window, int):
        vis &= (window == 0) | (kpos > p - window)
    elif window:
        vis &= kpos > p - window
    logits = jnp.where(vis[:, :, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(e, axis=-1, keepdims=True)
    v = jnp.where(vis[..., None], v.astype(jnp.float32), 0.0)  # stale / free slots never reach the output
    out = jnp.einsum("shgn,shnd->shgd", e / jnp.where(den > 0, den, 1.0), v)
    return out.reshape(s, hq, d).astype(q.dtype)


def _read_pages(pool, pages, keep):
    """The K/V of the pages a layer-wise method picked: pages [S, Hkv, n] ids, keep [S, Hkv, n, ps] ->
    (k, v [S, Hkv, n * ps, D], kpos [S, Hkv, n * ps], -1 where not kept)."""
    s, hkv = pages.shape[:2]
    d = pool.k.shape[-1]
    k = pool.k[pages].reshape(s, hkv, -1, d)
    v = pool.v[pages].reshape(s, hkv, -1, d)
    kpos = jnp.where(keep, pool.pos[pages], -1).reshape(s, hkv, -1)
    return k, v, kpos


def _step_tap_fn(params, pool, b, rstate, head, pstate, cfg, policy, page_state=None, attn_impl=None,
                 use_plan=False, greedy=False, fresh_heads=None, mesh=None, rolled=False):
    """The runner's ragged step (`runner._forward_sample`: per layer write K/V then attend, through the
    step's one attention plan; a fresh prompt through head_class_prefill) with the tap's hooks: the
    retrieval state's key write before the key layer of `policy` (None: no state) and, with `pstate`,
    every key written folded into that per-page state (`page_state`, the class a method declares as
    `RetrievalPolicy.page_state`). `mesh`: per shard (`jaxkv.parallel.methods.sharded_step_tap`).
    `rolled`: the layers as one rolled loop (`EngineConfig.rolled_from_tokens`)."""
    static = dict(cfg=cfg, policy=policy, page_state=page_state, attn_impl=attn_impl, use_plan=use_plan,
                  greedy=greedy, fresh_heads=fresh_heads, rolled=rolled)
    if mesh is not None:
        from jaxkv.parallel.methods import sharded_step_tap

        return sharded_step_tap(_step_tap_body, params, pool, b, rstate, head, pstate, mesh=mesh, **static)
    return _step_tap_body(params, pool, b, rstate, head, pstate, **static)


_TAP_STATIC = dict(static_argnames=("cfg", "policy", "page_state", "attn_impl", "use_plan", "greedy",
                                    "fresh_heads", "mesh", "rolled"),
                   donate_argnames=("pool", "rstate", "pstate"))
_step_tap = jax.jit(_step_tap_fn, **_TAP_STATIC)
# Long steps without command buffers, as the runner's plain steps (`runner.GRAPHLESS_TOKENS`).
_step_tap_graphless = jax.jit(_step_tap_fn, **_TAP_STATIC,
                              compiler_options={"xla_gpu_enable_command_buffer": ""})
_step_tap_graphless.step_cache_name = "jaxkv.engine.retrieval._step_tap_graphless"


def _step_tap_body(params, pool, b, rstate, head, pstate, cfg, policy, page_state=None, attn_impl=None,
                   use_plan=False, greedy=False, fresh_heads=None, tp=False, rolled=False):
    """`_step_tap` on one device, or on one shard with `tp` (the O / down projections all-reduced, the
    logits gathered; the retrieval state, replicated, is written alike on every shard)."""
    rows = jnp.where(b["q_seq"] >= 0, b["head_rows"][jnp.maximum(b["q_seq"], 0)], -1)

    def on_write(layer, k, slots, pool, state):
        rstate, pstate = state
        return rstate, page_state.update(pstate, k, slots, pool.page_size)

    def tap(x, state):
        rstate, pstate = state
        return policy.observe_tokens(head, rstate, x, b["positions"], rows), pstate

    # where the state records tokens (never: past the last layer)
    key_layer = min(policy.key_layer(head), cfg.num_layers) if policy is not None else cfg.num_layers
    hooks = StepHooks(state=(rstate, pstate), on_write=on_write if pstate is not None else None,
                      tap=tap if policy is not None else None, tap_layer=key_layer)
    tokens, logprobs, _, pool, (rstate, pstate) = _forward_sample(
        params, pool, b, cfg, attn_impl, use_plan, greedy, fresh_heads, tp=tp, hooks=hooks, rolled=rolled)
    return tokens, logprobs, pool, rstate, pstate


def _decode_retrieval_fn(params, pool, d, rstate, head, pstate, sbuf, host, cfg, policy, attn_impl=None,
                         greedy=False, local_layers=(), chunk=1, inplace=False, overlap=0, mesh=None,
                         tp=False):
    """K decode steps in one lax.scan, attention over the policy's selection (module docstring) ->
    tokens, logprobs, ran [K, S], last [S] (each row's last sampled token), per-step stats [K, S, 3]
    (shared policies: slots selected, of them held by the buffer already, rows loaded from the host), rows
    moved per step [K, 2] (host, device), pool, rstate, pstate, sbuf.

    Shared policies keep the selection in `sbuf` (`host_tier.SelBuffer`, rows ``d["head_rows"]``; a row
    whose ``d["known"]`` is False starts empty) and load only its difference each step, `chunk` rows per
    round, from `host` (the pool's host mirror (k, v), for positions before the dispatch) or the pool.
    `inplace` (no host tier): no K/V is copied; every layer's attention reads the selected slots in the pool
    itself, viewed as pages of one slot (the buffer keeps only its position bookkeeping, for the stats).
    `overlap` (rows, with `host`): the first `overlap` host rows of a step are gathered per layer and written
    right before that layer's attention (`host_tier.start_loads`), so the gathers run beside the layers
    before theirs in the variant compiled with the latency-hiding scheduler (`_decode_retrieval_overlap`).
    `mesh`: per shard over its KV heads (`jaxkv.parallel.methods.sharded_retrieval_decode`, which calls this
    with `tp`): every shard scores every head alike and keeps its own heads' selection."""
    if mesh is not None:
        from jaxkv.parallel.methods import sharded_retrieval_decode

        return sharded_retrieval_decode(
            _decode_retrieval_fn, params, pool, d, rstate, head, pstate, sbuf, host, mesh=mesh, cfg=cfg,
            policy=policy, attn_impl=attn_impl, greedy=greedy, local_layers=local_layers, chunk=chunk,
            inplace=inplace, overlap=overlap)
    s = d["tokens"].shape[0]
    scale = cfg.head_dim ** -0.5
    pt_all = d["page_table"]  # [S, L, Hkv, P]
    n_slots = pt_all.shape[-1] * pool.page_size
    shared = not policy.layer_wise
    # Shared policies defer the step's K/V writes to one scatter after the last layer (as the runner's
    # decode): every layer attends the pool as it was before the step and adds the token's own K/V by the
    # lse, so no layer needs it in the pool (the buffer never holds the current token). On the Pallas path
    # the buffer's attention plan is built once per step, not per layer.
    use_plan = attn_impl == "pallas" or (attn_impl is None and jax.default_backend() == "gpu")
    n_layers = cfg.num_layers
    first = min(policy.tap_layer(head), n_layers)
    key_layer = policy.key_layer(head) if shared else first  # > first: keys a deeper stream, after selecting
    split = min(max(key_layer, first), n_layers)
    hkv = cfg.num_kv_heads
    # Per-layer differences as data: ring heads [L, Hkv], windows [L] (Python ints for a static layer).
    width = len(local_layers[0][1]) if local_layers else hkv  # every shard's heads
    local = np.zeros((n_layers, width), bool)
    for layer, w in local_layers:
        local[layer] = np.asarray(w) > 0
    local_arr, has_local = jnp.asarray(local), local.any(-1)
    if tp:
        from jaxkv.parallel.shard import own_heads
        local_arr = own_heads(local_arr, 1, hkv)
    any_local = bool(has_local[first:].any())
    sel_windows = list(dict.fromkeys(cfg.layer_windows[first:]))  # distinct windows, first use first

    def window_of(layer):
        if isinstance(layer, int):
            return cfg.layer_windows[layer]
        return jnp.asarray(cfg.layer_windows, jnp.int32)[layer]
    if shared:
        forget = jnp.where((d["head_rows"] >= 0) & ~d["known"], d["head_rows"], sbuf.pos.shape[0])
        sbuf = host_tier.forget_rows(sbuf, forget)

    def step(carry, b, live):
        """One decode step: the runner's decode forward (`runner._decode_forward`) with this policy's
        hooks from its tap layer on; the hooks' state is (pstate, sbuf, rstate, stats, moved)."""
        (pool, pstate, sbuf), rstate = carry
        positions, q_seq, lengths, prev_lengths = b["positions"], b["q_seq"], b["lengths"], b["prev_lengths"]
        brows = jnp.where(live, d["head_rows"], -1)
        # Built once per step at the tap (after the refresh): "plans" -> the selection's attention plan per
        # window of the layers from the tap on (every one of them reads the same slot positions),
        # "selected" -> the in-place reads' slot tables.
        tap = {}

        def ring_heads(layer, out, full):
            """Ring heads keep their sink + window attention (only they read the ring): a Python branch on
            a static layer, a `lax.cond` on the layer's flag under a traced one."""
            def merge(out):
                lm = local_arr[layer]
                ring = full(jnp.where(lm[None], lengths[:, layer], 0),
                            jnp.where(lm[None], prev_lengths[:, layer], 0))
                return jnp.where(jnp.repeat(lm, cfg.num_heads // hkv)[None, :, None], ring, out)

            if isinstance(layer, int):
                return merge(out) if has_local[layer] else out
            return jax.lax.cond(jnp.asarray(has_local)[layer], merge, lambda o: o, out)

        def full_attention(layer, qq, own_k, own_v, pool):
            def full(now, before):
                """Paged attention over the pool (head lengths `now` with the token written; with deferred
                writes over the pool before the step, `before`, plus the token's own K/V by the lse)."""
                out, lse = paged_attention(qq, pool.k, pool.v, pool.pos, pt_all[:, layer],
                                           before if shared else now, q_seq, positions, d["sink"][layer],
                                           d["window"][layer], scale=scale, implementation=attn_impl)
                return _merge_own(out, lse, qq, own_k, own_v, scale) if shared else out
            return full

        def on_write(layer, k, slots, pool, st):
            pstate, *rest = st
            return (policy.page_state.update(pstate, k, slots, pool.page_size), *rest)

        def selection_plan(window, pool, sbuf):
            """The selection's attention plan for `window`, from the first selected layer with it."""
            j = cfg.layer_windows.index(window, first) - first
            if inplace:
                sel_slots, sel_len = tap["selected"]
                pos1 = pool.pos.reshape(-1, 1)
                return paged_attention_plan(pos1, sel_slots[j], sel_len, q_seq, positions,
                                            jnp.zeros((hkv,), jnp.int32), jnp.full((hkv,), window, jnp.int32),
                                            num_q_heads=cfg.num_heads, ordered=False)
            return buffer.buffer_plan(sbuf, brows, q_seq, positions, page_size=pool.page_size,
                                      window=window, num_q_heads=cfg.num_heads)

        def plan_of(layer):
            """The tap's attention plan of this layer's window (picked by index under a traced layer)."""
            plans = tap["plans"]
            if isinstance(layer, int) or len(plans) == 1:
                return plans[window_of(layer) if isinstance(layer, int) else sel_windows[0]]
            which = jnp.asarray([sel_windows.index(w) if i >= first else 0
                                 for i, w in enumerate(cfg.layer_windows)], jnp.int32)[layer]
            return jax.tree.map(lambda *a: jnp.stack(a)[which], *[plans[w] for w in sel_windows])

        def select(x, pool, st):
            """At the tap (shared policies): the retrieval state's scores pick the selection, the buffer
            loads its difference; the buffer's per-layer K/V become the layers' items."""
            pstate, sbuf, rstate, stats, moved = st
            if not shared:
                return st, None
            if key_layer == first:
                rstate = policy.observe_tokens(head, rstate, x, positions, brows)
            scores = policy.score_rows(head, rstate, x[:, None], positions[:, None],
                                       jnp.maximum(d["head_rows"], 0), n_slots)
            if tp:  # [S, Hkv, N] of every head (the state is replicated): this shard's heads
                from jaxkv.parallel.shard import own_heads
                scores = own_heads(scores, 1, hkv)
            now = policy.select(scores, positions)
            sbuf, stats, moved, pending = buffer.refresh(
                sbuf, pool, host, pt_all[:, first:], brows, now, live, positions, d["positions"],
                page_size=pool.page_size, chunk=chunk, load_kv=not inplace, overlap=overlap)
            if inplace:
                tap["selected"] = buffer.selected_slots(pt_all[:, first:], now.idx, now.count, live,
                                                        pool.page_size)
            if use_plan:
                tap["plans"] = {w: selection_plan(w, pool, sbuf) for w in sel_windows}
            items = [(sbuf.k[j], sbuf.v[j], pending[j] if pending else None) for j in range(n_layers - first)]
            return (pstate, dataclasses.replace(sbuf, k=(), v=()), rstate, stats, moved), items

        def untap(st, items):
            pstate, sbuf, *rest = st
            return (pstate, dataclasses.replace(sbuf, k=tuple(i[0] for i in items),
                                                v=tuple(i[1] for i in items)), *rest)

        def observe(x, st):  # a deeper key stream records the token there
            pstate, sbuf, rstate, stats, moved = st
            return pstate, sbuf, policy.observe_tokens(head, rstate, x, positions, brows), stats, moved

        def attend(layer, qq, own_k, own_v, pool, st, item):
            """Layers from the tap on: attention over the selection (shared) or the layer's top pages
            (layer-wise); a shared policy's item is this layer's buffer (k, v, pending host rows)."""
            pstate, sbuf = st[0], st[1]
            own_k, own_v = own_k.astype(pool.k.dtype), own_v.astype(pool.v.dtype)
            window = window_of(layer)
            if shared and inplace:  # the selected slots read in the pool, then the token by the lse
                sel_slots, sel_len = tap["selected"]
                table = sel_slots[layer - first]
                d_ = pool.k.shape[-1]
                k1, v1, pos1 = pool.k.reshape(-1, 1, d_), pool.v.reshape(-1, 1, d_), pool.pos.reshape(-1, 1)
                zeros, win = jnp.zeros((hkv,), jnp.int32), jnp.full((hkv,), window, jnp.int32)
                if use_plan:
                    out, lse = paged_attention_with_plan(plan_of(layer), qq, k1, v1, pos1, table, scale=scale)
                else:
                    out, lse = paged_attention(qq, k1, v1, pos1, table, sel_len, q_seq, positions, zeros, win,
                                               scale=scale, implementation=attn_impl)
                out = _merge_own(out, lse, qq, own_k, own_v, scale)
            elif shared:  # attention over the buffer (the selection less the current token), then the token
                k_j, v_j, pending = item
                one = dataclasses.replace(sbuf, k=(k_j,), v=(v_j,))  # this layer's buffer as a one-layer one
                if pending is not None:  # this layer's overlapped host rows land now, right before its read
                    one = host_tier.finish_load(one, 0, pending)
                plan = plan_of(layer) if use_plan else None
                out, lse = buffer.buffer_attention(qq, one, 0, brows, q_seq, positions,
                                                   page_size=pool.page_size, window=window, scale=scale,
                                                   attn_impl=attn_impl, plan=plan)
                out = _merge_own(out, lse, qq, own_k, own_v, scale)
                item = (one.k[0], one.v[0], pending)
            else:
                pages, keep = policy.read_pages(pstate, pt_all[:, layer], lengths[:, layer], qq, positions,
                                                pool.page_size)
                kq, vq, kpos = _read_pages(pool, pages, keep)
                kpos = jnp.where(live[:, None, None], kpos, -1)
                out = gathered_attention(qq, kq, vq, kpos, positions, window=window, scale=scale)
            if any_local:
                out = ring_heads(layer, out, full_attention(layer, qq, own_k, own_v, pool))
            return out, st, item

        counts = (jnp.zeros((s, 3), jnp.int32), jnp.zeros((2,), jnp.int32))  # stats, moved
        hooks = DecodeHooks(state=(pstate, sbuf, rstate, *counts),
                            tap_layer=first, tap=select, attend=attend, untap=untap if shared else None,
                            observe=observe if shared else None, observe_layer=split,
                            on_write=on_write if pstate is not None else None, deferred=shared)
        tokens, logprobs, _, pool, (pstate, sbuf, rstate, stats, moved) = _decode_forward(
            params, pool, b, cfg, greedy, tp, attn_impl=attn_impl, use_plan=use_plan, hooks=hooks)
        stats = jnp.where(live[:, None], stats, 0)
        return ((pool, pstate, sbuf), rstate), tokens, logprobs, (stats, moved)

    # Stops at the first step no row runs: a decode token split off a ragged step (one step reserved) runs
    # through this program, not a one-step program of its own.
    ((pool, pstate, sbuf), rstate), last, (tokens, logprobs, ran, (stats, moved)) = decode_loop(
        d, ((pool, pstate, sbuf), rstate), step, while_live=True)
    return tokens, logprobs, ran, last, stats, moved, pool, rstate, pstate, sbuf


_DECODE_STATIC = ("cfg", "policy", "attn_impl", "greedy", "local_layers", "chunk", "inplace", "overlap",
                  "mesh", "tp")
_DECODE_DONATE = ("pool", "rstate", "pstate", "sbuf")
_decode_retrieval = jax.jit(_decode_retrieval_fn, static_argnames=_DECODE_STATIC,
                            donate_argnames=_DECODE_DONATE)
# The overlapped host tier's variant: XLA's default GPU schedule runs a host computation in stream order
# with the device's, never beside it; the latency-hiding scheduler runs it beside independent device work
# (H100, jax 0.11.2: a 67 MB host gather beside 30 ms of matmuls, 51 -> 32 ms).
_decode_retrieval_overlap = jax.jit(_decode_retrieval_fn, static_argnames=_DECODE_STATIC,
                                    donate_argnames=_DECODE_DONATE,
                                    compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True})
# Both wrap `_decode_retrieval_fn`: the step cache tells their programs apart by this name.
_decode_retrieval_overlap.step_cache_name = "jaxkv.engine.retrieval._decode_retrieval_overlap"


def _on_device(batch: dict) -> dict:
    """Every step input as a device array: the engine hands some fields over as device-resident metadata
    and some as numpy, and jit caches the two kinds as separate variants, so precompile and serving must
    agree on one. One `device_put` of the whole dict: one batched transfer, not one call per field."""
    return jax.device_put(batch)


def num_compilations() -> int:
    """Retrieval programs compiled so far: jit's own variants and those compiled ahead of time and installed
    (`Retriever.compiled`)."""
    jitted = (_step_tap, _step_tap_graphless, _decode_retrieval, _decode_retrieval_overlap)
    return sum(fn._cache_size() for fn in jitted) + programs.installed("retriever")


class Retriever:
    """Host side: state rows, the methods' device and per-page states, splitting steps, grouping decode rows
    by policy; the shared methods' buffers through `buffers` (`SelectionBuffers`)."""

    def __init__(self, engine, host_tier: bool = False, resident: float | None = None,
                 inplace: bool | None = None, overlap: bool = False, eager: bool = False,
                 max_rows: int | None = None):
        self.engine = engine
        self._params: dict = {}  # policy class -> parameter pytree (e.g. the retrieval head)
        self._state: dict = {}  # policy class -> device state [rows, slots, ...] (None when stateless)
        self._rows: dict = {}  # request id -> state row
        self._page_states: dict = {}  # RetrievalPolicy.page_state class -> its state, made on first use
        self._holds: dict = {}  # policy class -> whether its requests take a state row (`holds_row`)
        # State rows: requests holding one run at once (config.RetrievalConfig.max_seqs); the scheduler
        # admits no more (`admits`).
        self.max_rows = min(max_rows or engine.scheduler.max_num_seqs, engine.scheduler.max_num_seqs)
        engine.scheduler.admits = self.admits
        self.every_step = None  # the method whose tap every plain ragged step runs (`tap_every_step`)
        # Programs compiled ahead of time (warmup.precompile), called directly by the steps and decodes.
        self.compiled = programs.Programs("retriever", owned=("cfg", "attn_impl", "mesh", "local_layers"))
        # The shared methods' selection buffers, host mirror and offload, with their statistics.
        self.buffers = SelectionBuffers(engine, self.params_for, host_tier=host_tier, resident=resident,
                                        inplace=inplace, overlap=overlap, eager=eager)
        window = np.asarray(engine.runner._heads["window"])
        self.local_layers = tuple((layer, tuple(int(x) for x in window[layer]))
                                  for layer in range(window.shape[0]) if (window[layer] > 0).any())

    # ---- policies, params, state ------------------------------------------------------------------
    def params_for(self, policy: RetrievalPolicy):
        key = type(policy)
        if key not in self._params:
            head = policy.load_params(self.engine.model)
            perm = getattr(self.engine.model, "kv_head_perm", None)
            if perm is not None and head is not None:  # tensor parallel: the model's placed KV heads
                from jaxkv.parallel.methods import placed_retrieval_head

                head = placed_retrieval_head(head, perm, policy.tap_layer(head))
            self._params[key] = head
        return self._params[key]

    def programs(self, policy: RetrievalPolicy) -> list[tuple]:
        """(kind, S, T or K, P, greedy, fresh, inplace) of every retrieval program an engine-wide `policy`
        hits, nothing traced: ragged steps with the tap (every step variant, when the policy keeps a device
        or per-page state), and decodes of K = decode_steps for every (sequences, page-table width) bucket,
        per sampler form and decode variant (`SelectionBuffers.decode_variants`). Decode tokens split off a
        ragged step run one step of the same program (it stops at the first step no row reserved)."""
        from jaxkv.engine.warmup import sampler_forms, variants

        eng = self.engine
        todo = []
        if self._state_for(policy) is not None or policy.page_state is not None:
            todo += [("tap", *v[1:6], None) for v in variants(eng) if v[0] == "step"]
        inplaces = self.buffers.decode_variants(policy)
        todo += [("decode", s, k, p, greedy, False, inplace) for s in self.decode_seq_buckets(policy)
                 for p in eng._page_buckets for greedy in sampler_forms(eng)
                 for k in (eng.decode_steps,) for inplace in inplaces]
        return todo

    def decode_seq_buckets(self, policy: RetrievalPolicy) -> tuple:
        """Sequence buckets `policy`'s decodes hit: a method whose requests hold a state row decodes at most
        `max_rows` of them at once (the scheduler admits no more), so the buckets stop at the one holding
        them."""
        buckets = self.engine._seq_buckets
        if not self.holds_row(policy):
            return tuple(buckets)
        top = next(b for b in buckets if b >= self.max_rows)
        return tuple(b for b in buckets if b <= top)

    def calls(self, policy: RetrievalPolicy) -> list[tuple]:
        """(variant, call) of every program in `programs`; a call returns (signature, function, arguments,
        static arguments) on all-padding inputs (every slot -1: running one writes nothing), nothing traced:
        `warmup.precompile` lowers it on its thread, compiles it on the pool and installs it (`compiled`),
        or loads it from the step cache. The inputs are the ones serving passes (`_tap_call`,
        `_decode_call`), so serving finds the installed program."""
        from jaxkv.engine.warmup import STOP_BUCKET, _batch

        eng, runner = self.engine, self.engine.runner
        L, H = runner.cfg.num_layers, runner.cfg.num_kv_heads
        self._state_for(policy), self._page_state_for(policy)  # made before any call reads them
        # A decode batch's metadata is a small device program per (sequences, page-table width), which the
        # runner's decode variants warm only with decode_steps > 1.
        for s in self.decode_seq_buckets(policy):
            for p in eng._page_buckets:
                _batch(eng, "decode", s, 0, p, True, False)

        def call(kind, s, t, p, greedy, fresh, inplace):
            temp = np.zeros(s, np.float32)
            temp[0] = 0.0 if greedy else 1.0
            common = dict(page_table=np.full((s, L, H, p), -1, np.int32), temperature=temp,
                          top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
                          seeds=np.zeros(s, np.uint32), counters=np.zeros(s, np.int32))
            rows = np.full(s, -1, np.int32)
            if kind == "tap":  # the step's metadata as serving builds it (a small device program per shape)
                sb = _batch(eng, "step", s, t, p, greedy, fresh)
                b = {f: getattr(sb, f) for f in sb.__dataclass_fields__ if f not in STEP_OPTIONS}
                stateful = policy if self._state.get(type(policy)) is not None else None
                fn, args, static = self._tap_call(b, rows, stateful, policy.page_state, greedy, fresh)
            else:
                d = dict(tokens=np.zeros(s, np.int32), positions=np.zeros(s, np.int32),
                         slots=np.full((t, s, L, H), -1, np.int32), lengths=np.zeros((t, s, L, H), np.int32),
                         prev_lengths=np.zeros((t, s, L, H), np.int32), active=np.zeros((t, s), bool),
                         stop_ids=np.full((s, STOP_BUCKET), -1, np.int32), **common)
                fn, args, static = self._decode_call(policy, d, rows, np.zeros(s, bool), inplace, greedy)
            return self.compiled.signature(fn, args, static), fn, args, static

        return [(v, functools.partial(call, *v)) for v in self.programs(policy)]

    def precompile(self, policy: RetrievalPolicy, progress: bool = True) -> int:
        """Runs every program of `calls` in turn (each traced, compiled and run on its all-padding inputs);
        returns how many. `Engine.precompile` uses it only under tensor parallelism: elsewhere the programs
        compile on the warm-up pool with the step programs (`warmup.precompile`)."""
        from tqdm.auto import tqdm

        from jaxkv.engine.warmup import stop_near_map_cap

        todo = self.calls(policy)
        done = 0
        for (kind, *_), call in tqdm(todo, desc="jaxkv: compiling retrieval variants", disable=not progress):
            if stop_near_map_cap(done, len(todo)):
                break
            done += 1
            _, fn, args, static = call()
            out = self.compiled.call(fn, args, static)
            if kind == "tap":
                self._keep_tap(static["policy"], static["page_state"], out)
            else:
                self._keep_decode(policy, out)
                if out[-1] is not None:
                    self.buffers.keep(policy, out[-1])
        return done

    def tap_every_step(self, policy: RetrievalPolicy) -> bool:
        """Makes every plain ragged step run `policy`'s tap program, its rows holding no state row (so the
        tap writes nothing for them); returns whether it did: only a method that keeps a device state and no
        per-page state has such a program. With the method enabled for requests, its tap steps and the plain
        steps are then one program per shape, not two (precompile compiles the tap's alone)."""
        if self._state_for(policy) is None or policy.page_state is not None:
            return False
        self.every_step = policy
        self.engine.runner.step_tap = self
        return True

    def takes(self, batch) -> bool:
        """Whether the every-step tap runs this plain step: not when it asks logprob extras or starts past
        the first layer (those keep the runner's own programs)."""
        return not batch.top_width and batch.prompt_next is None and not batch.from_layer

    def dispatch_step(self, batch) -> tuple:
        """A plain step through the every-step tap (`tap_every_step`), not waited for: (tokens, logprobs)
        on the device."""
        return self._run_tap(batch, np.full(batch.temperature.shape[0], -1, np.int32), self.every_step, None)

    def _tap_call(self, arrays, rows, policy, page_cls, greedy, fresh):
        """(function, arguments, static arguments) of a ragged step with the tap: `policy` the stateful
        retrieval policy (None: no device state), `page_cls` the per-page state's class (or None)."""
        runner = self.engine.runner
        args = (runner.params, runner.pool, _on_device({**arrays, **runner._heads, "head_rows": rows}),
                self._state.get(type(policy)) if policy is not None else None,
                self.params_for(policy) if policy is not None else None,
                self._page_states.get(page_cls) if page_cls is not None else None)
        fresh_heads = runner.fresh_heads if fresh and runner.use_plan else None
        static = dict(cfg=runner.cfg, policy=policy, page_state=page_cls, attn_impl=runner.attn_impl,
                      use_plan=runner.use_plan, greedy=bool(greedy), fresh_heads=fresh_heads,
                      mesh=runner.mesh, **runner.rolled(arrays["tokens"].shape[0]))
        long = arrays["tokens"].shape[0] >= GRAPHLESS_TOKENS
        return (_step_tap_graphless if long else _step_tap), args, static

    def _decode_call(self, policy, arrays, rows, known, inplace, greedy):
        """(function, arguments, static arguments) of a retrieval decode of `policy` over `rows`."""
        runner = self.engine.runner
        s = len(rows)
        args = (runner.params, runner.pool,
                _on_device({**arrays, "head_rows": rows, "known": known, **runner._heads}),
                self._state_for(policy), self.params_for(policy), self._page_state_for(policy),
                self.buffers.buffer_for(policy), None if inplace else self.buffers.host_for(policy))
        static = dict(cfg=runner.cfg, policy=policy, attn_impl=runner.attn_impl, greedy=bool(greedy),
                      local_layers=self.local_layers, chunk=self.buffers.chunk(policy, s), inplace=inplace,
                      overlap=0 if inplace else self.buffers.overlap_rows(policy, s), mesh=runner.mesh)
        return self._decode_fn(inplace), args, static

    def _keep_tap(self, policy, page_cls, out):
        """Stores a ragged step's outputs (its inputs were donated): pool, device state, per-page state."""
        *_, self.engine.runner.pool, state, pstate = out
        if policy is not None and state is not None:
            self._state[type(policy)] = state
        if page_cls is not None and pstate is not None:
            self._page_states[page_cls] = pstate

    def _keep_decode(self, policy, out):
        """Stores a decode's outputs but the selection buffer (the caller keeps it with its rows)."""
        *_, self.engine.runner.pool, state, pstate, _ = out
        if state is not None:
            self._state[type(policy)] = state
        if pstate is not None:
            self._page_states[policy.page_state] = pstate

    def _state_for(self, policy: RetrievalPolicy):
        key = type(policy)
        if key not in self._state:
            eng = self.engine
            slots = eng.max_pages_per_head * eng.page_size
            self._state[key] = policy.init_state(self.params_for(policy), self.max_rows, slots)
        return self._state[key]

    def holds_row(self, policy) -> bool:
        """Whether a request of `policy` takes a state row while it runs: a device state, or a shared
        method's selection buffer."""
        key = type(policy)
        if key not in self._holds:
            self._holds[key] = self._state_for(policy) is not None or not policy.layer_wise
        return self._holds[key]

    def admits(self, req) -> bool:
        """The scheduler's admission hook: a request that takes a state row starts only while one is free
        (`max_rows` of them); others always."""
        if not is_retrieval(req) or not self.holds_row(req.kv_policy):
            return True
        return self.rows_in_use() < self.max_rows

    def rows_in_use(self) -> int:
        """State rows the running requests hold (`holds_row`)."""
        return sum(1 for r in self.engine.scheduler.running
                   if r.kv_policy is not None and is_retrieval(r) and self.holds_row(r.kv_policy))

    def _decode_fn(self, inplace: bool):
        return _decode_retrieval_overlap if self.buffers.overlap and not inplace else _decode_retrieval

    def _row(self, req) -> int:
        rid = req.request_id
        if rid not in self._rows:
            running = {r.request_id for r in self.engine.scheduler.running}
            for other in [o for o in self._rows if o not in running]:
                del self._rows[other]
            self.buffers.retain(running)
            used = set(self._rows.values())
            free = [i for i in range(self.max_rows) if i not in used]
            if not free:  # the scheduler admits no more than max_rows (`admits`); a request let in past it
                raise RuntimeError(f"retrieval: all {self.max_rows} state rows are taken; raise "
                                   f"retrieval_max_seqs (--retrieval-max-seqs) or run fewer such requests")
            self._rows[rid] = free[0]
        return self._rows[rid]

    def active(self, chunks) -> bool:
        return any(is_retrieval(c.request) for c in chunks)

    # ---- ragged steps -----------------------------------------------------------------------------
    def run(self, chunks) -> tuple[np.ndarray, np.ndarray]:
        """A ragged step with retrieval requests in it; tokens, logprobs aligned with `chunks`."""
        tokens = np.zeros(len(chunks), np.int32)
        logprobs = np.zeros(len(chunks), np.float32)
        dec = [i for i, c in enumerate(chunks) if is_retrieval(c.request) and c.samples and c.num_tokens == 1
               and c.start >= len(c.request.prompt_ids)]
        rest = [i for i in range(len(chunks)) if i not in dec]
        if rest:
            sub = [chunks[i] for i in rest]
            t, lp = self._ragged(sub)
            tokens[rest], logprobs[rest] = t[:len(sub)], lp[:len(sub)]
        if dec:  # one token each: the first step of a decode call (the rest stop at once)
            t, lp, _ = self.decode([chunks[i] for i in dec]).result()
            tokens[dec], logprobs[dec] = t[0, :len(dec)], lp[0, :len(dec)]
        return tokens, logprobs

    def _page_state_for(self, policy):
        """The per-page state `policy` declares (`RetrievalPolicy.page_state`), made on first use; else
        None."""
        cls = policy.page_state
        if cls is None:
            return None
        if cls not in self._page_states:
            pool = self.engine.runner.pool
            self._page_states[cls] = cls.init(pool.k.shape[0], pool.k.shape[-1], pool.k.dtype)
        return self._page_states[cls]

    def _ragged(self, chunks):
        eng, runner = self.engine, self.engine.runner
        b = eng._build_batch(chunks)
        pols = [c.request.kv_policy for c in chunks if is_retrieval(c.request)]
        stateful = {type(p): p for p in pols if self._state_for(p) is not None}
        paged = {p.page_state: p for p in pols if p.page_state is not None}
        if not stateful and not paged:
            return runner.run(b)
        if len(stateful) > 1 or len(paged) > 1:
            raise NotImplementedError("one stateful retrieval policy class per engine step")
        page_cls = next(iter(paged), None)
        if page_cls is not None:
            self._page_state_for(paged[page_cls])  # made on first use
        (key, policy), = stateful.items() if stateful else [(None, None)]
        rows = np.full(b.temperature.shape[0], -1, np.int32)
        for row, c in enumerate(chunks):
            if is_retrieval(c.request) and type(c.request.kv_policy) is key:
                rows[row] = self._row(c.request)
        # The logprob extras never reach a retrieval step (requests that ask for them run apart), so the
        # step's inputs are those precompile warmed.
        out = self._run_tap(b, rows, policy, page_cls)  # the pool first: the mirror reads the new one
        self.buffers.mirror(b.slots)
        return jax.device_get(out)  # one sync for tokens and logprobs

    def _run_tap(self, b, rows, policy, page_cls) -> tuple:
        """Dispatches step `b` with the tap of `policy` / `page_cls` over state `rows` and keeps the states
        it hands back; (tokens, logprobs) on the device, not waited for."""
        arrays = {f: getattr(b, f) for f in b.__dataclass_fields__ if f not in STEP_OPTIONS}
        greedy = self.engine.runner.greedy_program(b.temperature)
        out = self.compiled.call(*self._tap_call(arrays, rows, policy, page_cls, greedy, b.fresh))
        self._keep_tap(policy, page_cls, out)
        return out[0], out[1]

    # ---- decode -----------------------------------------------------------------------------------
    def decode(self, chunks, prev=None) -> PendingDecode:
        """Dispatches decode chunks grouped by policy (no policy: the runner's decode); the results are
        [K, >= len(chunks)], K the engine's `decode_steps` (one compiled shape; a chunk of n tokens runs
        its first n steps). `prev` (engine `_build_decode`) chains the call to the one before.
        One policy: one call, returned without waiting. Several: one call each, gathered on the host."""
        eng = self.engine
        k = eng.decode_steps
        groups: dict = {}
        for i, c in enumerate(chunks):
            groups.setdefault(c.request.kv_policy if is_retrieval(c.request) else None, []).append(i)
        if len(groups) == 1:
            return self._dispatch(next(iter(groups)), chunks, eng._build_decode(chunks, prev))
        tokens = np.zeros((k, len(chunks)), np.int32)
        logprobs = np.zeros((k, len(chunks)), np.float32)
        ran = np.zeros((k, len(chunks)), bool)
        top = None  # the alternatives of requests that asked for them (never retrieval requests)
        for policy, idx in groups.items():
            sub = [chunks[i] for i in idx]
            pending = self._dispatch(policy, sub, eng._build_decode(sub))
            t, lp, r = pending.result()
            n = len(sub)
            tokens[:, idx], logprobs[:, idx], ran[:, idx] = t[:, :n], lp[:, :n], r[:, :n]
            alts = pending.top_result()
            if alts is not None:
                if top is None:
                    top = tuple(np.zeros((k, len(chunks), a.shape[-1]), a.dtype) for a in alts)
                top[0][:, idx], top[1][:, idx] = alts[0][:, :n], alts[1][:, :n]
        return PendingDecode(tokens, logprobs, ran, None, top=top)

    def _dispatch(self, policy, chunks, b) -> PendingDecode:
        return self.engine.runner.decode(b) if policy is None else self._decode(policy, chunks, b)

    def _decode(self, policy, chunks, b) -> PendingDecode:
        state = self._state_for(policy)
        rows = np.full(b.tokens.shape[0], -1, np.int32)
        if state is not None or not policy.layer_wise:
            for row, c in enumerate(chunks):
                rows[row] = self._row(c.request)
        known = self.buffers.known(policy, rows, chunks)
        arrays = {f: getattr(b, f) for f in b.__dataclass_fields__ if f != "top_width"}  # never asked here
        inplace = self.buffers.reads_in_place(policy, chunks)
        greedy = self.engine.runner.greedy_program(b.temperature)
        out = self.compiled.call(*self._decode_call(policy, arrays, rows, known, inplace, greedy))
        tokens, logprobs, ran, last, stats, moved, *_, sbuf = out
        self._keep_decode(policy, out)  # the pool first: the mirror reads the new one
        self.buffers.mirror(b.slots)
        if sbuf is None:
            return PendingDecode(tokens, logprobs, ran, last)
        self.buffers.keep(policy, sbuf, rows, chunks)

        def count(ran_host):
            self.buffers.count(chunks, known, ran_host, np.asarray(stats), np.asarray(moved),
                               host=self.buffers.host_tier and not inplace)

        return PendingDecode(tokens, logprobs, ran, last, on_result=count)
