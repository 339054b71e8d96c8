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
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxkv.cache.pool import KVPool
from jaxkv.engine.buckets import bucket_for
from jaxkv.engine.runner import StepBatch
from jaxkv.models import rope
from jaxkv.policies.reuse.apply import copy_pages
from jaxkv.policies.reuse.base import PlainPass, ReusePolicy
from jaxkv.sampling import MAX_LOGPROBS


def runs_as_steps(engine, policy: ReusePolicy) -> bool:
    """Whether a request of `policy` runs as ragged steps on this engine (`SegmentConfig.as_steps`): its
    device pass is the plain one without dense layers and with nothing per segment, on one device."""
    cfg = getattr(engine, "config", None)
    if cfg is None or not cfg.segments.as_steps or engine.runner.mesh is not None:
        return False
    dev = policy.device_form()
    return isinstance(dev, PlainPass) and dev.full_layers == 0 and not policy.uses_segment_ffn


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


def run_forced_rows(engine, row: np.ndarray, slots_used: int, tokens: np.ndarray, storage: np.ndarray,
                    forced: np.ndarray, req) -> tuple[int, float, list | None]:
    """The forced tokens of a laid-out prompt (tokens, storage slot per token, forced [n]; token i sits at
    position i) as ragged steps of one row over the request's page table `row` [L, H, P] (a width class,
    `page_width`; `slots_used` slots laid out); returns the first generated token, its logprob (sampled at
    the last token, which is always forced) and, when the request asks for them, its top alternatives
    [(id, logprob)] (the last step is then the logprob variant of its shape, as the scheduler's steps of
    such requests are)."""
    ps = engine.page_size
    idx = np.nonzero(forced)[0]
    step = engine.scheduler.max_step_tokens
    sp = req.sampling
    for s in range(0, idx.size, step):
        pick = idx[s:s + step]
        st = storage[pick]
        slots = row[:, :, st // ps].transpose(2, 0, 1) * ps + (st % ps)[:, None, None]
        b = one_row_step(engine, row, slots_used, tokens[pick], pick, slots)
        b.temperature[0], b.top_k[0], b.top_p[0], b.seeds[0] = sp.temperature, sp.top_k, sp.top_p, req.seed
        if sp.logprobs and s + step >= idx.size:
            b.top_width = MAX_LOGPROBS
        out, logprobs, extras = engine.runner.run_extras(b)
    top = None
    if sp.logprobs:
        ids, lps = extras["top"][0][0], extras["top"][1][0]
        top = [(int(i), float(x)) for i, x in zip(ids[:sp.logprobs], lps[:sp.logprobs])]
    return int(out[0]), float(logprobs[0]), top


def one_row_step(engine, row: np.ndarray, length: int, tokens, positions, slots) -> StepBatch:
    """A ragged step of one sequence (row 0: page table `row` [L, H, P], `length` slots stored after it) of
    m tokens at `positions` writing `slots` [m, L, H], its logits at the last token, greedy unless the
    caller sets row 0's sampling. Its other rows are padding, so it has the shape of the scheduler's steps
    of that token count and runs their precompiled program."""
    L, H, P = row.shape
    m = len(tokens)
    T = bucket_for(m, engine._token_buckets)
    S = engine.step_rows(T)
    page_table = np.full((S, L, H, P), -1, np.int32)
    page_table[0] = row
    lengths = np.zeros((S, L, H), np.int32)
    lengths[0] = length
    b = StepBatch(tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                  q_seq=np.full(T, -1, np.int32), slots=np.full((T, L, H), -1, np.int32),
                  page_table=page_table, lengths=lengths,
                  logits_index=np.zeros(S, np.int32), temperature=np.zeros(S, np.float32),
                  top_k=np.zeros(S, np.int32), top_p=np.ones(S, np.float32), seeds=np.zeros(S, np.uint32),
                  counters=np.zeros(S, np.int32))
    b.tokens[:m], b.positions[:m], b.q_seq[:m], b.slots[:m] = tokens, positions, 0, slots
    b.logits_index[0] = m - 1
    return b


def forced_row_stats(forced: np.ndarray, L: int, H: int) -> dict:
    """The pass's per-layer statistics of a forced-rows-only pass (every head writes and sees its whole
    history): what `reuse_prefill` would report, from the layout alone."""
    rows = int(forced.sum())
    keys = int((np.nonzero(forced)[0] + 1).sum())
    return {"query_rows": [rows] * L, "kv_writes": [rows * H] * L, "ffn_rows": [rows] * L,
            "promoted_heads": [0] * L, "keys_seen": [keys] * L, "ffn_dropped": [0] * L}
