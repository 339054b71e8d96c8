"""Per-segment FFN outputs for reuse methods that add them to skipped rows (RedKnot `ffn_reuse`).

A method that declares `ReusePolicy.uses_segment_ffn` gets, per prompt, an [L, T, hidden] array: every
reused token's FFN output from its segment's own prefill (after the anchor and context, at the segment's
positions), zeros for new text and padding. The outputs are computed on a segment's first use by a dense
forward and kept on its `SegmentEntry` (`ffn`, a `SegmentFFN`) within a byte budget of their own (they live
outside the page pool); the least recently used are dropped past it and recomputed on their next use, so
dropping one never changes an answer.

Shapes follow buckets, never a segment's length: a segment keeps its forward's whole padded output with the
offset and count of its own rows, and a prompt's array is assembled by one placement program per segment
(shapes: the pass's token bucket and the forward's bucket), so a new document length compiles nothing new.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.segments import SegmentEntry


@dataclasses.dataclass(frozen=True)
class SegmentFFN:
    """A segment's kept FFN outputs: `out` [L, W, hidden] is its padded forward's output (anchor and
    context rows first), rows [offset, offset + length) are the segment's own tokens."""

    out: jax.Array
    offset: int
    length: int

    @property
    def nbytes(self) -> int:
        return int(self.out.size) * self.out.dtype.itemsize

    def rows(self) -> jax.Array:
        """[L, length, hidden]: the segment's own rows (a copy; for inspection, not the serving path)."""
        return self.out[:, self.offset:self.offset + self.length]


class SegmentFFNCache:
    """FFN outputs of the segments of `store`, within `budget_bytes` of device memory. `params()` returns
    the model's weights, `anchor` the tokens every segment is prefilled after, `bucket(n)` the padded
    length of a segment's forward (so segments of one bucket share a compiled forward)."""

    def __init__(self, store, cfg, anchor: tuple[int, ...], budget_bytes: int,
                 params: Callable[[], dict], bucket: Callable[[int], int]):
        if budget_bytes < 0:
            raise ValueError(f"segment_ffn_cache_bytes must be >= 0 (got {budget_bytes})")
        self.store, self.cfg, self.anchor = store, cfg, tuple(anchor)
        self.budget_bytes = int(budget_bytes)
        self._params, self._bucket = params, bucket
        self._lru: OrderedDict[str, SegmentEntry] = OrderedDict()  # entries holding `ffn`, LRU first

    def __len__(self) -> int:
        """Entries holding cached outputs (the store may have dropped some since; they leave on the next
        insertion)."""
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """Device bytes the live entries' cached FFN outputs hold."""
        return sum(_nbytes(e.ffn) for e in self._lru.values() if self.store.holds(e))

    def for_prompt(self, pieces, T: int):
        """[L, T, hidden]: every reused token's FFN output (zeros for new text and padding). `pieces` are
        (tokens, SegmentEntry or None) in prompt order."""
        L, hd = self.cfg.num_layers, self.cfg.hidden_size
        out = jnp.zeros((L, T, hd), self._params()["embed"].dtype)
        start = 0
        for toks, e in pieces:
            if e is not None:
                kept = self.segment(e)
                out = _place(out, kept.out, np.int32(start), np.int32(kept.offset), np.int32(kept.length))
            start += len(toks)
        return out

    def segment(self, e: SegmentEntry) -> SegmentFFN:
        """The FFN outputs of the segment's own prefill, computed on first use and kept with the entry while
        the budget allows."""
        if e.ffn is not None:
            self._lru.move_to_end(e.segment_id)
            return e.ffn
        seq = list(self.anchor) + list(e.context) + list(e.tokens)
        c = len(e.context)
        a, n = len(self.anchor) + c, e.length
        T = self._bucket(len(seq))
        tokens = np.zeros(T, np.int32)
        positions = np.full(T, -1, np.int32)
        tokens[:len(seq)] = seq
        positions[:len(seq)] = np.concatenate([np.arange(a - c), e.start - c + np.arange(c + n)])
        ffn = SegmentFFN(_segment_ffn(self._params(), tokens, positions, cfg=self.cfg), a, n)
        self._keep(e, ffn)
        return ffn

    def _keep(self, e: SegmentEntry, ffn) -> None:
        """Caches `ffn` on `e` within the budget: entries the store dropped leave the LRU, then the least
        recently used others lose theirs until `e`'s fits; one that alone exceeds the budget is not kept."""
        for sid, old in list(self._lru.items()):
            if not self.store.holds(old):
                old.ffn = None
                del self._lru[sid]
        need = _nbytes(ffn)
        if need > self.budget_bytes:
            return
        total = self.nbytes
        while total + need > self.budget_bytes and self._lru:
            _, old = self._lru.popitem(last=False)
            total -= _nbytes(old.ffn)
            old.ffn = None
        e.ffn = ffn
        self._lru[e.segment_id] = e


