"""The jitted reuse prefill: copy + rotate segment pages, then a two-phase forward that recomputes what the
method asks for (the only caller of the `ReusePolicy` device hooks).

One call per request: (1) fresh pages get position -1 (holes stay invisible); (2) `rope_shift` copies every
reused page of every (layer, KV head) to the request's pages with its position delta, one fused pass;
(3) layers ``< full_layers`` run on every prompt token; (4) at layer ``full_layers`` the rows to recompute
are the forced tokens plus the method's top-k; (5) the remaining layers run on those rows only, writing
K/V per (row, head) as `head_writes` says, attention windowed per head where the method asks
(`local_windows`), and the FFN gathered onto the `ffn_rows` rows (capacity `ffn_capacity_rows`); (6) the
last prompt token's logits are sampled like an engine step. Attention is the engine's paged attention over
the request's page table (keys masked by their stored positions), so recomputed and reused K/V mix exactly
as a later decode sees them.

Layer groups (`layers=`, `layer_groups`): the same pass as several programs over layer ranges, each doing
(1) + (2) for its own layers' pages only, so a program depends on no later layer's promoted pages (the
engine promotes segments group by group beside them, jaxkv/engine/reuse.py). The first group holds the
dense phase and the selection layer; the carry between groups is the rows' hidden states, their indices
and selections, and the per-layer stats.

Phases (3) and (5) run through the model's layer loop (`llama.run_layers`): with `SharedLayers` one traced
layer body per phase, the sparse phase split where the method's static choices change
(`ReusePolicy.layer_breaks`); per-layer statistics are `[L]` arrays each layer writes at its index.
SmolLM2-135M (30 layers), a RedKnot request on the CPU: trace 2.8-3.3 -> 0.3-0.5 s, lowering 1.5-1.6 ->
0.25-0.35 s (best of 3), a 9x smaller lowered program. XLA still inlines a shared body once per layer, so a
method with a large layer body (`ReusePolicy.rolled_layers`: RedKnot's windowed attention per head-class
configuration, probe-mass loops, sorts) runs each range as one rolled loop (`llama.run_layers(rolled=True)`):
one compiled layer body whatever the layer count (SmolLM2 at 8K on an H100: compile 78.8 -> 10.9 s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv.cache.pool import KVPool, write_kv
from jaxkv.models import llama, rope
from jaxkv.policies.reuse.base import NEG, LayerView, ReusePolicy
from jaxkv.sampling import sample
from pallas_kernels.head_class_prefill.api import head_class_prefill
from pallas_kernels.paged_attention.api import paged_attention
from pallas_kernels.rope_shift.api import rope_shift
from pallas_kernels.rows_attention import rows_attention


def _dense_attend(q, pool: KVPool, page_table, lengths, positions, sink, window, scale):
    """One sequence's attention over its gathered page list (CPU path: the paged twin maps over queries).
    q [R, Hq, D]; page_table [H, P]; lengths [H]; positions [R] (-1 = padding row); sink / window [H]
    (window 0 = whole history, else sinks + the last `window` positions, as the paged kernel)
    -> [R, Hq, D]."""
    h, p = page_table.shape
    ps = pool.page_size
    pages = jnp.maximum(page_table, 0)
    k = pool.k[pages].reshape(h, p * ps, -1).astype(jnp.float32)
    v = pool.v[pages].reshape(h, p * ps, -1).astype(jnp.float32)
    kpos = jnp.where((page_table >= 0)[..., None], pool.pos[pages], -1).reshape(h, p * ps)
    kpos = jnp.where(jnp.arange(p * ps)[None] < lengths[:, None], kpos, -1)
    r, hq, d = q.shape
    qg = q.reshape(r, h, hq // h, d).astype(jnp.float32)
    logits = jnp.einsum("rhgd,hnd->hgrn", qg, k, precision=jax.lax.Precision.HIGHEST) * scale
    vis = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= positions[None, :, None])  # [H, R, N]
    kp, qp = kpos[:, None, :], positions[None, :, None]
    vis &= (window[:, None, None] == 0) | (kp > qp - window[:, None, None]) | (kp < sink[:, None, None])
    logits = jnp.where(vis[:, None], logits, NEG)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.where(vis[:, None], jnp.exp(logits - m), 0.0)
    probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("hgrn,hnd->rhgd", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(r, hq, d).astype(q.dtype)


def _top_rows(keep, priority, capacity: int, limit):
    """(indices, runs) of the `capacity` highest-`priority` rows of `keep`: a row runs when it is kept and
    among the first `limit` (data)."""
    score = jnp.where(keep, priority.astype(jnp.float32), NEG)
    val, idx = jax.lax.top_k(score, capacity)
    return idx, (val > NEG / 2) & (jnp.arange(capacity) < limit)


def _sparse_ffn(p, cfg, x, keep, priority, capacity: int, limit, reduce=lambda a: a):
    """FFN on at most `limit` (data, <= the static `capacity`) rows of `keep` (highest `priority` first),
    scatter-added back; the other rows pass through the residual. Gathering first is what makes a sparse
    FFN cheaper: masking after a dense FFN costs the dense FFN. Returns (x, rows run, kept rows dropped by
    the cap)."""
    idx, ran = _top_rows(keep, priority, capacity, limit)
    f = reduce(llama.ffn(p, cfg, x[idx]))
    x = x.at[idx].add(jnp.where(ran[:, None], f, 0).astype(x.dtype))
    n_ran = jnp.sum(ran)
    ran_rows = jnp.zeros(x.shape[0], bool).at[idx].set(ran)
    return x, n_ran, jnp.sum(keep) - n_ran, ran_rows


def _keys_seen(positions, sink, window):
    """Sum over the valid rows of the keys each may see (causal, mean over KV heads; a windowed head sees
    at most its sinks + window): the analytical attention work of the layer."""
    n = (positions + 1)[:, None]
    per = jnp.where(window[None] > 0, jnp.minimum(n, (sink + window)[None]), n)
    return jnp.sum(jnp.where(positions[:, None] >= 0, per, 0)) / window.shape[0]


def storage_slots(table, storage, ps: int):
    """Flat pool slots [T, L, H] of storage indices ``storage [T]`` (-1 stays -1) in ``table [L, H, P]``."""
    ok = storage >= 0
    s = jnp.where(ok, storage, 0)
    pages = jnp.take(table, s // ps, axis=2).transpose(2, 0, 1)  # [T, L, H]
    return jnp.where(ok[:, None, None] & (pages >= 0), pages * ps + (s % ps)[:, None, None], -1)


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "num_rows", "select_cap", "impl",
                                             "rows_are_tokens", "head_windows", "mesh", "layers",
                                             "select_only"),
                   donate_argnames=("pool",))
def reuse_prefill(params, pool: KVPool, b: dict, heads: dict, carry=None, offset=None, *, cfg,
                  policy: ReusePolicy, num_rows: int, select_cap: int, impl: str | None = None,
                  rows_are_tokens: bool = False, head_windows: tuple | None = None, mesh=None,
                  layers: tuple[int, int] | None = None, select_only: int = 0):
    """Returns (pool, token [1], logprob [1], logits [V], stats).

    `select_only` = N (> 0): the pass stops after (4) and returns (pool, hidden [N, hidden], alive [T],
    selected [T, Hkv or 1]): the residual stream entering layer `full_layers` of every token (zero rows past
    T), the rows the sparse phase would run and, per row, the heads it would write. The engine's steps run
    the sparse phase from there (jaxkv/engine/reuse_steps.py); N is one size per engine, so those steps
    read every request's stream from a buffer of one shape.

    `layers` = (l0, l1): only layers [l0, l1) of the pass (a layer group, see `layer_groups`): b's clear /
    src / dst / delta are then that group's pages, `carry` what the group before returned (None for the
    first); a group that does not end at the last layer returns (pool, carry) instead. `offset` (int32 []
    data): a middle group whose position is data, so equal-size groups share one compiled program:
    params["layers"] (`SharedLayers`) holds only its layers, `layers` = (0, their count), and layer j of
    them is layer offset + j of the model (`offset_group_ok` says where this applies).

    b: tokens, positions, is_new, forced, seg_offset [T] (positions -1 = padding); storage [T] (each token's
    storage slot, the same for every head, -1 = padding: slots [T, L, H] are gathered here from the page
    table, so the host never builds or uploads them); page_table [1, L, H, P]; lengths [1, L, H]; probe [Np]
    row indices (-1 pad); clear [C] pages to blank,
    src / dst / delta [M] page copies (-1 pad); last [] prompt length - 1; num_selected [] top-k size
    (<= select_cap); sampling rows [1]; optional ffn_cache [L, T, hidden] (RedKnot `ffn_reuse`: each reused
    token's FFN output from its segment's own prefill, zeros for new text). heads: is_global, sink, window
    [L, H] (the reuse head-class map).
    num_rows: static row bucket of the sparse phase (>= forced + selected); select_cap: static bucket of
    the top-k (the exact k is data, so prompts of one bucket share a compilation). rows_are_tokens: the
    sparse phase's rows are the prompt's tokens in order (the method forces every token, e.g. RedKnot).
    head_windows: per layer (sinks, windows) of the map as static tuples (None: no windowed flash path).
    mesh: tensor parallel over KV heads, the pass runs per shard (`jaxkv.parallel.methods.sharded_reuse`).
    """
    static = dict(cfg=cfg, policy=policy, num_rows=num_rows, select_cap=select_cap, impl=impl,
                  rows_are_tokens=rows_are_tokens, head_windows=head_windows)
    if select_only:
        if mesh is not None or layers is not None:
            raise ValueError("reuse pass: the selection alone runs on one device, as one program")
        return reuse_body(params, pool, b, heads, select_only=select_only, **static)
    if mesh is not None:
        # The layer-group split runs on one device only: under tensor parallelism the pass stays one program.
        if layers is not None and tuple(layers) != (0, cfg.num_layers):
            raise ValueError("a reuse pass in layer groups runs on one device (no tensor parallelism)")
        from jaxkv.parallel.methods import sharded_reuse

        return sharded_reuse(reuse_body, params, pool, b, heads, mesh=mesh, **static)
    return reuse_body(params, pool, b, heads, carry, layers=layers, offset=offset, **static)


def copy_pages(pool: KVPool, clear, src, dst, delta, freqs, impl=None) -> KVPool:
    """Blanks pages `clear`, then copies pages src -> dst rotating K by `delta` positions (every array [M],
    -1 pads): a reuse request's pages before anything attends to them."""
    n_pages = pool.pos.shape[0]
    pos = pool.pos.at[jnp.where(clear >= 0, clear, n_pages)].set(-1, mode="drop")
    k, v, pos = rope_shift(pool.k, pool.v, pos, src, dst, delta, jnp.asarray(freqs), style="neox",
                           implementation=impl)
    bias = pool.bias  # a merging engine's bias: copied pages start with none (written slots: write_kv)
    if bias is not None:
        bias = bias.at[jnp.where(dst >= 0, dst, n_pages)].set(0.0, mode="drop")
    return KVPool(k=k, v=v, pos=pos, page_size=pool.page_size, bias=bias)


