"""Segment reuse through the engine's own step program.

A method whose pass recomputes only its forced rows, every head over its whole history, with no dense
layers and no hook of its own (naive, EPIC, full: `PlainPass` with `full_layers` 0) needs nothing a ragged
step lacks. The reused pages are copied into the request's pages and rotated to their new positions
(`prepare_pages`, the reuse pass's own first stage), and the forced tokens then run as ragged steps of the
scheduler's shapes, in chunks of `max_step_tokens`, each token attending over the request's pages by
position: a reused slot holds its shifted position, a slot not yet written holds -1 and is never seen, so
a chunk sees the reused tokens and the forced ones before it, as the pass's one program does.

Those step programs are the ones precompile compiles for every server, so such a request compiles only
`prepare_pages` (one program per page-table width class, precompiled with the method's passes).

A method that selects rows (CacheBlend, SparseX: `score` is its only device hook, every head sees the whole
history) runs its pass up to the selection only (`reuse_prefill(select_only=...)`: page copies, the dense
layers on every token, `score` at layer `full_layers`), one program per token bucket. That program returns
the residual stream entering layer `full_layers` of every token, in a buffer of one size per engine
(`hidden_rows`), and the rows it picked with the heads each writes. Those rows then run as ragged steps
from layer `full_layers` on (`StepBatch.from_layer`), their streams read from the buffer, a head a row does
not write given slot -1, so it reads the cached K/V at the row's own position as the pass's sparse phase
does. Their step programs depend on the token bucket and `full_layers` only, so every such method shares
them (`selection_calls`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.pool import KVPool
from jaxkv.engine.buckets import bucket_for
from jaxkv.engine.runner import StepBatch
from jaxkv.models import rope
from jaxkv.policies.reuse.apply import copy_pages, reuse_prefill
from jaxkv.policies.reuse.base import DEVICE_HOOKS, PlainPass, ReusePolicy, ScoreUnion
from jaxkv.sampling import MAX_LOGPROBS

# The fewest tokens a step from a selection layer holds (fewer rows are padded to it), so those steps compile
# in the step token buckets from here up only (6 up to 8K tokens, not 11): a selection of 15 % of a prompt's
# reused tokens plus its new text has fewer rows only for prompts under ~1.5K tokens, whose steps are cheap.
SELECT_STEP_TOKENS = 256
# The device hooks a method that selects as steps may define: the sparse phase of any other is not a plain
# layer with a per-head write mask.
SELECT_HOOKS = ("score", "selects_per_head")


def runs_as_steps(engine, policy: ReusePolicy) -> bool:
    """Whether a request of `policy` runs as ragged steps on this engine (`SegmentConfig.as_steps`), on one
    device: its device pass is the plain one without dense layers and with nothing per segment, or it
    selects (`selects_as_steps`)."""
    cfg = getattr(engine, "config", None)
    if cfg is None or not cfg.segments.as_steps or engine.runner.mesh is not None:
        return False
    dev = policy.device_form()
    if isinstance(dev, PlainPass):
        return dev.full_layers == 0 and not policy.uses_segment_ffn
    return selects_as_steps(policy, engine.model.config.num_layers)


def selects_as_steps(policy: ReusePolicy, num_layers: int) -> bool:
    """Whether `policy` is a selecting method whose sparse phase is plain layers: it defines no device hook
    but `score` (and `selects_per_head`), no local windows, no rolled loop, no segment FFN, and selects
    before the last layer."""
    cls, base = type(policy), ReusePolicy
    return (cls.selects and not cls.local_windows and not cls.rolled_layers and not policy.uses_segment_ffn
            and policy.full_layers < num_layers
            and all(getattr(cls, h) is getattr(base, h) for h in DEVICE_HOOKS if h not in SELECT_HOOKS))


def hidden_rows(engine) -> int:
    """Rows of the residual-stream buffer a selection returns: the largest token bucket of a reuse pass on
    this engine's context, so every request's streams come in one shape."""
    from jaxkv.engine.reuse import token_bucket

    limit = engine.max_pages_per_head * engine.page_size
    return token_bucket(limit, limit)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("pool",))
def prepare_pages(params, pool: KVPool, b: dict, *, cfg, impl=None) -> KVPool:
    """`copy_pages` as a program of its own (b: clear, src, dst, delta). `params` is unused: the argument
    layout of every program the reuser holds (`jaxkv.engine.programs`)."""
    del params
    return copy_pages(pool, b["clear"], b["src"], b["dst"], b["delta"], rope.inv_freq(cfg), impl)


def page_batch(size: int) -> dict:
    """An all-padding `prepare_pages` batch of `size` entries (nothing blanked or copied)."""
    return {k: np.full(size, -1 if k != "delta" else 0, np.int32) for k in ("clear", "src", "dst", "delta")}


def page_width(engine, npg: int) -> int:
    """The page-table width class of a layout of `npg` pages per head: the step programs' width, and the
    size of `prepare_pages`' batch (L x H x width), so one program serves each class."""
    return bucket_for(npg, engine._page_buckets)


