"""Engine side of the retrieval policies (SpeContext, Quest): decode attention reads a per-head selection.

A request whose `kv_policy` is a `RetrievalPolicy` (engine-wide or per request) prefills with full
attention and keeps its full KV in the pool; each of its decode steps runs a separate jitted variant of the
multi-step decode (`_decode_retrieval`, a `lax.scan` over K steps like `runner._decode`) in which:

* **shared** policies (SpeContext): layers ``[0, tap_layer)`` run the normal paged attention; after them
  the policy scores every past position per KV head; `select` picks the top-B (plus forced tokens); every
  later layer gathers exactly those slots of its own (layer, KV head) page list from the pool and attends
  over them. The policy records the step's token in its state at ``key_layer`` (the tap itself, before
  scoring; deeper for a lagged SpeContext head, after the selection);
* **layer-wise** policies (Quest): in each layer from ``dense_layers`` on, the per-page key min/max of
  the head's page list is computed from the pool, the page upper bounds of the layer's query rank the
  pages, and attention runs over the top pages only.

Heads the head-class map makes local (sink + window rings) keep their ring attention; the selection
applies to the global heads (where a slot's storage index is its position).

Where the retrieval head's keys live: one device state per stateful policy class, ``[max_num_seqs,
max_pages_per_head * page_size, Hkv, Dr]`` keys (a row per running request, slot = position; a lagged head
adds each row's newest key-stream vector), made on first use. Rows are handed out on a request's first
step and taken back when it no longer runs. The ragged step (prefill chunks) runs `_step_tap` whenever a
chunk of a stateful retrieval request is in it: the same step as the runner's, plus the head's key write
at its key layer. A decode token of a retrieval
request that the scheduler put into a ragged step (next to other requests' prefill) is split off and run
through `_decode_retrieval` with K = 1, so every generated token after the first reads the selection.

Both forwards run the model's layer loop (`llama.run_layers`) in ranges split at their taps (the key write,
the selection); per-layer choices (windows, ring heads, the buffer's per-layer arrays) are data or ranges.
With `SharedLayers` the decode traces two layer bodies (dense, selected) instead of L layers: SmolLM2-135M
(30 layers, tap 2, K = 4, S = 4) on the CPU, trace 1.3 -> 0.43 s and lowering 0.54-0.85 -> 0.28-0.35 s (best
of 3, a shared host), a 4x smaller lowered program; the unrolled loop gives the same results bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.pool import write_kv
from jaxkv.engine import host_tier
from jaxkv.engine.host_tier import AVAILABLE as HOST_TIER_AVAILABLE
from jaxkv.engine.runner import PendingDecode, fresh_attend
from jaxkv.models import llama, rope
from jaxkv.policies.retrieve.base import RetrievalPolicy
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


def _buffer_view(buf, buf_rows, page_size):
    """The selection buffer as a page pool: page (row, KV head, j) holds slots j * page_size.. of that
    head's W slots (unordered; masked by stored position) -> (page_table [S, Hkv, W / page_size], slot
    positions [pages, page_size], lengths [S, Hkv]); the same for every buffered layer."""
    _, r, hkv, w, _ = buf.shape
    npg = w // page_size
    pid = (buf_rows[:, None, None] * hkv + jnp.arange(hkv)[None, :, None]) * npg + jnp.arange(npg)
    pt = jnp.where(buf_rows[:, None, None] >= 0, pid, -1).astype(jnp.int32)
    return pt, buf.pos.reshape(r * hkv * npg, page_size), jnp.full((buf_rows.shape[0], hkv), w, jnp.int32)


def _buffer_attention(q, buf, layer, buf_rows, q_seq, positions, *, page_size, window, scale, attn_impl,
                      plan=None):
    """One decode query per row over the selection buffer of buffered layer `layer` -> (out, lse), read in
    place (`_buffer_view`; the layer's own arrays, so no slice operand for XLA to copy). The paged kernel
    reads bf16 K/V with fp32 accumulation (the jnp twin elsewhere, fp32). With `plan` (the step's
    `paged_attention_plan` of the buffer, shared by every buffered layer of this window) the kernel runs
    without re-planning per layer."""
    d = buf.shape[-1]
    pt, slot_pos, lengths = _buffer_view(buf, buf_rows, page_size)
    k_pages, v_pages = buf.k[layer].reshape(-1, page_size, d), buf.v[layer].reshape(-1, page_size, d)
    if plan is not None:
        return paged_attention_with_plan(plan, q, k_pages, v_pages, slot_pos, pt, scale=scale)
    hkv = pt.shape[1]
    return paged_attention(q, k_pages, v_pages, slot_pos, pt, lengths, q_seq, positions,
                           jnp.zeros((hkv,), jnp.int32), jnp.full((hkv,), window, jnp.int32), scale=scale,
                           implementation=attn_impl)


def _buffer_plan(buf, buf_rows, q_seq, positions, *, page_size, window, num_q_heads):
    pt, slot_pos, lengths = _buffer_view(buf, buf_rows, page_size)
    hkv = pt.shape[1]
    return paged_attention_plan(slot_pos, pt, lengths, q_seq, positions, jnp.zeros((hkv,), jnp.int32),
                                jnp.full((hkv,), window, jnp.int32), num_q_heads=num_q_heads, ordered=False)


def _refresh(buf, pool, host, page_table, buf_rows, now, live, positions, start, *, page_size, chunk,
             load_kv: bool = True, overlap: int = 0):
    """Brings the buffer rows of the step's sequences to the selection `now` less the current token (always
    its last entry; each layer adds it by the log-sum-exp): plans the diff and loads the lacking rows of
    every buffered layer, from the host mirror for positions written before the dispatch when `host` is
    given, else (and for positions written inside the dispatch) from the device pool. Returns (buf, per-row
    stats [S, 3]: slots selected, of them selected the step before, rows the host loads; rows moved [2]:
    host (padded to whole rounds of `chunk`), device (one round of every entry); pending: with `overlap`
    (> 0 rows, a host tier), the host rows of each buffered layer still to be written
    (`host_tier.start_loads`), else ())."""
    r = buf.pos.shape[0]
    br = jnp.maximum(buf_rows, 0)
    if not load_kv:  # in place (never with a host tier: Retriever refuses the pair)
        return *_track_inplace(buf, br, at=jnp.where(live, buf_rows, r), now=now, live=live,
                              positions=positions), ()
    pos, held, seen, need, dest = host_tier.plan_resident(buf.held[br], buf.seen[br], now.idx, now.count - 1,
                                                          positions)
    load = need & live[:, None, None]
    old = now.idx < start[:, None, None]
    load_rows = functools.partial(host_tier.load_rows, page_table=page_table, buf_rows=buf_rows, idx=now.idx,
                                  dest=dest, page_size=page_size, chunk=chunk)
    moved_host = moved_dev = jnp.int32(0)
    from_host = jnp.zeros_like(live, jnp.int32)
    pending = ()
    if host is not None:
        if overlap:
            buf, moved_host, pending = host_tier.start_loads(
                buf, host, page_table, buf_rows, now.idx, dest, load & old, page_size=page_size, chunk=chunk,
                first=overlap)
        else:
            buf, moved_host = load_rows(buf, host, load=load & old)
        from_host = jnp.sum(load & old, axis=(-2, -1))
        load = load & ~old
    buf, moved_dev = load_rows(buf, pool, load=load, chunk=None)
    at = jnp.where(live, buf_rows, r)
    buf = dataclasses.replace(buf, pos=buf.pos.at[at].set(pos, mode="drop"),
                              held=buf.held.at[at].set(held, mode="drop"),
                              seen=buf.seen.at[at].set(seen, mode="drop"))
    # The previous step's token was in its selection (forced) and is loaded now: held, for the overlap.
    last = jnp.take_along_axis(now.idx, jnp.maximum(now.count - 2, 0)[..., None], axis=-1)[..., 0]
    prev_tok = (now.count >= 2) & (last == positions[:, None] - 1)
    held = now.count - 1 - jnp.sum(need, -1) + prev_tok
    stats = jnp.stack([jnp.sum(now.count, -1), jnp.sum(held, -1), from_host], -1)
    return buf, stats.astype(jnp.int32), jnp.stack([moved_host, moved_dev]), pending


def _track_inplace(buf, br, at, now, live, positions):
    """In-place reads load nothing, so the buffer only remembers the last selection (ascending, -1 past it)
    for the overlap statistic: one binary search of the new selection in the old, no slot planning
    (`plan_resident`'s sorts and scatters cost 0.07-0.09 ms a step at batch 16 on an H200, for numbers
    only)."""
    big = jnp.iinfo(jnp.int32).max
    b = now.idx.shape[-1]
    n = now.count - 1
    sel = jnp.arange(b) < n[..., None]
    prev = buf.pos[br]
    w = prev.shape[-1]  # the buffer's width (>= b: the budget rounded to whole pages)
    prev = jnp.where(prev >= 0, prev, big)
    at_prev = jnp.minimum(host_tier._search(prev, now.idx), w - 1)
    hit = sel & (jnp.take_along_axis(prev, at_prev, -1) == now.idx)
    last = jnp.take_along_axis(now.idx, jnp.maximum(now.count - 2, 0)[..., None], axis=-1)[..., 0]
    prev_tok = (now.count >= 2) & (last == positions[:, None] - 1)
    held = jnp.sum(hit, -1) + prev_tok  # the previous token was the query then, never in the old selection
    cur = jnp.pad(jnp.where(sel, now.idx, -1)[..., :w], ((0, 0), (0, 0), (0, max(w - b, 0))),
                  constant_values=-1)
    buf = dataclasses.replace(buf, pos=buf.pos.at[at].set(cur, mode="drop"))
    zeros = jnp.zeros_like(live, jnp.int32)
    stats = jnp.stack([jnp.sum(now.count, -1), jnp.sum(held, -1), zeros], -1)
    return buf, stats.astype(jnp.int32), jnp.zeros((2,), jnp.int32)


def _selected_slots(page_table, idx, count, live, page_size: int):
    """In-place reads: the flat pool slots of the selection (less the current token, its last entry) in
    every layer from the tap on. page_table [S, Lsel, Hkv, P], idx [S, Hkv, B] positions -> (slots
    [Lsel, S, Hkv, B] (0 past the count), lengths [S, Hkv])."""
    n = jnp.where(live[:, None], count - 1, 0)
    ok = jnp.arange(idx.shape[-1]) < n[..., None]
    p = jnp.where(ok, idx, 0)
    s, hkv = idx.shape[:2]
    si = jnp.arange(s)[:, None, None]
    hi = jnp.arange(hkv)[None, :, None]
    pages = page_table[si, :, hi, p // page_size]                        # [S, Hkv, B, Lsel]
    slots = jnp.where(ok[..., None] & (pages >= 0), pages * page_size + (p % page_size)[..., None], 0)
    return jnp.moveaxis(slots, -1, 0).astype(jnp.int32), n.astype(jnp.int32)


def _sample(logits, b, greedy):
    from jaxkv.engine.runner import _sample as sample

    return sample(logits, b, greedy)


def _merge_own(out, lse, q, k, v, scale):
    from jaxkv.engine.runner import _merge_own as merge

    return merge(out, lse, q, k, v, scale)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "page_state", "attn_impl", "greedy",
                                             "fresh_heads", "mesh"),
                   donate_argnames=("pool", "rstate", "pstate"))
def _step_tap(params, pool, b, rstate, head, pstate, cfg, policy, page_state=None, attn_impl=None,
              greedy=False, fresh_heads=None, mesh=None):
    """The runner's ragged step (per layer write K/V then paged attention; a fresh prompt through
    head_class_prefill) plus the retrieval state's key write at the key layer of `policy` (None: no
    state) and, with `pstate`, every key written folded into that per-page state (`page_state`, the class
    a method declares as `RetrievalPolicy.page_state`). `mesh`: per shard
    (`jaxkv.parallel.methods.sharded_step_tap`)."""
    static = dict(cfg=cfg, policy=policy, page_state=page_state, attn_impl=attn_impl, greedy=greedy,
                  fresh_heads=fresh_heads)
    if mesh is not None:
        from jaxkv.parallel.methods import sharded_step_tap

        return sharded_step_tap(_step_tap_body, params, pool, b, rstate, head, pstate, mesh=mesh, **static)
    return _step_tap_body(params, pool, b, rstate, head, pstate, **static)


def _step_tap_body(params, pool, b, rstate, head, pstate, cfg, policy, page_state=None, attn_impl=None,
                   greedy=False, fresh_heads=None, tp=False):
    """`_step_tap` on one device, or on one shard with `tp` (the O / down projections all-reduced, the
    logits gathered; the retrieval state, replicated, is written alike on every shard)."""
    scale = cfg.head_dim ** -0.5
    freqs = rope.inv_freq(cfg)
    # where the state records tokens (never: the end of the loop)
    key_layer = min(policy.key_layer(head), cfg.num_layers) if policy is not None else cfg.num_layers
    rows = jnp.where(b["q_seq"] >= 0, b["head_rows"][jnp.maximum(b["q_seq"], 0)], -1)
    fresh = fresh_attend(fresh_heads, scale, tp=tp) if fresh_heads is not None else None

    def attend(layer, q, k, v, state):
        pool, pstate = state
        pool = write_kv(pool, k[0], v[0], b["positions"], b["slots"][:, layer])
        if pstate is not None:
            pstate = page_state.update(pstate, k[0], b["slots"][:, layer], pool.page_size)
        if fresh is not None:
            out = fresh(layer, q[0], k[0], v[0])
        else:
            out, _ = paged_attention(
                q[0], pool.k, pool.v, pool.pos, b["page_table"][:, layer], b["lengths"][:, layer],
                b["q_seq"], b["positions"], b["sink"][layer], b["window"][layer], scale=scale,
                implementation=attn_impl)
        return out[None], (pool, pstate)

    # The layer loop in two ranges around the tap (the state's key write before `key_layer`): with
    # `SharedLayers` both run the one traced layer body.
    x = params["embed"][b["tokens"]][None]
    pos = b["positions"][None]
    run = functools.partial(llama.run_layers, params["layers"], cfg, positions=pos, freqs=freqs,
                            attend=attend, reduce=_reduce(tp))
    x, (pool, pstate) = run(x=x, state=(pool, pstate), stop=key_layer)
    if key_layer < cfg.num_layers:
        rstate = policy.observe_tokens(head, rstate, x[0], b["positions"], rows)
    x, (pool, pstate) = run(x=x, state=(pool, pstate), start=key_layer)
    hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = _logits(params, cfg, hidden[0, b["logits_index"]], tp)
    tokens, logprobs = _sample(logits, b, greedy)
    return tokens, logprobs, pool, rstate, pstate


def _reduce(tp: bool):
    from jaxkv.parallel import shard

    return shard.reduce if tp else None


def _logits(params, cfg, hidden, tp: bool):
    from jaxkv.engine.runner import _logits as logits

    return logits(params, cfg, hidden, tp)


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
    rows = jnp.arange(s, dtype=jnp.int32)
    scale = cfg.head_dim ** -0.5
    freqs = rope.inv_freq(cfg)
    pt_all = d["page_table"]  # [S, L, Hkv, P]
    n_slots = pt_all.shape[-1] * pool.page_size
    shared = not policy.layer_wise
    # Shared policies defer the step's K/V writes to one scatter after the last layer (as the runner's
    # decode): every layer attends the pool as it was before the step and adds the token's own K/V by the
    # lse, so no layer needs it in the pool (the buffer never holds the current token). On the Pallas
    # path the buffer's attention plan is built once per step, not per layer.
    deferred = shared
    use_plan = attn_impl == "pallas" or (attn_impl is None and jax.default_backend() == "gpu")
    n_layers = cfg.num_layers
    first = min(policy.tap_layer(head), n_layers)
    key_layer = policy.key_layer(head) if shared else first  # > first: a lagged head records after selecting
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

    def body(carry, xs):
        (pool, pstate, sbuf), rstate, tok, done = carry
        k, slots, lengths, prev_lengths, active = xs
        live = active & ~done
        positions = d["positions"] + k
        q_seq = jnp.where(live, rows, -1)
        slots = jnp.where(live[:, None, None], slots, -1)
        pos2 = positions[:, None]
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

        def write(layer, kk, vv, pool, pstate, ks, vs):
            """The token's K/V: kept for the one scatter after the last layer (deferred) or written now."""
            if deferred:
                ks = ks.at[layer].set(kk[:, 0].astype(ks.dtype))
                vs = vs.at[layer].set(vv[:, 0].astype(vs.dtype))
            else:
                pool = write_kv(pool, kk[:, 0], vv[:, 0], positions, slots[:, layer])
            if pstate is not None:
                pstate = policy.page_state.update(pstate, kk[:, 0], slots[:, layer], pool.page_size)
            return pool, pstate, ks, vs

        def full_attention(layer, qq, own_k, own_v, pool):
            def full(now, before):
                """Paged attention over the pool (head lengths `now` with the token written; with deferred
                writes over the pool before the step, `before`, plus the token's own K/V by the lse)."""
                out, lse = paged_attention(qq, pool.k, pool.v, pool.pos, pt_all[:, layer],
                                           before if deferred else now, q_seq, positions, d["sink"][layer],
                                           d["window"][layer], scale=scale, implementation=attn_impl)
                return _merge_own(out, lse, qq, own_k, own_v, scale) if deferred else out
            return full

        def dense_attend(layer, q, kk, vv, state):
            """Layers before the tap: attention over the whole pool."""
            pool, pstate, sbuf, ks, vs = state
            own_k, own_v = kk[:, 0].astype(pool.k.dtype), vv[:, 0].astype(pool.v.dtype)
            pool, pstate, ks, vs = write(layer, kk, vv, pool, pstate, ks, vs)
            full = full_attention(layer, q[:, 0], own_k, own_v, pool)
            return full(lengths[:, layer], prev_lengths[:, layer])[:, None], (pool, pstate, sbuf, ks, vs)

        def select_attend(layer, q, kk, vv, state):
            """Layers from the tap on: attention over the selection (shared) or the layer's top pages
            (layer-wise); a shared policy's state pairs the common state with this layer's buffer item
            (k, v, pending host rows)."""
            if shared:
                (pool, pstate, sbuf, ks, vs), item = state
            else:
                pool, pstate, sbuf, ks, vs = state
            own_k, own_v = kk[:, 0].astype(pool.k.dtype), vv[:, 0].astype(pool.v.dtype)
            pool, pstate, ks, vs = write(layer, kk, vv, pool, pstate, ks, vs)
            qq = q[:, 0]
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
                out, lse = _buffer_attention(qq, one, 0, brows, q_seq, positions, page_size=pool.page_size,
                                             window=window, scale=scale, attn_impl=attn_impl,
                                             plan=plan_of(layer) if use_plan else None)
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
            state = (pool, pstate, sbuf, ks, vs)
            return out[:, None], ((state, item) if shared else state)

        def selection_plan(window):
            """The selection's attention plan for `window`, from the first selected layer with it."""
            j = cfg.layer_windows.index(window, first) - first
            if inplace:
                sel_slots, sel_len = tap["selected"]
                pos1 = pool.pos.reshape(-1, 1)
                return paged_attention_plan(pos1, sel_slots[j], sel_len, q_seq, positions,
                                            jnp.zeros((hkv,), jnp.int32), jnp.full((hkv,), window, jnp.int32),
                                            num_q_heads=cfg.num_heads, ordered=False)
            return _buffer_plan(sbuf, brows, q_seq, positions, page_size=pool.page_size, window=window,
                                num_q_heads=cfg.num_heads)

        def plan_of(layer):
            """The tap's attention plan of this layer's window (picked by index under a traced layer)."""
            plans = tap["plans"]
            if isinstance(layer, int) or len(plans) == 1:
                return plans[window_of(layer) if isinstance(layer, int) else sel_windows[0]]
            which = jnp.asarray([sel_windows.index(w) if i >= first else 0
                                 for i, w in enumerate(cfg.layer_windows)], jnp.int32)[layer]
            return jax.tree.map(lambda *a: jnp.stack(a)[which], *[plans[w] for w in sel_windows])

        # The layer loop (`llama.run_layers`: with `SharedLayers` one traced body per attend, called per
        # layer) in ranges around the taps: layers [0, first) dense; at `first` the selection (shared
        # policies); the retrieval state's key write before `key_layer` (first or deeper).
        x = params["embed"][tok][:, None]
        new = jnp.zeros((n_layers, s, hkv, cfg.head_dim), pool.k.dtype) if deferred else None
        state = (pool, pstate, sbuf, new, new)
        stats = jnp.zeros((s, 3), jnp.int32)
        moved = jnp.zeros((2,), jnp.int32)
        run = functools.partial(llama.run_layers, params["layers"], cfg, positions=pos2, freqs=freqs,
                                reduce=_reduce(tp))
        x, state = run(x=x, attend=dense_attend, state=state, stop=first)
        if shared and first < n_layers:
            pool, pstate, sbuf, ks, vs = state
            if key_layer == first:
                rstate = policy.observe_tokens(head, rstate, x[:, 0], positions, brows)
            scores = policy.score_rows(head, rstate, x, pos2, jnp.maximum(d["head_rows"], 0), n_slots)
            if tp:  # [S, Hkv, N] of every head (the state is replicated): this shard's heads
                from jaxkv.parallel.shard import own_heads
                scores = own_heads(scores, 1, hkv)
            now = policy.select(scores, positions)
            sbuf, stats, moved, pending = _refresh(
                sbuf, pool, host, pt_all[:, first:], brows, now, live, positions, d["positions"],
                page_size=pool.page_size, chunk=chunk, load_kv=not inplace, overlap=overlap)
            if inplace:
                tap["selected"] = _selected_slots(pt_all[:, first:], now.idx, now.count, live, pool.page_size)
            if use_plan:
                tap["plans"] = {w: selection_plan(w) for w in sel_windows}
            items = [(sbuf.k[j], sbuf.v[j], pending[j] if pending else None) for j in range(n_layers - first)]
            state = (pool, pstate, dataclasses.replace(sbuf, k=(), v=()), ks, vs)
            split = min(max(key_layer, first), n_layers)
            x, (state, head_items) = run(x=x, attend=select_attend, state=state, start=first, stop=split,
                                         per_layer=items[:split - first])
            if split > first and split < n_layers:  # a lagged head records the token deeper
                rstate = policy.observe_tokens(head, rstate, x[:, 0], positions, brows)
            x, (state, tail_items) = run(x=x, attend=select_attend, state=state, start=split,
                                         per_layer=items[split - first:])
            done_items = head_items + tail_items
            pool, pstate, sbuf, ks, vs = state
            sbuf = dataclasses.replace(sbuf, k=tuple(i[0] for i in done_items),
                                       v=tuple(i[1] for i in done_items))
            state = (pool, pstate, sbuf, ks, vs)
        elif not shared:
            x, state = run(x=x, attend=select_attend, state=state, start=first)
        pool, pstate, sbuf, ks, vs = state
        if deferred:  # every layer's K/V of the step in one scatter (layer-major rows)
            hk, dh = ks.shape[2], ks.shape[3]
            pool = write_kv(pool, ks.reshape(n_layers * s, hk, dh), vs.reshape(n_layers * s, hk, dh),
                            jnp.tile(positions, n_layers), slots.transpose(1, 0, 2).reshape(n_layers * s, hk))
        hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
        b = {"temperature": d["temperature"], "top_k": d["top_k"], "top_p": d["top_p"], "seeds": d["seeds"],
             "counters": d["counters"] + k}
        tokens, logprobs = _sample(_logits(params, cfg, hidden[:, 0], tp), b, greedy)
        stop = jnp.any(tokens[:, None] == d["stop_ids"], axis=-1)
        stats = jnp.where(live[:, None], stats, 0)
        carry = ((pool, pstate, sbuf), rstate, jnp.where(live, tokens, tok), done | (live & stop))
        return carry, (tokens, logprobs, live, stats, moved)

    carry = ((pool, pstate, sbuf), rstate, d["tokens"], jnp.zeros((s,), bool))
    steps = jnp.arange(d["slots"].shape[0], dtype=jnp.int32)
    xs = (steps, d["slots"], d["lengths"], d["prev_lengths"], d["active"])
    ((pool, pstate, sbuf), rstate, last, _), (tokens, logprobs, ran, stats, moved) = jax.lax.scan(
        body, carry, xs)
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