def offset_group_ok(policy: ReusePolicy, params, b: dict) -> bool:
    """Whether a middle layer group may take its layer offset as data: the layers run through one shared
    body (their index is traced anyway), the method makes no static per-layer choice (`layer_breaks`, which
    its hooks read through `LayerView.span`) and no per-layer FFN cache is sliced by layer."""
    return (isinstance(params["layers"], llama.SharedLayers) and not policy.layer_breaks()
            and "ffn_cache" not in b)


def first_group_stop(policy: ReusePolicy, num_layers: int) -> int:
    """The fewest layers the first layer group may hold: the dense phase and, for a method that selects,
    layer `full_layers` too (its selection reads that layer's reused K/V)."""
    F = min(policy.full_layers, num_layers)
    return min(F + 1, num_layers) if policy.selects and F < num_layers else max(F, 1)


def layer_groups(policy: ReusePolicy, num_layers: int, groups: int) -> list[tuple[int, int]]:
    """Layer ranges [l0, l1) covering every layer in about `groups` equal parts; the first holds at least
    `first_group_stop` layers (boundaries inside it are dropped)."""
    groups = max(1, min(int(groups), num_layers))
    first = first_group_stop(policy, num_layers)
    cuts = [c for c in (round(g * num_layers / groups) for g in range(1, groups)) if c >= first]
    bounds = [0, *sorted(set(cuts)), num_layers]
    return list(zip(bounds[:-1], bounds[1:]))