def prepare_call(reuser, P: int, b: dict | None = None):
    """(function, arguments, static arguments) of `prepare_pages` for width class P (an all-padding batch
    unless `b`)."""
    eng, cfg = reuser.engine, reuser.cfg
    pad = page_batch(cfg.num_layers * cfg.num_kv_heads * P)
    b = pad if b is None else {k: b[k] for k in pad}  # the signature reads the entries in order
    return prepare_pages, (eng.runner.params, eng.runner.pool, b), dict(cfg=cfg, impl=reuser.impl)


def run_rows(engine, row: np.ndarray, slots_used: int, tokens: np.ndarray, storage: np.ndarray,
             idx: np.ndarray, req, heads: np.ndarray | None = None, hidden=None,
             from_layer: int = 0, programs=None, by_page=None) -> tuple[int, float, list | None]:
    """Tokens `idx` (ascending) of a laid-out prompt (tokens, storage slot per token; token i sits at
    position i) as ragged steps of one row over the request's page table `row` [L, H, P] (a width class,
    `page_width`; `slots_used` slots laid out); returns the first generated token, its logprob (sampled at
    the last token, which is always run) and, when the request asks for them, its top alternatives
    [(id, logprob)] (the last step is then the logprob variant of its shape, as the scheduler's steps of
    such requests are). `heads` [len(idx), H] bool: the KV heads each row writes (default all);
    `from_layer` > 0: the steps start there, token i's stream being row i of `hidden` (`StepBatch`);
    `programs`: whose precompiled programs run them (default the runner's); `by_page`: `pages_by_slot` of
    `row`, when the caller has it."""
    ps = engine.page_size
    sp = req.sampling
    floor = SELECT_STEP_TOKENS if from_layer else 0
    L, H, _ = row.shape
    # Every step is built before the first runs, so no host work sits between their dispatches.
    batches, s, tables = [], 0, {}
    by_page = pages_by_slot(row, ps, from_layer) if by_page is None else by_page
    for m in step_sizes(engine, idx.size, floor):
        pick = idx[s:s + m]
        st = storage[pick]
        # the step's slots [T, L, H], padding -1; layers before `from_layer` ran in the selection (and the
        # steps skip them), so only the others are written, in place
        slots = np.full((step_tokens(engine, max(m, floor)), L, H), -1, np.int32)
        mine = slots[:m, from_layer:]
        np.add(by_page[st // ps], (st % ps)[:, None, None], out=mine)
        if heads is not None:
            mine[~np.broadcast_to(heads[s:s + m, None, :], mine.shape)] = -1
        b = one_row_step(engine, row, slots_used, tokens[pick], pick, slots, min_tokens=floor, tables=tables)
        if from_layer:
            from_rows(b, hidden, from_layer, ps, storage)
            b.hidden_rows[:pick.size] = pick
        b.temperature[0], b.top_k[0], b.top_p[0], b.seeds[0] = sp.temperature, sp.top_k, sp.top_p, req.seed
        batches.append(b)
        s += m
    for b in batches[:-1]:  # only the last step's token is read: the others run without a sync
        engine.runner.dispatch(b, programs)
    b = batches[-1]
    if sp.logprobs:
        b.top_width = MAX_LOGPROBS
    out, logprobs, extras = engine.runner.run_extras(b, programs=programs)
    top = None
    if sp.logprobs:
        ids, lps = extras["top"][0][0], extras["top"][1][0]
        top = [(int(i), float(x)) for i, x in zip(ids[:sp.logprobs], lps[:sp.logprobs])]
    return int(out[0]), float(logprobs[0]), top


def pages_by_slot(row: np.ndarray, page_size: int, from_layer: int = 0) -> np.ndarray:
    """[P, L - from_layer, H]: the first slot of each of `row`'s ([L, H, P]) pages, page-major, so a token's
    slots in every (layer, head) are one row (its page's) plus its offset in the page."""
    return np.ascontiguousarray(row[from_layer:].transpose(2, 0, 1)) * page_size


def from_rows(b: StepBatch, hidden, from_layer: int, page_size: int, storage=()) -> None:
    """Makes `b` a step from layer `from_layer` over the streams in `hidden` (every row padding until set)
    whose sequence's key at position t lies at storage slot `storage[t]` of its page table."""
    b.hidden, b.from_layer = hidden, from_layer
    b.hidden_rows = np.full(b.tokens.shape[0], -1, np.int32)
    b.key_storage = np.full(b.page_table.shape[-1] * page_size, -1, np.int32)
    b.key_storage[:len(storage)] = storage


def run_selected(reuser, req, policy: ReusePolicy, b: dict, T: int, tokens, storage, table: np.ndarray,
                 slot: int):
    """A selecting method's request (`selects_as_steps`) over its pass batch `b` of token bucket T: the
    selection program, then the rows it picked as steps from layer `full_layers`. -> (first token, its
    logprob, its alternatives or None, the pass's statistics)."""
    eng, cfg = reuser.engine, reuser.cfg
    L, H, npg = table.shape
    F = policy.full_layers
    fn, args, static = select_call(reuser, policy, T, b)
    eng.runner.pool, hidden, alive, selected = reuser.compiled.call(fn, args, static)
    # the host's share that needs no selection runs while the device selects
    wide = np.full((L, H, page_width(eng, npg)), -1, np.int32)
    wide[:, :, :npg] = table
    by_page = pages_by_slot(wide, eng.page_size, F)
    alive, selected = jax.device_get((alive, selected))
    idx = np.nonzero(alive)[0]
    heads = selected[idx]
    if heads.all():  # every row writes every head (a selection not per head): no mask to apply
        heads, writes = None, idx.size * H
    else:
        heads = np.broadcast_to(heads, (idx.size, H))
        writes = int(heads.sum())
    tok, logprob, top = run_rows(eng, wide, slot, tokens, storage, idx, req, heads, hidden, F,
                                 programs=reuser.compiled, by_page=by_page)
    n = len(tokens)
    return tok, logprob, top, row_stats(n, idx, writes, cfg.num_layers, H, dense=F)


def select_call(reuser, policy: ReusePolicy, T: int, b: dict | None = None):
    """(function, arguments, static arguments) of the selection program of token bucket T (the pass up to
    its selection, `reuse_prefill(select_only=...)`) over `b` (default all padding), in the form `score_form`
    gives `policy` (its branch of a shared program as `b["method"]`)."""
    form, method = score_form(reuser, policy)
    if b is None:
        fn, args, static = reuser._pass_call(policy, T, 0, T)
        b = args[2]
    else:  # a request's batch: no all-padding one built only to be replaced
        eng = reuser.engine
        fn, args = reuse_prefill, (eng.runner.params, eng.runner.pool, b, reuser.heads)
        static = reuser._pass_static(policy, 0, T)
    args = (*args[:2], {**b, "method": np.asarray(method, np.int32)}, *args[3:])
    return fn, args, {**static, "policy": form, "select_only": hidden_rows(reuser.engine)}


def score_form(reuser, policy: ReusePolicy) -> tuple[ReusePolicy, int]:
    """The device form `policy`'s selection program compiles for, and its branch there: the `ScoreUnion`
    this engine's precompiled selecting methods share (`share_selections`) when `policy` is one of them,
    else its own form (branch 0)."""
    dev = policy.device_form()
    union = reuser.score_unions.get((policy.full_layers, policy.selects_per_head))
    if union is not None and dev in union.methods:
        return union, union.methods.index(dev)
    return dev, 0


def share_selections(reuser, policies) -> None:
    """Makes the selecting methods of `policies` that run as steps share their selection programs: one
    `ScoreUnion` per (selection layer, per-head selection) they have in common, its members in a fixed
    order (their forms' text), so a restart builds the same program and finds it in the step cache."""
    groups: dict = {}
    for pol in policies:
        if pol.selects and reuser.as_steps(pol):
            groups.setdefault((pol.full_layers, pol.selects_per_head), set()).add(pol.device_form())
    for (F, per_head), forms in groups.items():
        if len(forms) > 1:
            reuser.score_unions[(F, per_head)] = ScoreUnion(full_layers=F, per_head=per_head,
                                                           methods=tuple(sorted(forms, key=repr)))


def selection_calls(reuser, policy: ReusePolicy) -> list[tuple]:
    """(variant, call) of every program a selecting method's requests run (`selects_as_steps`): the
    selection of each token bucket, then the steps from layer `full_layers` of each step shape (shared by
    every method of that layer; their streams one zero buffer of the engine's `hidden_rows`). A call returns
    (signature, function, arguments, static arguments), nothing traced."""
    from jaxkv.engine.reuse import pass_shapes
    from jaxkv.engine.warmup import sampler_forms

    eng, cfg, F = reuser.engine, reuser.cfg, policy.full_layers
    L, H = cfg.num_layers, cfg.num_kv_heads
    buckets = sorted({T for T, _, _ in pass_shapes(policy, eng.max_pages_per_head * eng.page_size)})
    hidden = []

    def select(T):
        fn, args, static = select_call(reuser, policy, T)
        return reuser.compiled.signature(fn, args, static), fn, args, static

    def step(T, P, greedy):
        if not hidden:
            dtype = eng.runner.params["embed"].dtype
            hidden.append(jnp.zeros((hidden_rows(eng), cfg.hidden_size), dtype))
        b = one_row_step(eng, np.full((L, H, P), -1, np.int32), 0, np.zeros(T, np.int32), np.arange(T),
                         np.full((T, L, H), -1, np.int32))
        b.q_seq[:] = -1
        from_rows(b, hidden[0], F, eng.page_size)
        b.temperature[0] = 0.0 if greedy else 1.0
        fn, args, static = eng.runner._step_call(b)
        return reuser.compiled.signature(fn, args, static), fn, args, static

    out = [((f"reuse {policy.name} select", T, T, reuser._table_pages(T, 1)), functools.partial(select, T))
           for T in buckets] + row_table_calls(reuser)
    return out + [(("reuse steps", T, T, P, F, greedy), functools.partial(step, T, P, greedy))
                  for T in eng._token_buckets if T >= step_tokens(eng, SELECT_STEP_TOKENS)
                  for P in eng._page_buckets for greedy in sampler_forms(eng)]


@functools.partial(jax.jit, static_argnames=("rows",))
def one_row_table(params, pool, b: dict, *, rows: int):
    """A step's page table [rows, L, H, P]: b["row"] [L, H, P] and padding rows (-1), built on the device.
    On the host a GPU server's (256 rows, 1B shape, 32K context) is 300 MB: a naive request's one step took
    123 ms against 34 ms with one row (H100; docs/segments.md, "Reuse as steps"). `params` and `pool` are
    unused: the argument layout of every program the reuser holds."""
    del params, pool
    row = b["row"]
    return jnp.concatenate([row[None], jnp.full((rows - 1, *row.shape), -1, row.dtype)])


def row_table_call(reuser, rows: int, row: np.ndarray):
    """(function, arguments, static arguments) of `one_row_table` for `row` [L, H, P]."""
    eng = reuser.engine
    return one_row_table, (eng.runner.params, eng.runner.pool, {"row": row}), {"rows": rows}


def row_table_calls(reuser) -> list[tuple]:
    """(variant, call) of `one_row_table` for every step shape of more than one row (the rows of each token
    bucket, each page-table width): a reuse request's steps build their tables through these (a one-row
    table is the request's own)."""
    eng, cfg = reuser.engine, reuser.cfg

    def call(S, P):
        fn, args, static = row_table_call(reuser, S, np.full((cfg.num_layers, cfg.num_kv_heads, P), -1,
                                                                np.int32))
        return reuser.compiled.signature(fn, args, static), fn, args, static

    return [(("reuse rows", 0, 0, P, S), functools.partial(call, S, P))
            for S in sorted({eng.step_rows(T) for T in eng._token_buckets} - {1}) for P in eng._page_buckets]


def one_row_step(engine, row: np.ndarray, length: int, tokens, positions, slots,
                 min_tokens: int = 0, tables: dict | None = None) -> StepBatch:
    """A ragged step of one sequence (row 0: page table `row` [L, H, P], `length` slots stored after it) of
    m tokens at `positions` writing `slots` ([m, L, H], or the step's [T, L, H] with padding rows -1), its
    logits at the last token, greedy unless the caller sets row 0's sampling. Its other rows are padding, so
    it has the shape of the scheduler's steps of that token count (at least `min_tokens`, within the
    largest) and runs their precompiled program. `tables`: the page tables already built for this `row`, by
    row count (filled here), shared by the steps of one request."""
    L, H, P = row.shape
    m = len(tokens)
    T = step_tokens(engine, max(m, min_tokens))
    S = engine.step_rows(T)
    tables = {} if tables is None else tables
    if S not in tables:
        row = np.ascontiguousarray(row, np.int32)
        tables[S] = (row[None] if S == 1
                     else engine.reuser.compiled.call(*row_table_call(engine.reuser, S, row)))
    page_table = tables[S]
    lengths = np.zeros((S, L, H), np.int32)
    lengths[0] = length
    # `slots` may be the step's own [T, L, H] (padding rows -1), taken as they are, or the m tokens' ones
    padded = isinstance(slots, np.ndarray) and len(slots) == T and slots.dtype == np.int32
    b = StepBatch(tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                  q_seq=np.full(T, -1, np.int32), slots=slots if padded else np.full((T, L, H), -1, np.int32),
                  page_table=page_table, lengths=lengths,
                  logits_index=np.zeros(S, np.int32), temperature=np.zeros(S, np.float32),
                  top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32), seeds=np.zeros(S, np.uint32),
                  counters=np.zeros(S, np.int32))
    b.tokens[:m], b.positions[:m], b.q_seq[:m] = tokens, positions, 0
    if not padded:
        b.slots[:m] = slots
    b.logits_index[0] = m - 1
    return b


# A step of more tokens than this that would be padded by more than a quarter runs as the next smaller
# bucket's step plus the rest: 5,200 selected rows with 8K-token steps run as 4,096 + 1,024 + 256 rows, not
# 8,192. Below it a step is cheap beside the weights it reads, so one padded step is better than two.
SPLIT_TOKENS = 1024


def step_sizes(engine, n: int, floor: int = 0) -> list[int]:
    """How many of n rows each step runs: full steps of the largest bucket, then pieces padded by at most a
    quarter of their bucket, down to `SPLIT_TOKENS` (the rest one step of at least `floor` tokens)."""
    top, out = engine._token_buckets[-1], []
    while n > 0:
        T = step_tokens(engine, max(n, floor))
        take = min(n, top)
        if top > n > SPLIT_TOKENS and T - n > T // 4:
            take = max(b for b in engine._token_buckets if b < T)
        out.append(take)
        n -= take
    return out


def step_tokens(engine, n: int) -> int:
    """The step token bucket of n tokens (the largest for more)."""
    return bucket_for(min(n, engine._token_buckets[-1]), engine._token_buckets)


def row_stats(n: int, rows: np.ndarray, writes: int, L: int, H: int, dense: int = 0) -> dict:
    """The pass's per-layer statistics where every head sees its whole history: layers [0, dense) run on
    every one of the prompt's `n` tokens, the others on `rows` (ascending token indices) writing `writes`
    (row, head) K/V: what `reuse_prefill` would report, from the layout and the selection alone."""
    m, keys = int(rows.size), int((rows + 1).sum())
    per = lambda a, b: [a] * dense + [b] * (L - dense)  # noqa: E731
    return {"query_rows": per(n, m), "kv_writes": per(n * H, int(writes)), "ffn_rows": per(n, m),
            "promoted_heads": [0] * L, "keys_seen": per(n * (n + 1) // 2, keys), "ffn_dropped": [0] * L}