def _on_device(batch: dict) -> dict:
    """Every step input as a device array: the engine hands some fields over as device-resident metadata
    and some as numpy, and jit caches the two kinds as separate variants, so precompile and serving must
    agree on one. One `device_put` of the whole dict: one batched transfer, not one call per field."""
    return jax.device_put(batch)


def num_compilations() -> int:
    return _step_tap._cache_size() + _decode_retrieval._cache_size() + _decode_retrieval_overlap._cache_size()


# Buffer slots per selected slot with a host tier unless told otherwise: what left the selection stays until
# its slot is needed (H100, embedded model, batch 16: 11.1x fewer host bytes than re-fetching the selection;
# on an H200: 15.1x at 2 against 2.6x at 1, and 1,476 against 816 tok/s).
DEFAULT_HOST_RESIDENT = 2.0


class Retriever:
    """Host side: state rows, splitting steps, grouping decode rows by policy, selection statistics."""

    def __init__(self, engine, host_tier: bool = False, resident: float | None = None,
                 inplace: bool | None = None, overlap: bool = False, eager: bool = False):
        inplace = not host_tier if inplace is None else inplace
        if resident is None:  # the host tier's default: 2 (11-15x fewer host bytes than 1's 2.6x, and faster)
            resident = DEFAULT_HOST_RESIDENT if host_tier and not inplace else 1.0
        if not isinstance(resident, (int, float)) or isinstance(resident, bool) or not resident >= 1.0:
            raise ValueError("retrieval_resident is buffer slots per selected slot, a number >= 1; "
                             f"got {resident!r}")
        if inplace and host_tier:
            raise ValueError("retrieval_inplace reads the selection from the device pool; the host tier "
                             "needs the selection buffer (retrieval_host_tier=True, retrieval_inplace=False)")
        if inplace and resident != 1.0:
            raise ValueError("retrieval_resident sizes the selection buffer's K/V, which in-place reads do "
                             "not keep: use it with retrieval_host_tier=True (or retrieval_inplace=False)")
        if overlap and not host_tier:
            raise ValueError("retrieval_host_overlap overlaps the host tier's loads with the layers: it "
                             "needs retrieval_host_tier=True")
        self.overlap = bool(overlap)
        if eager and not host_tier:
            raise ValueError("retrieval_host_eager loads every step from the host tier: it needs "
                             "retrieval_host_tier=True")
        # The host tier loads from host memory only for dispatches with a request that has pages there
        # (the progressive offload's); until then the selection is read in place, as without a host tier.
        # `eager`: every dispatch loads its rows from the host mirror (to measure the tier's bytes).
        self.eager = bool(eager)
        self._offloaded: set = set()  # request ids with pages moved to host memory (`offload`)
        self.engine = engine
        self.resident = float(resident)
        self.inplace = bool(inplace)
        self._params: dict = {}  # policy class -> parameter pytree (e.g. the retrieval head)
        self._state: dict = {}  # policy class -> device state [rows, slots, ...] (None when stateless)
        self._rows: dict = {}  # request id -> state row
        self._page_states: dict = {}  # RetrievalPolicy.page_state class -> its state, made on first use
        self._buf: dict = {}  # shared policy -> host_tier.SelBuffer: each row's selected K/V of layers tap..
        self._owner: dict = {}  # (policy, row) -> request id whose selection the row's buffer holds
        if host_tier and not HOST_TIER_AVAILABLE:
            raise NotImplementedError("retrieval_host_tier needs jax.experimental.compute_on: the "
                                      "context form compute_on('device_host') or the keyword form "
                                      "(compute_type=, out_memory_spaces=); "
                                      f"jax {jax.__version__} has neither")
        if host_tier and engine.runner.mesh is not None:
            raise ValueError("retrieval_host_tier is not supported with tensor parallelism: its host mirror "
                             "of the pool and its loads are single-device")
        self.host_tier = host_tier
        self._host = None  # (k, v) host mirror of the pool's flat slots, made on first use with host_tier
        window = np.asarray(engine.runner._heads["window"])
        self.local_layers = tuple((layer, tuple(int(x) for x in window[layer]))
                                  for layer in range(window.shape[0]) if (window[layer] > 0).any())
        # Selection statistics of the shared policies since start (every step after a request's first).
        self.steps = 0  # decode steps that read a selection (per request)
        self.slots_selected = 0  # sum over those steps of selected slots, summed over KV heads
        self.slots_new = 0  # of those, slots not selected the step before (what the buffer's diff loads)
        # Host tier transfers over all selected steps (first ones included), in (sequence, KV head) rows
        # of every buffered layer: moved = load rounds x chunk (padding included), needed = rows the buffer
        # lacked, baseline = selected rows (re-fetching the selection every step).
        self.host_steps = 0
        self.pages_offloaded = 0  # device pages moved to host-only pages by `offload` since start
        self.offload_passes = 0  # calls of `offload` that moved something
        self.host_rows_moved = 0
        self.host_rows_needed = 0
        self.host_rows_baseline = 0

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

    def precompile(self, policy: RetrievalPolicy, progress: bool = True) -> int:
        """Compiles the retrieval variants an engine-wide `policy` hits (ragged steps with the tap, decode
        with K = decode_steps and K = 1) on all-padding batches (nothing is written); returns how many."""
        from tqdm.auto import tqdm

        from jaxkv.engine.warmup import STOP_BUCKET, stop_near_map_cap, variants

        eng, runner = self.engine, self.engine.runner
        cfg = runner.cfg
        L, H = cfg.num_layers, cfg.num_kv_heads
        head, state, pstate = self.params_for(policy), self._state_for(policy), self._page_state_for(policy)
        tap = state is not None or pstate is not None  # ragged steps run _step_tap
        todo = [v[:6] for v in variants(eng) if v[0] == "step"] if tap else []
        seen = set()
        for _, s, _, p, greedy, *_ in variants(eng):
            for k in sorted({eng.decode_steps, 1}):
                if (s, p, greedy, k) not in seen:
                    seen.add((s, p, greedy, k))
                    todo.append(("decode", s, k, p, greedy, False))
        done = 0
        for kind, s, t, p, greedy, fresh in tqdm(todo, desc="jaxkv: compiling retrieval variants",
                                                 disable=not progress):
            if stop_near_map_cap(done, len(todo)):
                break
            done += 1
            temp = np.zeros(s, np.float32)
            temp[0] = 0.0 if greedy else 1.0
            common = dict(page_table=np.full((s, L, H, p), -1, np.int32), temperature=temp,
                          top_k=np.zeros(s, np.int32), top_p=np.ones(s, np.float32),
                          seeds=np.zeros(s, np.uint32), counters=np.zeros(s, np.int32),
                          head_rows=np.full(s, -1, np.int32), **runner._heads)
            if kind == "step":
                b = dict(tokens=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
                         q_seq=np.full(t, -1, np.int32), slots=np.full((t, L, H), -1, np.int32),
                         lengths=np.zeros((s, L, H), np.int32), logits_index=np.zeros(s, np.int32), **common)
                stateful = policy if state is not None else None
                _, _, runner.pool, state_out, pstate_out = _step_tap(
                    runner.params, runner.pool, _on_device(b), self._state.get(type(policy)),
                    head if stateful else None, self._page_states.get(policy.page_state), cfg=cfg,
                    policy=stateful, page_state=policy.page_state, attn_impl=runner.attn_impl, greedy=greedy,
                    fresh_heads=runner.fresh_heads if fresh and runner.use_plan else None, mesh=runner.mesh)
                if state_out is not None:
                    self._state[type(policy)] = state_out
                if pstate_out is not None:
                    self._page_states[policy.page_state] = pstate_out
            else:
                d = dict(tokens=np.zeros(s, np.int32), positions=np.zeros(s, np.int32),
                         slots=np.full((t, s, L, H), -1, np.int32), lengths=np.zeros((t, s, L, H), np.int32),
                         prev_lengths=np.zeros((t, s, L, H), np.int32), active=np.zeros((t, s), bool),
                         stop_ids=np.full((s, STOP_BUCKET), -1, np.int32), known=np.zeros(s, bool), **common)
                for inplace in self._decode_variants(policy):
                    *_, runner.pool, state_out, pstate_out, sbuf = self._decode_fn(inplace)(
                        runner.params, runner.pool, _on_device(d), self._state.get(type(policy)), head,
                        self._page_states.get(policy.page_state), self._buffer_for(policy),
                        None if inplace else self._host_for(policy), cfg=cfg, policy=policy,
                        attn_impl=runner.attn_impl, greedy=greedy, local_layers=self.local_layers,
                        chunk=self._chunk(policy, s), inplace=inplace, overlap=0 if inplace else
                        self._overlap_rows(policy, s), mesh=runner.mesh)
                    if sbuf is not None:
                        self._buf[policy] = sbuf
                    if state_out is not None:
                        self._state[type(policy)] = state_out
                    if pstate_out is not None:
                        self._page_states[policy.page_state] = pstate_out
        return done

    def _state_for(self, policy: RetrievalPolicy):
        key = type(policy)
        if key not in self._state:
            eng = self.engine
            slots = eng.max_pages_per_head * eng.page_size
            self._state[key] = policy.init_state(self.params_for(policy), eng.scheduler.max_num_seqs, slots)
        return self._state[key]

    def _buffer_for(self, policy: RetrievalPolicy):
        """The selection buffer of a shared policy (None for layer-wise ones): Lsel x [rows, Hkv, W, D] with
        W = `resident` x the budget rounded up to whole pages (the buffer is read as a page pool)."""
        if policy.layer_wise:
            return None
        if policy not in self._buf:
            eng, cfg = self.engine, self.engine.runner.cfg
            lsel = cfg.num_layers - policy.tap_layer(self.params_for(policy))
            width = -(-int(np.ceil(self.resident * policy.budget)) // eng.page_size) * eng.page_size
            dim = 0 if self.inplace else cfg.head_dim   # in place: the buffer keeps positions only
            self._buf[policy] = host_tier.init_buffer(lsel, eng.scheduler.max_num_seqs, cfg.num_kv_heads,
                                                      width, dim, eng.runner.pool.k.dtype)
        return self._buf[policy]

    def _host_for(self, policy: RetrievalPolicy):
        """The pool's host mirror (k, v) [(num_pages + host_pages) * page_size, D] when the host tier serves
        `policy` (host-only pages after the device ones: the offload's)."""
        if not self.host_tier or policy.layer_wise:
            return None
        if self._host is None:  # device pages, then the host-only pages (allocator.host_pages) after them
            pool = self.engine.runner.pool
            d = pool.k.shape[-1]
            extra = getattr(self.engine.allocator, "host_pages", 0) * self.engine.page_size
            if extra:  # made in host memory, then the pool's slots copied in (no device-side padding)
                slots = pool.k.size // d
                blank = np.zeros((slots + extra, d), pool.k.dtype)
                host = [jax.device_put(blank, host_tier.host_sharding()) for _ in range(2)]
                every = jnp.arange(slots, dtype=jnp.int32)
                self._host = host_tier.mirror_slots(*host, pool.k, pool.v, every)
            else:
                self._host = tuple(host_tier.to_host(x.reshape(-1, d)) for x in (pool.k, pool.v))
        return self._host

    def offload(self, need: int) -> int:
        """Progressive offload (SpeContext Alg. 1/2, adapted): frees up to `need` device pages by moving
        pages of running shared-retrieval requests to host-only pages (allocator.host_pages), the global
        heads of the layers the selection serves, deepest layer first, oldest pages first; only pages of
        positions every dispatched call has long finished writing (the host mirror holds them). Those heads
        are read only through the selection buffer, whose loads of positions before a dispatch come from the
        mirror through the page table; dense layers, ring heads and the page being written stay on the
        device. Nothing moves back. Returns the device pages freed."""
        eng = self.engine
        alloc, tables, ps = eng.allocator, eng.tables, eng.page_size
        if not self.host_tier or need <= 0 or alloc.num_free_host == 0:
            return 0
        # A decoding request's slots not yet dispatched are at most one call's (decode_steps), one more call
        # may be in flight, and the page being written stays: positions before num_computed - margin are
        # written and mirrored by calls dispatched before this one.
        margin = 2 * eng.decode_steps + ps
        per_layer: dict[int, list] = {}  # layer -> [(request id, flat lh [n], j [n])]
        glob = ~tables.local  # [L, H]
        L, H = tables.num_layers, tables.num_kv_heads
        for req in eng.scheduler.running:
            pol = req.kv_policy
            if not is_retrieval(req) or pol.layer_wise or req.num_computed <= len(req.prompt_ids):
                continue
            first = pol.tap_layer(self.params_for(pol))
            self._host_for(pol)
            safe = max(0, (req.num_computed - margin) // ps)  # pages [0, safe): positions long dispatched
            if safe == 0:
                continue
            table = tables._get(req.request_id).table  # [L, H, cap]
            for layer in range(L - 1, first - 1, -1):
                h, j = np.nonzero(glob[layer][:, None] & (table[layer, :, :safe] >= 0)
                                  & (table[layer, :, :safe] < alloc.num_pages))
                order = np.lexsort((h, j))  # oldest pages first, over the layer's heads
                h, j = h[order], j[order]
                if h.size:
                    per_layer.setdefault(layer, []).append((req.request_id, layer * H + h, j))
        freed, moves = 0, []
        for layer in sorted(per_layer, reverse=True):
            for rid, lh, j in per_layer[layer]:
                n = min(lh.size, need - freed, alloc.num_free_host)
                if n <= 0:
                    break
                lh, j = lh[:n], j[:n]
                seq = tables._get(rid)
                old = seq.table.reshape(L * H, -1)[lh, j]
                keep = alloc.refcount(old) == 1  # a shared page stays where it is
                lh, j, old = lh[keep], j[keep], old[keep]
                if not old.size:
                    continue
                new = alloc.allocate_host(old.size)
                moves.append((old, new))
                self._offloaded.add(rid)
                tables.replace_pages(rid, lh, j, new)
                alloc.decref(old)   # reused only by later dispatches, which the copy below precedes
                freed += int(old.size)
                self.pages_offloaded += int(old.size)
        if moves:   # one host copy for the whole pass
            self.offload_passes += 1
            rows = np.arange(ps, dtype=np.int32)
            old, new = (np.concatenate(x) for x in zip(*moves))
            src = (old[:, None] * ps + rows).reshape(-1)
            # Power-of-two row counts: a few compiled copies, not one per page count (padding: dropped).
            size = 1 << max(6, int(src.size - 1).bit_length())
            dst = np.full(size, self._host[0].shape[0], np.int32)
            dst[:src.size] = (new[:, None] * ps + rows).reshape(-1)
            src = jnp.asarray(np.pad(src, (0, size - src.size)))
            self._host = host_tier.move_host_rows(*self._host, src, jnp.asarray(dst))
        return freed

    def _mirror(self, slots) -> None:
        """Copies the pool slots a retrieval call just wrote into the host mirror (when there is one)."""
        if self._host is not None:
            pool = self.engine.runner.pool
            self._host = host_tier.mirror_slots(*self._host, pool.k, pool.v, jnp.asarray(slots))

    def _chunk(self, policy: RetrievalPolicy, num_seqs: int) -> int:
        """Rows per host load round of the buffer's diff (static): a fraction of the batch's selection."""
        return max(1, num_seqs * self.engine.runner.cfg.num_kv_heads * policy.budget // host_tier.HOST_SPLIT)

    def _overlap_rows(self, policy: RetrievalPolicy, num_seqs: int) -> int:
        """Host rows per step gathered per layer beside the layers before it (0: no overlap): the first
        `host_tier.OVERLAP_ROUNDS` rounds; a step whose diff is larger loads the rest as before."""
        if not (self.overlap and self.host_tier) or policy.layer_wise:
            return 0
        return host_tier.OVERLAP_ROUNDS * self._chunk(policy, num_seqs)

    def _reads_in_place(self, policy: RetrievalPolicy, chunks) -> bool:
        """Whether a shared decode of `chunks` reads the selection in the pool: always with
        `retrieval_inplace`; with a lazy host tier while none of them has pages in host memory. The buffer
        stays valid meanwhile: a slot's K/V never change, and a request's row is emptied when it starts."""
        if policy.layer_wise or not self.host_tier:
            return self.inplace
        return not self.eager and not any(c.request.request_id in self._offloaded for c in chunks)

    def _decode_variants(self, policy: RetrievalPolicy) -> list[bool]:
        """The decode variants (in place or not) `policy`'s dispatches can take: a lazy host tier takes the
        host-loading one only after an offload, so only where host pages exist (precompiling it makes the
        mirror, which is then kept up to date on every call)."""
        if policy.layer_wise or not self.host_tier:
            return [self.inplace]
        if self.eager:
            return [False]
        return [True, False] if getattr(self.engine.allocator, "host_pages", 0) else [True]

    def _decode_fn(self, inplace: bool):
        return _decode_retrieval_overlap if self.overlap and not inplace else _decode_retrieval

    def transfer(self) -> dict:
        """Host tier bytes per decode step and sequence: moved by the diff loads (padding included), the
        rows the buffer lacked, and re-fetching the selection every step (the no-diff baseline)."""
        cfg = self.engine.runner.cfg
        policy = next(iter(self._buf), None)
        if policy is None or not self.host_steps:
            return {}
        lsel = cfg.num_layers - policy.tap_layer(self.params_for(policy))
        per_row = host_tier.transfer_bytes(1, lsel, cfg.head_dim, self.engine.runner.pool.k.dtype.itemsize)
        steps = self.host_steps
        return {"host_steps": steps, "h2d_bytes_per_step": self.host_rows_moved * per_row / steps,
                "h2d_bytes_needed_per_step": self.host_rows_needed * per_row / steps,
                "h2d_bytes_refetch_per_step": self.host_rows_baseline * per_row / steps,
                "h2d_ratio": self.host_rows_baseline / max(self.host_rows_moved, 1)}

    def _row(self, req) -> int:
        rid = req.request_id
        if rid not in self._rows:
            running = {r.request_id for r in self.engine.scheduler.running}
            for other in [o for o in self._rows if o not in running]:
                del self._rows[other]
            self._offloaded &= running
            used = set(self._rows.values())
            self._rows[rid] = next(i for i in range(self.engine.scheduler.max_num_seqs) if i not in used)
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
        if dec:
            t, lp, _ = self.decode([chunks[i] for i in dec], steps=1).result()
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
        pstate = self._page_state_for(paged[page_cls]) if page_cls is not None else None
        (key, policy), = stateful.items() if stateful else [(None, None)]
        rows = np.full(b.temperature.shape[0], -1, np.int32)
        for row, c in enumerate(chunks):
            if is_retrieval(c.request) and type(c.request.kv_policy) is key:
                rows[row] = self._row(c.request)
        # The logprob extras never reach a retrieval step (requests that ask for them run apart), so the
        # step's inputs are those precompile warmed.
        skip = ("fresh", "top_width", "prompt_next")
        arrays = {f: getattr(b, f) for f in b.__dataclass_fields__ if f not in skip}
        fresh = runner.fresh_heads if b.fresh and runner.use_plan else None
        tokens, logprobs, runner.pool, state, pstate = _step_tap(
            runner.params, runner.pool, _on_device({**arrays, **runner._heads, "head_rows": rows}),
            self._state.get(key),
            self.params_for(policy) if policy is not None else None, pstate, cfg=runner.cfg, policy=policy,
            page_state=page_cls, attn_impl=runner.attn_impl, greedy=not b.temperature.any(),
            fresh_heads=fresh, mesh=runner.mesh)
        self._mirror(b.slots)
        if key is not None:
            self._state[key] = state
        if pstate is not None:
            self._page_states[page_cls] = pstate
        return jax.device_get((tokens, logprobs))  # one sync for both

    # ---- decode -----------------------------------------------------------------------------------
    def decode(self, chunks, steps: int | None = None, prev=None) -> PendingDecode:
        """Dispatches decode chunks grouped by policy (no policy: the runner's decode); the results are
        [K, >= len(chunks)]. K is the engine's `decode_steps` (one compiled shape), or `steps` (1 for decode
        tokens split off a ragged step). `prev` (engine `_build_decode`) chains the call to the one before.
        One policy: one call, returned without waiting. Several: one call each, gathered on the host."""
        eng = self.engine
        k = steps or eng.decode_steps
        groups: dict = {}
        for i, c in enumerate(chunks):
            groups.setdefault(c.request.kv_policy if is_retrieval(c.request) else None, []).append(i)
        if len(groups) == 1:
            return self._dispatch(next(iter(groups)), chunks, eng._build_decode(chunks, prev), k)
        tokens = np.zeros((k, len(chunks)), np.int32)
        logprobs = np.zeros((k, len(chunks)), np.float32)
        ran = np.zeros((k, len(chunks)), bool)
        top = None  # the alternatives of requests that asked for them (never retrieval requests)
        for policy, idx in groups.items():
            sub = [chunks[i] for i in idx]
            pending = self._dispatch(policy, sub, eng._build_decode(sub), k)
            t, lp, r = pending.result()
            n = len(sub)
            tokens[:, idx], logprobs[:, idx], ran[:, idx] = t[:, :n], lp[:, :n], r[:, :n]
            alts = pending.top_result()
            if alts is not None:
                if top is None:
                    top = tuple(np.zeros((k, len(chunks), a.shape[-1]), a.dtype) for a in alts)
                top[0][:, idx], top[1][:, idx] = alts[0][:, :n], alts[1][:, :n]
        return PendingDecode(tokens, logprobs, ran, None, top=top)

    def _dispatch(self, policy, chunks, b, k: int) -> PendingDecode:
        for f in ("slots", "lengths", "prev_lengths", "active"):
            setattr(b, f, getattr(b, f)[:k])
        return self.engine.runner.decode(b) if policy is None else self._decode(policy, chunks, b)

    def _decode(self, policy, chunks, b) -> PendingDecode:
        runner = self.engine.runner
        head = self.params_for(policy)
        state = self._state_for(policy)
        rows = np.full(b.tokens.shape[0], -1, np.int32)
        if state is not None or not policy.layer_wise:
            for row, c in enumerate(chunks):
                rows[row] = self._row(c.request)
        known = np.array([row < len(chunks) and rows[row] >= 0 and self._owner.get(
            (policy, int(rows[row]))) == chunks[row].request.request_id for row in range(len(rows))])
        arrays = {f: getattr(b, f) for f in b.__dataclass_fields__ if f != "top_width"}  # never asked here
        arrays.update(head_rows=rows, known=known)
        inplace = self._reads_in_place(policy, chunks)
        decode = self._decode_fn(inplace)
        tokens, logprobs, ran, last, stats, moved, runner.pool, state, pstate, sbuf = decode(
            runner.params, runner.pool, _on_device({**arrays, **runner._heads}), state, head,
            self._page_state_for(policy), self._buffer_for(policy),
            None if inplace else self._host_for(policy),
            cfg=runner.cfg, policy=policy, attn_impl=runner.attn_impl, greedy=not b.temperature.any(),
            local_layers=self.local_layers, chunk=self._chunk(policy, len(rows)), inplace=inplace,
            overlap=0 if inplace else self._overlap_rows(policy, len(rows)), mesh=runner.mesh)
        self._mirror(b.slots)
        if state is not None:
            self._state[type(policy)] = state
        if pstate is not None:
            self._page_states[policy.page_state] = pstate
        if sbuf is None:
            return PendingDecode(tokens, logprobs, ran, last)
        self._buf[policy] = sbuf
        for row, c in enumerate(chunks):  # the rows' buffers hold these requests' selections from now on
            self._owner[(policy, int(rows[row]))] = c.request.request_id

        def count(ran_host):
            self._count(chunks, known, ran_host, np.asarray(stats), np.asarray(moved),
                        host=self.host_tier and not inplace)

        return PendingDecode(tokens, logprobs, ran, last, on_result=count)

    def _count(self, chunks, known, ran, stats, moved, host: bool) -> None:
        """Records the selection / transfer statistics of a shared decode."""
        n = len(chunks)
        later = ran.copy()
        for row in range(n):  # a request's first selected step has no previous selection
            if not known[row]:
                later[np.argmax(ran[:, row]), row] = False
        self.steps += int(later.sum())
        self.slots_selected += int(stats[..., 0][later].sum())
        self.slots_new += int((stats[..., 0] - stats[..., 1])[later].sum())
        if host:
            self.host_steps += int(ran.sum())
            self.host_rows_moved += int(moved[:, 0].sum())
            self.host_rows_needed += int(stats[..., 2].sum())
            self.host_rows_baseline += int(stats[..., 0].sum())