def _nbytes(kept) -> int:
    return 0 if kept is None else kept.nbytes


@functools.partial(jax.jit, donate_argnums=0)
def _place(out, ffn, start, offset, n):
    """out [L, T, hidden] with rows [start, start + n) set to rows [offset, offset + n) of ffn [L, W,
    hidden], the other rows unchanged. Only a window of min(W, T) rows is read and written (it holds the n
    rows: n <= W - offset and n <= T), moved back where it would pass T, so a prompt's placements cost
    about its segments' rows, and the shapes are (T, W) whatever the segment's length and place."""
    T, W = out.shape[1], ffn.shape[1]
    width = min(W, T)
    at = jnp.minimum(start, T - width)
    r = at + jnp.arange(width)  # prompt rows of the window
    src = jnp.clip(r - start + offset, 0, W - 1)
    mine = (r >= start) & (r < start + n)
    old = jax.lax.dynamic_slice_in_dim(out, at, width, axis=1)
    new = jnp.where(mine[None, :, None], jnp.take(ffn, src, axis=1).astype(out.dtype), old)
    return jax.lax.dynamic_update_slice_in_dim(out, new, at, axis=1)


@functools.partial(jax.jit, static_argnames="cfg")
def _segment_ffn(params, tokens, positions, *, cfg):
    """Each layer's FFN output [L, T, hidden] of a dense causal forward (positions -1: end padding), through
    the model's layer loop (`llama.run_layers`: one traced layer body with `SharedLayers`)."""
    from jaxkv.models import llama, rope

    freqs = rope.inv_freq(cfg)
    pos = jnp.where(positions >= 0, positions, jnp.max(positions) + 1 + jnp.arange(positions.shape[0]))[None]
    x = params["embed"][tokens][None]
    outs = jnp.zeros((cfg.num_layers, *x.shape[1:]), x.dtype)
    _, outs = llama.run_layers(params["layers"], cfg, x, pos, freqs, _causal_attend(cfg), outs,
                               layer=_ffn_kept_layer)
    return outs


@functools.cache
def _causal_attend(cfg):
    """Dense causal attention with each layer's window (a Python int in the unrolled loop, read from an
    [L] array under a traced layer index); state = positions [B, T], as `llama.dense_attend`. One object per
    config."""
    def attend(layer, q, k, v, pos):
        from jaxkv.models.attention import dense_attention

        window = cfg.layer_windows[layer] if isinstance(layer, int) else jnp.asarray(
            cfg.layer_windows, jnp.int32)[layer]
        return dense_attention(q, k, v, pos, pos, window=window), pos

    return attend


def _ffn_kept_layer(p, cfg, layer, x, positions, freqs, attend, outs, reduce=None):
    """`llama.decoder_layer` that also writes the layer's FFN output into outs [L, T, hidden]."""
    from jaxkv.models import llama

    q, k, v = llama._qkv(p, cfg, llama.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), positions, freqs)
    a, _ = attend(layer, q, k, v, positions)
    a = a.reshape(*a.shape[:2], -1) @ p["wo"]
    x = x + (a + p["bo"] if cfg.o_bias else a)
    mlp = llama.ffn(p, cfg, x)
    return x + mlp, outs.at[layer].set(mlp[0])