def reuse_body(params, pool: KVPool, b: dict, heads: dict, carry=None, *, cfg, policy: ReusePolicy,
               num_rows: int, select_cap: int, impl: str | None = None, rows_are_tokens: bool = False,
               head_windows: tuple | None = None, tp=None, layers: tuple[int, int] | None = None,
               offset=None, select_only: int = 0):
    """`reuse_prefill` on one device, or on one shard with `tp` (jaxkv.parallel.methods.ReuseShard: the
    all-reduces after the O and down projections, page ids made local, and the hooks that look across
    heads (`score`, `ffn_rows`) handed every shard's heads). `layers`, `carry`, `offset`: one layer group of
    the pass (see `reuse_prefill`); the carry between groups is (rows' hidden states, row indices, rows'
    selection, per-layer stats)."""
    L, H = cfg.num_layers, cfg.num_kv_heads
    l0, l1 = (0, L) if layers is None else (int(layers[0]), int(layers[1]))
    last = l1 == L
    if offset is not None:  # params["layers"] holds this middle group's layers; [l0, l1) index them
        if carry is None or l0 != 0 or l1 != len(params["layers"]) or not offset_group_ok(policy, params, b):
            raise ValueError("reuse pass: a layer group with its offset as data is a middle group of shared "
                             "layers, given as its own layers, for a method without layer breaks")
        last = False
    elif not 0 <= l0 < l1 <= L or (l0 == 0) != (carry is None):
        raise ValueError(f"reuse pass: bad layer group [{l0}, {l1}) of {L} layers (the first group, and only "
                         "it, starts at layer 0 without a carry)")
    if carry is None and l1 < first_group_stop(policy, L):
        raise ValueError(f"reuse pass: the first layer group must hold at least "
                         f"{first_group_stop(policy, L)} layers (dense phase + selection layer)")
    reduce = (lambda a: a) if tp is None else tp.reduce
    tp_size = 1 if tp is None else tp.size
    scale = cfg.head_dim ** -0.5
    freqs = rope.inv_freq(cfg)
    zeros_h = jnp.zeros((H,), jnp.int32)
    n_pages, ps = pool.pos.shape
    b = {**b, "slots": storage_slots(b["page_table"][0], b["storage"], ps)}
    # Sparse rows over the whole history through `rows_attention`'s split where its kernels run (a GPU, or
    # interpret mode when the Pallas kernels are asked for); the CPU default keeps the paged twin.
    split_rows = impl == "pallas" or (impl is None and jax.default_backend() == "gpu")

    # (1) + (2): blank the request's fresh pages, then copy + rotate the reused ones (all layers, heads).
    clear = b["clear"]
    if tp is not None:  # page lists over every head: each shard copies and blanks its own pages only
        b = tp.own_pages(b, n_pages)
        clear = b["clear"]
    pool = copy_pages(pool, clear, b["src"], b["dst"], b["delta"], freqs, impl)

    def cached_kv(pool, slots):  # K/V the cache holds at `slots` [R, H] (zeros where -1)
        flat = jnp.maximum(slots, 0).reshape(-1)
        kc = pool.k.reshape(n_pages * ps, -1)[flat].reshape(*slots.shape, -1)
        vc = pool.v.reshape(n_pages * ps, -1)[flat].reshape(*slots.shape, -1)
        return kc, vc

    def attend(i, q, pool, positions, sink, window):
        """Paged attention of the rows over the request's pages. `ordered`: pages are in position order and
        every page starts with a real token (docs/policies.md, "Layout"), so the kernel reads only the pages
        up to each query block's last position (causal: half the pages of a prefill, which `ordered=False`
        scans in full) and, for windowed heads, only their sink and window pages."""
        if impl == "reference":
            return _dense_attend(q, pool, b["page_table"][0, i], b["lengths"][0, i], positions, sink, window,
                                 scale)
        q_seq = jnp.where(positions >= 0, 0, -1)
        out, _ = paged_attention(q, pool.k, pool.v, pool.pos, b["page_table"][:, i], b["lengths"][:, i],
                                 q_seq, jnp.maximum(positions, 0), sink, window, scale=scale,
                                 implementation=impl, ordered=True)
        return out

    def attend_rows(i, q, pool, positions):
        """Rows at scattered ascending positions, every head over its whole history (SparseX, CacheBlend):
        this layer's K/V gathered into contiguous [T, Hkv, D] (key t at position t) and `rows_attention`'s
        split: cuDNN flash over each row chunk's keys before it, the paged kernel on the short diagonal
        (H200, 8B shape, 5.2K rows over 33K keys: 8.9 -> ~3 ms a layer; docs/kernels.md)."""
        kc, vc = cached_kv(pool, b["slots"][:, i])
        ok = (b["slots"][:, i] >= 0)[..., None]          # padding tokens: zeros, past every row's position
        k, v = (jnp.where(ok, a, 0).astype(q.dtype) for a in (kc, vc))
        return rows_attention(q, k, v, positions, scale=scale, implementation="split",
                              diagonal_impl="pallas" if impl == "pallas" else None)[0]

    def attend_tokens(i, q, pool, positions, sink, window, windowed: bool):
        """Rows are the prompt's tokens in order (positions 0..T-1): this layer's K/V, reused or recomputed,
        gathered into contiguous [T, Hkv, D] and attended with the fresh-prefill kernel (cuDNN / Mosaic flash
        on a GPU; ~3x the paged kernel's prefill mode at 32K on an H200) when every head attends to its
        whole history, or when the heads' windows are the map's (no local head promoted in this layer: the
        kernel's own sink + window heads); any other mix (some local heads promoted) takes the paged path.
        `windowed` (static): this layer's windows may be non-zero; else the full-history kernel, no switch."""
        if impl == "reference":
            return attend(i, q, pool, positions, sink, window)

        def flash(sinks, windows):
            kc, vc = cached_kv(pool, b["slots"][:, i])
            ok = (b["slots"][:, i] >= 0)[..., None]      # padding rows: zeros, never a freed slot's NaN
            k, v = (jnp.where(ok, a, 0).astype(q.dtype) for a in (kc, vc))
            return head_class_prefill(q, k, v, sinks, windows, scale=scale)[0].astype(q.dtype)

        if not windowed:
            return flash((0,) * H, (0,) * H)
        branches = [lambda: flash((0,) * H, (0,) * H), lambda: attend(i, q, pool, positions, sink, window)]
        which = jnp.where(jnp.all(window == 0), 0, 1)
        if head_windows is not None and isinstance(i, int) and any(head_windows[i][1]):
            map_sink, map_window = head_windows[i]
            branches.append(lambda: flash(map_sink, map_window))
            as_map = jnp.all(window == jnp.asarray(map_window)) & jnp.all(sink == jnp.asarray(map_sink))
            which = jnp.where(as_map & ~jnp.all(window == 0), 2, which)
        elif head_windows is not None and not isinstance(i, int):
            # a traced layer (shared body): one flash branch per distinct windowed (sinks, windows) of the map
            configs = list(dict.fromkeys(hw for hw in head_windows if any(hw[1])))
            for c in configs:
                branches.append(functools.partial(flash, *c))
            if configs:
                index = jnp.asarray([configs.index(hw) if hw in configs else -1 for hw in head_windows])[i]
                map_sink = jnp.asarray([hw[0] for hw in head_windows], jnp.int32)[i]
                map_window = jnp.asarray([hw[1] for hw in head_windows], jnp.int32)[i]
                as_map = (index >= 0) & jnp.all(window == map_window) & jnp.all(sink == map_sink)
                which = jnp.where(as_map & ~jnp.all(window == 0), 2 + index, which)
        return jax.lax.switch(which, branches)

    def layer_step(p, i, x, rows, pool, writes_mask, want_view=False, selected=None, tokens=False, span=None):
        """One layer (parameters `p`, index `i`: a Python int, or traced in a shared body serving layers
        `span`) over rows: returns x, pool, stats. `rows` = dict of per-row arrays."""
        span = (i, i + 1) if isinstance(i, int) else span
        positions = rows["positions"]
        q, kf, vf = llama._qkv(p, cfg, llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)[None],
                               jnp.maximum(positions, 0)[None], freqs)
        q, kf, vf = q[0], kf[0], vf[0]
        slots = rows["slots"][:, i]
        view = None
        if want_view:
            kc, vc = cached_kv(pool, slots)
            view = LayerView(q=q, k=kf, v=vf, k_cached=kc, v_cached=vc, positions=positions,
                             is_new=rows["is_new"], forced=rows["forced"], seg_offset=rows["seg_offset"],
                             probe=rows["probe"], is_global=heads["is_global"][i], sink=heads["sink"][i],
                             window=heads["window"][i], layer=i, span=span)
        sink, window = zeros_h, zeros_h
        if writes_mask is None:
            w = (positions >= 0)[:, None] & jnp.ones((1, H), bool)
            promoted = jnp.zeros((H,), bool)
        else:
            w = policy.head_writes(view, selected)
            promoted = policy.head_promote(view)
            if promoted is None:
                promoted = jnp.zeros((H,), bool)
            w = w | ((positions >= 0)[:, None] & promoted[None])
            if policy.local_windows:  # unpromoted local heads attend to their sinks + window only
                local = ~view.is_global & ~promoted
                sink, window = jnp.where(local, view.sink, 0), jnp.where(local, view.window, 0)
        pool = write_kv(pool, kf, vf, positions, jnp.where(w, slots, -1))
        windowed = writes_mask is not None and policy.local_windows
        if tokens:
            out = attend_tokens(i, q, pool, positions, sink, window, windowed=windowed)
        elif split_rows and not windowed:
            out = attend_rows(i, q, pool, positions)
        else:
            out = attend(i, q, pool, positions, sink, window)
        out = reduce(out.reshape(out.shape[0], -1) @ p["wo"])
        x = x + (out + p["bo"] if cfg.o_bias else out)
        valid = positions >= 0
        ffn = None
        if view is not None:
            def mass_after_writes():   # [Hkv, R] probe mass over the keys after this layer's writes
                kc_after, _ = cached_kv(pool, slots)
                mass = view.probe_sum(lambda probs, _: jnp.sum(probs, axis=(1, 2)), kc_after)
                return mass if tp is None else tp.heads(mass, 0)
            ffn = policy.ffn_rows(view if tp is None else tp.view(view), mass_after_writes)
        cap = policy.ffn_capacity_rows(x.shape[0])  # the buffer: a share of the bucket's rows
        limit = policy.ffn_capacity_rows(jnp.sum(valid).astype(jnp.int32))  # the same share of the prompt's
        if ffn is None:
            x = x + jnp.where(valid[:, None], reduce(llama.ffn(p, cfg, x)), 0).astype(x.dtype)
            ran, dropped = jnp.sum(valid), jnp.int32(0)
        else:
            keep = ffn[0] & valid
            every = ffn[2] if len(ffn) > 2 else None  # data: this layer runs the FFN on every valid row
            if cap >= x.shape[0]:
                idx, runs = _top_rows(keep, ffn[1], x.shape[0], limit)
                fm = jnp.zeros_like(keep).at[idx].set(runs)
                fm = fm if every is None else jnp.where(every, valid, fm)
                x = x + jnp.where(fm[:, None], reduce(llama.ffn(p, cfg, x)), 0).astype(x.dtype)
                ran, dropped = jnp.sum(fm), jnp.sum(keep & ~fm)
            elif every is None:
                x, ran, dropped, fm = _sparse_ffn(p, cfg, x, keep, ffn[1], cap, limit, reduce)
            else:
                def all_rows(x):
                    out = x + jnp.where(valid[:, None], reduce(llama.ffn(p, cfg, x)), 0).astype(x.dtype)
                    return out, jnp.sum(valid), jnp.int32(0), valid

                x, ran, dropped, fm = jax.lax.cond(
                    every, all_rows, lambda x: _sparse_ffn(p, cfg, x, keep, ffn[1], cap, limit, reduce), x)
            if "ffn_cached" in rows:  # FFN reuse: skipped reused rows add their segment's own FFN output
                skipped = valid & ~fm & ~rows["is_new"]
                x = x + jnp.where(skipped[:, None], rows["ffn_cached"][i - ffn_from], 0).astype(x.dtype)
        stats = (reduce(jnp.sum(w)), jnp.sum(valid), ran, reduce(jnp.sum(promoted)), dropped,
                 reduce(_keys_seen(positions, sink, window)) / tp_size)
        return x, pool, stats, view

    def phase(rows, writes_mask, span, **kw):
        """`layer_step` as a `llama.run_layers` layer over `rows` (state: pool, per-layer stats [L] each):
        with `SharedLayers` one traced body per phase range `span`."""
        def layer(p, cfg_, i, x, positions_, freqs_, attend_, state, reduce_=None):
            pool, stats = state
            i = i if offset is None else i + offset  # the model's layer index (data for such a group)
            x, pool, st, _ = layer_step(p, i, x, rows, pool, writes_mask, span=span, **kw)
            return x, (pool, tuple(a.at[i].set(v.astype(a.dtype)) for a, v in zip(stats, st)))

        return layer

    def run_phase(x, pool, stats, rows, start, stop, writes_mask, **kw):
        span = (start, stop) if offset is None else None  # a data offset: no static span to give hooks
        return llama.run_layers(params["layers"], cfg, x, rows["positions"], freqs, None, (pool, stats),
                                start=start, stop=stop, layer=phase(rows, writes_mask, span, **kw),
                                rolled=policy.rolled_layers)

    T = b["tokens"].shape[0]
    valid = b["positions"] >= 0
    forced = b["forced"] & valid
    F = min(policy.full_layers, L)
    if carry is None:
        all_rows = {k_: b[k_] for k_ in ("positions", "slots", "is_new", "forced", "seg_offset", "probe")}
        x = params["embed"][b["tokens"]]
        # per-layer stats, written by each layer: kv_writes, query_rows, ffn_rows, promoted_heads, ffn_dropped
        # (int32) and keys_seen (float32)
        stats = tuple(jnp.zeros((L,), jnp.int32) for _ in range(5)) + (jnp.zeros((L,), jnp.float32),)
        x, (pool, stats) = run_phase(x, pool, stats, all_rows, 0, F, None, tokens=True)  # (3) dense phase

        # (4) selection at layer F.
        selected = jnp.ones((T, H), bool)
        if F < L and policy.selects and select_cap > 0:
            p = llama.layer_params(params, F)
            q, kf, vf = llama._qkv(p, cfg, llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)[None],
                                   jnp.maximum(b["positions"], 0)[None], freqs)
            kc, vc = cached_kv(pool, b["slots"][:, F])
            view = LayerView(q=q[0], k=kf[0], v=vf[0], k_cached=kc, v_cached=vc, positions=b["positions"],
                             is_new=b["is_new"], forced=forced, seg_offset=b["seg_offset"], probe=b["probe"],
                             is_global=heads["is_global"][F], sink=heads["sink"][F],
                             window=heads["window"][F], layer=F, method=b.get("method", 0))
            sc = policy.score(view if tp is None else tp.view(view)).astype(jnp.float32)
            sc2 = sc if sc.ndim == 2 else sc[:, None]
            cand = valid & ~forced
            sc2 = jnp.where(cand[:, None], sc2, NEG)
            val, idx = jax.lax.top_k(sc2.T, min(select_cap, T))  # [H', cap], descending: first k = the top-k
            take = (val > NEG / 2) & (jnp.arange(val.shape[1])[None] < b["num_selected"])
            hsel = jnp.zeros(sc2.shape[::-1], bool).at[jnp.arange(sc2.shape[1])[:, None], idx].set(take).T
            alive = forced | jnp.any(hsel, axis=1)
            selected = forced[:, None] | hsel  # [T, H'] (H' = 1 broadcasts over heads; every shard's heads)
            if select_only:
                return pool, _padded(x, select_only), alive, selected & valid[:, None]
            selected = jnp.broadcast_to(selected, (T, H * tp_size))
            if tp is not None:
                selected = tp.own(selected, 1)
        else:
            alive = forced
            if select_only:
                return pool, _padded(x, select_only), alive, forced[:, None]
        # (5) sparse phase on the alive rows (ascending token order; padding rows at the end).
        (idx,) = jnp.nonzero(alive, size=num_rows, fill_value=-1)
        gi = jnp.maximum(idx, 0)
        sel_rows = selected[gi] & (idx >= 0)[:, None]
        xr = x[gi]
        start = F
    else:  # a later layer group: the rows chosen by the first, their hidden states after the group before
        xr, idx, sel_rows, stats = carry
        gi = jnp.maximum(idx, 0)
        start = l0
    ok = idx >= 0
    rows = {"positions": jnp.where(ok, b["positions"][gi], -1), "slots": jnp.where(ok[:, None, None],
            b["slots"][gi], -1), "is_new": b["is_new"][gi] & ok, "forced": forced[gi] & ok,
            "seg_offset": jnp.where(ok, b["seg_offset"][gi], -1)}
    # Probe rows re-indexed into the compacted rows.
    where_row = jnp.full((T + 1,), -1, jnp.int32).at[jnp.where(ok, idx, T)].set(jnp.arange(num_rows))
    rows["probe"] = jnp.where(b["probe"] >= 0, where_row[jnp.maximum(b["probe"], 0)], -1)
    ffn_from = start  # rows["ffn_cached"] holds layers [start, l1)
    if "ffn_cache" in b:  # [L, T, hidden] per prompt token (zeros for new text) -> per row
        rows["ffn_cached"] = jnp.where(ok[None, :, None], b["ffn_cache"][start:l1][:, gi], 0)
    # the sparse phase's layer loop, split where the method's static per-layer choices change
    cuts = [start, *sorted({c for c in policy.layer_breaks() if start < c < l1}), l1]
    for s0, s1 in zip(cuts[:-1], cuts[1:]):
        if s0 < s1:
            xr, (pool, stats) = run_phase(xr, pool, stats, rows, s0, s1, True, want_view=True,
                                          selected=sel_rows, tokens=rows_are_tokens and num_rows == T)
    if not last:
        return pool, (xr, idx, sel_rows, stats)

    hidden = llama.rms_norm(xr, params["final_norm"], cfg.rms_norm_eps)
    last_row = jnp.argmax(rows["positions"] == b["last"])
    logits = llama.lm_head(params, cfg, hidden[last_row][None])
    if tp is not None:
        logits = tp.logits(logits)
    tok, logprob = sample(logits.astype(jnp.float32), b["temperature"], b["top_k"], b["top_p"], b["seeds"],
                          b["counters"])
    names = ("kv_writes", "query_rows", "ffn_rows", "promoted_heads", "ffn_dropped", "keys_seen")
    st = dict(zip(names, stats))
    st["rows"] = idx
    return pool, tok, logprob, logits[0], st


def _padded(x, rows: int):
    """x [T, D] as [rows, D] (rows >= T): zero rows past T."""
    if rows < x.shape[0]:
        raise ValueError(f"reuse pass: {x.shape[0]} token rows exceed the {rows}-row stream buffer")
    return x if rows == x.shape[0] else jnp.zeros((rows, x.shape[1]), x.dtype).at[:x.shape[0]].set(x)


def num_compilations() -> int:
    """Reuse passes compiled so far: jit's own variants and those compiled ahead of time and installed
    (`Reuser.compiled`)."""
    from jaxkv.engine import programs

    return reuse_prefill._cache_size() + programs.installed("reuser")
