"""The KV methods per shard: compression presses, segment reuse and retrieval under tensor parallelism.

Each method's device pass runs per shard under `shard_map` like an engine step (`shard.tp_call`): the
shard's heads, their pages, their rows of the per-head tables. Whatever a method decides per KV head is
shard-local; whatever it decides across heads (AdaKV's layer-wide top-k, SparseX's and CacheBlend's token
scores summed over heads, RedKnot's probe mass) is computed from every shard's heads, gathered
(`shard.gather_heads`), so the sharded result equals the unsharded one.

Host side (`placed_policy`): a policy field holding one value per (layer, KV head) in checkpoint order
(HARD-KV's calibrated temperatures) is put into the model's placed head order once, then each shard scores
with its own slice (`shard_policies`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Policy fields that hold one value per (layer, KV head): [L][Hkv] nested tuples in checkpoint order.
PER_HEAD_FIELDS = ("calibration",)


def placed_policy(policy, perm):
    """`policy` with its per-(layer, KV head) fields in placed order (`perm [L, Hkv]`, `placement.py`:
    position j of layer l holds checkpoint head perm[l, j]); unchanged without a permutation."""
    if perm is None or policy is None:
        return policy
    changes = {}
    for name in PER_HEAD_FIELDS:
        table = getattr(policy, name, None)
        if isinstance(table, tuple):
            changes[name] = tuple(tuple(row[int(h)] for h in perm[layer]) for layer, row in enumerate(table))
    return dataclasses.replace(policy, **changes) if changes else policy


def shard_policies(policy, tp: int) -> tuple:
    """One policy per shard, each with its heads' slice of the per-head fields (the same object `tp` times
    when it has none)."""
    tables = {n: getattr(policy, n) for n in PER_HEAD_FIELDS if isinstance(getattr(policy, n, None), tuple)}
    if not tables:
        return (policy,) * tp
    out = []
    for s in range(tp):
        fields = {}
        for name, table in tables.items():
            per = len(table[0]) // tp
            fields[name] = tuple(tuple(row[s * per:(s + 1) * per]) for row in table)
        out.append(dataclasses.replace(policy, **fields))
    return tuple(out)


def counts_across_heads(policy) -> bool:
    """Whether the policy's keep counts of a head depend on other heads' scores. Known per-head `counts`
    (the uniform default, PyramidKV's per-layer schedule, HARD-KV's per-head top-p) stay shard-local; any
    other (AdaKV's layer-wide top-k, a method registered later) sees every head's scores."""
    from jaxkv.policies.base import CompressPolicy
    from jaxkv.policies.compress.hardkv import HardKV
    from jaxkv.policies.compress.pyramidkv import PyramidKV

    return type(policy).counts not in (CompressPolicy.counts, PyramidKV.counts, HardKV.counts)


def _gathered_counts(policy, local: int):
    """`policy.counts` over every shard's heads; returns this shard's heads' counts."""
    from jaxkv.parallel.shard import gather_heads, own_heads
    from jaxkv.policies.base import SelectContext

    def counts(scores, ctx):
        full = SelectContext(lengths=gather_heads(ctx.lengths, 2), positions=gather_heads(ctx.positions, 2),
                             target=ctx.target, recent_from=ctx.recent_from,
                             compressible=gather_heads(ctx.compressible, 1), lower=gather_heads(ctx.lower, 1),
                             upper=gather_heads(ctx.upper, 1))
        return own_heads(policy.counts(gather_heads(scores, 2), full), 2, local)

    return counts


def sharded_compress(body, params, pool, b: dict, heads: dict, *, cfg, policy, kmax: int, impl, mesh):
    """`jaxkv.policies.apply.compress_body` per shard: the observation pass over the shard's heads (the O and
    down projections all-reduced), scores and keep sets per head, counts across heads where the policy
    needs them, the rewrite on the shard's pages. -> (pool, counts [S, L, Hkv] split over the shards)."""
    from jaxkv.parallel import shard
    from jaxkv.parallel.mesh import tp_size

    tp = tp_size(mesh)
    local = cfg.num_kv_heads // tp
    policies = shard_policies(policy, tp)
    counts = _gathered_counts(policy, local) if counts_across_heads(policy) else None

    def score(obs):
        if all(p is policy for p in policies):
            return policy.score(obs)
        return shard.per_shard([p.score for p in policies], obs)

    def run(params, pool, batch, lcfg):
        batch = dict(batch)
        own = {k: batch.pop(k) for k in heads}
        return body(params, pool, batch, own, cfg=lcfg, policy=policy, kmax=kmax, impl=impl, score=score,
                    reduce=shard.reduce, counts=counts)

    return shard.tp_call(run, mesh, params, pool, {**b, **heads}, cfg, ("pool", ("seq", "layer", "kv_heads")))


class ReuseShard:
    """What `jaxkv.policies.reuse.apply.reuse_body` needs to run on one shard of `size` (inside shard_map)."""

    def __init__(self, size: int, local_heads: int, vocab_size: int):
        self.size, self.local, self.vocab_size = size, local_heads, vocab_size

    @staticmethod
    def reduce(x):
        from jaxkv.parallel.shard import reduce

        return reduce(x)

    def heads(self, x, axis: int):
        from jaxkv.parallel.shard import gather_heads

        return gather_heads(x, axis)

    def own(self, x, axis: int):
        from jaxkv.parallel.shard import own_heads

        return own_heads(x, axis, self.local)

    def logits(self, logits):
        from jaxkv.parallel.shard import gather_logits

        return gather_logits(logits, self.vocab_size)

    def view(self, view):
        """A `LayerView` of every shard's heads (for hooks whose result mixes heads: a token score, FFN
        rows); fields a hook does not read are never gathered (XLA drops unused collectives)."""
        g = self.heads
        return dataclasses.replace(view, q=g(view.q, 1), k=g(view.k, 1), v=g(view.v, 1),
                                   k_cached=g(view.k_cached, 1), v_cached=g(view.v_cached, 1),
                                   is_global=g(view.is_global, 0), sink=g(view.sink, 0),
                                   window=g(view.window, 0))

    @staticmethod
    def own_pages(b: dict, pages_per_shard: int) -> dict:
        """The segment copies (src -> dst) and the pages to blank that lie in this shard's pool block, as
        local ids (a copy's source and destination belong to the same KV head, so to the same shard)."""
        from jaxkv.parallel.shard import localize_pages

        dst = localize_pages(b["dst"], pages_per_shard)
        src = jnp.where(dst >= 0, localize_pages(b["src"], pages_per_shard), -1)
        return {**b, "src": src, "dst": jnp.where(src >= 0, dst, -1),
                "clear": localize_pages(b["clear"], pages_per_shard)}


def sharded_reuse(body, params, pool, b: dict, heads: dict, *, mesh, cfg, head_windows, **static):
    """`jaxkv.policies.reuse.apply.reuse_body` per shard: the shard's heads, pages and page-table rows; the
    selection and FFN rows from every shard's heads, so every shard recomputes the same rows. The fresh-
    prefill kernel's windowed branch needs static per-shard head windows and is not taken (the paged path
    attends the same keys). -> (pool, token, logprob, logits, stats) as on one device."""
    from jaxkv.parallel import shard
    from jaxkv.parallel.mesh import tp_size

    tp = tp_size(mesh)
    ctx = ReuseShard(tp, cfg.num_kv_heads // tp, cfg.vocab_size)

    def run(params, pool, batch, lcfg):
        batch = dict(batch)
        own = {k: batch.pop(k) for k in heads}
        return body(params, pool, batch, own, cfg=lcfg, head_windows=None, tp=ctx, **static)

    return shard.tp_call(run, mesh, params, pool, {**b, **heads}, cfg, ("pool", None, None, None, None))


def _retrieval_specs(summary, sbuf):
    """Specs of the retrieval pieces: the per-page key bounds split like the pool's pages, the selection
    buffer over its KV-head axis ([rows, Hkv, ...] leaves); the retrieval head and its state replicated."""
    from jax.sharding import PartitionSpec as P

    from jaxkv.parallel.mesh import TP

    return (None if summary is None else P(TP)), (None if sbuf is None else P(None, TP))


def sharded_step_tap(body, params, pool, b: dict, rstate, head, summary, *, mesh, cfg, **static):
    """`jaxkv.engine.retrieval._step_tap_body` per shard -> (tokens, logprobs, pool, rstate, summary)."""
    from jax.sharding import PartitionSpec as P

    from jaxkv.parallel import shard

    summary_spec, _ = _retrieval_specs(summary, None)

    def run(params, pool, batch, lcfg, extra):
        rstate, head, summary = extra
        return body(params, pool, batch, rstate, head, summary, cfg=lcfg, tp=True, **static)

    return shard.tp_call(run, mesh, params, pool, b, cfg, (None, None, "pool", P(), summary_spec or P()),
                         extra=(rstate, head, summary), extra_specs=(P(), P(), summary_spec or P()))


def sharded_retrieval_decode(body, params, pool, d: dict, rstate, head, summary, sbuf, host, *, mesh, cfg,
                             **static):
    """`jaxkv.engine.retrieval._decode_retrieval_fn` per shard: each shard attends its heads' selection
    (in place in its pages, or in its slice of the selection buffer); the selection statistics are summed
    over the shards. -> the outputs of the one-device call."""
    from jax.sharding import PartitionSpec as P

    from jaxkv.parallel import shard

    if host is not None:
        raise ValueError("the retrieval host tier (retrieval_host_tier) is not supported with tensor "
                         "parallelism: its host mirror of the pool is single-device")
    summary_spec, sbuf_spec = _retrieval_specs(summary, sbuf)

    def run(params, pool, batch, lcfg, extra):
        rstate, head, summary, sbuf = extra
        out = body(params, pool, batch, rstate, head, summary, sbuf, None, cfg=lcfg, tp=True, **static)
        tokens, logprobs, ran, last, stats, moved, *rest = out
        return (tokens, logprobs, ran, last, shard.reduce(stats), shard.reduce(moved), *rest)

    outs = (None, None, None, None, None, None, "pool", P(), summary_spec or P(), sbuf_spec or P())
    return shard.tp_call(run, mesh, params, pool, d, cfg, outs, extra=(rstate, head, summary, sbuf),
                         extra_specs=(P(), P(), summary_spec or P(), sbuf_spec or P()))


def placed_retrieval_head(head, perm, first_layer: int):
    """A retrieval head (SpeContext) whose KV heads follow the model's placed order. Its selection of KV
    head h serves head h of every layer from `first_layer` on, so the placement must be the same in those
    layers (it is under the balanced placement when they share one head-class row, and always under
    `placement="contiguous"`)."""
    if head is None or perm is None:
        return head
    from jaxkv.parallel.placement import _take

    perm = np.asarray(perm)
    if len(perm) > first_layer and (perm[first_layer:] != perm[first_layer]).any():
        raise ValueError("a retrieval policy with tensor parallelism needs one KV-head placement for every "
                         f"layer from its tap layer {first_layer} on (its selection per KV head serves them "
                         "all); load the model with placement='contiguous' or a head-class map whose rows "
                         "agree from that layer on")
    order = perm[min(first_layer, len(perm) - 1)]
    if (order == np.arange(order.size)).all():
        return head
    hkv = order.size
    params = {k: (_take(v, order, 1, hkv) if k in ("wq", "wk") else v) for k, v in head.params.items()}
    return dataclasses.replace(head, params=jax.tree.map(jnp.asarray, params))
