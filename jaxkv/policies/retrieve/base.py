"""The retrieval seam: each decode step a policy picks, per KV head, the slots attention reads.

A retrieval method never evicts. Every decode step it returns, per (sequence, KV head), up to ``budget``
slot indices of the head's cache (shared by every layer the policy covers); attention of those layers then
reads only the selected slots (`jaxkv.policies.retrieve.decode.selected_attention`). The KV outside the
selection may live anywhere (host memory in the SpeContext host tier, docs/specontext.md).

A method is one frozen dataclass (hyperparameters as validated fields, hashable so it is a static jit
argument) with one pure-jnp device hook:

* ``scores(head, state, x, positions) -> (scores [S, Hkv, N], state)`` sees the step's input (``x``: the
  residual stream after the policy's ``tap_layer`` first layers, [S, T, hidden]; ``positions`` [S, T]),
  updates its own device state (e.g. a retrieval-head key cache) and scores every slot for the **last**
  query of each row; higher = more worth reading. ``head`` is the method's parameter pytree (None when it
  has none), passed as an argument so weights are never static.

A *layer-wise* method (``layer_wise = True``, Quest) picks pages inside each layer instead: `read_pages`
from the layer's query and the per-page state it declares (``page_state``), which the engine keeps beside
the pool. Either kind's state is defined here, with the method; the engine only keeps and passes it.

The shared rule `select` forces the current token, the first ``sink`` and the newest ``recent`` positions,
then fills the budget with the best-scoring visible slots.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    """Per-head read sets: ``idx[s, h, :count[s, h]]`` ascending slot indices, the rest padding (0)."""

    idx: jax.Array  # [S, Hkv, B] int32
    count: jax.Array  # [S, Hkv] int32

    def mask(self) -> jax.Array:
        """[S, Hkv, B] bool: entries that are real selections."""
        return jnp.arange(self.idx.shape[-1]) < self.count[..., None]


@dataclasses.dataclass(frozen=True)
class RetrievalPolicy:
    """Base of the retrieval methods. Subclasses set `name` and override `scores`.

    budget: slots read per KV head per decode step (the current token, sinks and recent tokens included).
    sink: first positions always read. recent: newest positions always read (besides the current token,
    which is always read).
    """

    name: ClassVar[str] = "retrieval-base"
    kind: ClassVar[str] = "retrieval"  # the engine decodes its requests through the selection seam
    budget: int = 1024
    sink: int = 0
    recent: int = 0

    def __post_init__(self):
        for field in ("budget", "sink", "recent"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{self.name}: {field} must be a non-negative integer (got {v!r})")
        if self.budget < 1:
            raise ValueError(f"{self.name}: budget must be >= 1 token per KV head (got {self.budget})")
        if self.sink + self.recent + 1 > self.budget:
            raise ValueError(f"{self.name}: sink + recent + 1 (current token) = "
                             f"{self.sink + self.recent + 1} exceeds the budget {self.budget}")

    # ---- capabilities the decode path / engine read (never class names) ------------------------------
    def tap_layer(self, head) -> int:
        """Layers [0, tap_layer) run dense over the whole cache; `scores` sees the stream after them and the
        selection applies to layers tap_layer.. (0 = the selection depends on the step's input alone)."""
        return 0

    def key_layer(self, head) -> int:
        """Where the method's state records each token (`observe` / `observe_tokens` see the stream after this
        many layers): `tap_layer` unless the method keys a deeper stream than it selects from (a lagged
        SpeContext head); then the step selects at `tap_layer` and records the token later in the step."""
        return self.tap_layer(head)

    def for_model(self, model) -> RetrievalPolicy:
        """This policy with its model-dependent fields resolved (e.g. a dtype "auto"); the engine and the
        library decode call it once per policy and model."""
        return self

    def init_state(self, head, num_seqs: int, max_len: int):
        """The method's device state for `num_seqs` rows of up to `max_len` slots (None when stateless)."""
        return None

    # Which seam the engine runs: a *shared* policy scores once per step after `tap_layer` layers and every
    # later layer reads the one selection (`score_rows` / `select`); a *layer-wise* policy picks pages
    # inside each layer from that layer's query (`read_pages`).
    layer_wise: ClassVar[bool] = False
    # A per-page state the method keeps beside the pool (None: none), e.g. Quest's key bounds: a class with
    # ``init(num_pages, head_dim, dtype)`` -> a pytree of arrays with a leading page axis, and
    # ``update(state, k [T, Hkv, D], slots [T, Hkv], page_size)`` -> state. The engine makes one per class
    # on first use and updates it at every K write of a step that holds a request of such a method.
    page_state: ClassVar[type | None] = None

    def read_pages(self, page_state, page_table: jax.Array, lengths: jax.Array, q: jax.Array,
                   q_pos: jax.Array, page_size: int):
        """Layer-wise methods: the pages one layer reads. page_table [S, Hkv, P] page ids of each head's
        list (-1 padding), lengths [S, Hkv], q [S, Hq, D] the layer's query, q_pos [S] -> (page ids
        [S, Hkv, n], keep [S, Hkv, n, page_size] bool: the slots attention reads)."""
        raise NotImplementedError(f"{self.name} is not a layer-wise retrieval method")

    def load_params(self, model):
        """The method's parameter pytree for a loaded model (e.g. the retrieval head shipped beside it)."""
        return None

    def observe_tokens(self, head, state, x: jax.Array, positions: jax.Array, rows: jax.Array):
        """Engine form of `observe`: x [T, hidden] (ragged tokens after `tap_layer`), positions [T], rows [T]
        the state row of each token (-1 = not a request of this method: dropped)."""
        return state

    # ---- device side (pure jnp) ---------------------------------------------------------------------
    def observe(self, head, state, x: jax.Array, positions: jax.Array):
        """Prefill: record the prompt tokens in the method's state (x [S, T, hidden] after `tap_layer`)."""
        return state

    def scores(self, head, state, x: jax.Array, positions: jax.Array):
        raise NotImplementedError

    def score_rows(self, head, state, x: jax.Array, positions: jax.Array, rows: jax.Array, num_slots: int):
        """Engine form of `scores` for one decode query per row: the step's tokens are already in `state`
        (`observe_tokens`), ``rows`` [S] is the state row of each query row, and only the first
        ``num_slots`` slots are scored. Returns scores [S, Hkv, num_slots]. The default gathers the rows
        (a copy) and calls `scores`; a method overrides it to read its state in place."""
        hs = None if state is None else state[rows, :num_slots]
        return self.scores(head, hs, x, positions)[0]

    def select(self, scores: jax.Array, q_pos: jax.Array) -> Selection:
        return select(scores, q_pos, budget=self.budget, sink=self.sink, recent=self.recent)


def _order_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-inf lowest, +inf highest; NaN must be removed first)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(1 << 31))


def kth_largest_key(key: jax.Array, k: jax.Array, digit_bits: int = 2) -> jax.Array:
    """Per row of key [..., N] (uint32), the k-th largest value (k [...] >= 1): a radix select, most
    significant digit first, each pass one fused count of the row against the 2^digit_bits - 1 candidate
    prefixes (32 / digit_bits passes that read the row once each; no sort)."""
    if 32 % digit_bits:
        raise ValueError(f"digit_bits must divide 32 (got {digit_bits})")
    prefix = jnp.zeros(key.shape[:-1], jnp.uint32)
    steps = jnp.arange(1, 1 << digit_bits, dtype=jnp.uint32)  # candidate digits 1..2^b-1
    for shift in range(32 - digit_bits, -1, -digit_bits):
        cand = prefix[..., None] | (steps << shift)  # [..., C]
        cnt = jnp.sum(key[..., None, :] >= cand[..., :, None], axis=-1, dtype=jnp.int32)  # [..., C]
        digit = jnp.sum(cnt >= k[..., None], axis=-1).astype(jnp.uint32)  # largest digit with >= k above
        prefix = prefix | (digit << shift)
    return prefix


def _rank(scores, q_pos, k: int, sink: int, recent: int):
    """The read rule's ranking, shared by `select` and its twin: (slot index [N], rank [S, Hkv, N] with
    forced slots +inf and invisible or NaN ones -inf, count [S, Hkv] = min(k, q_pos + 1))."""
    i = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    p = q_pos[:, None, None]
    visible = i <= p
    forced = visible & ((i == p) | (i < sink) | (i >= p - recent))
    s = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    count = jnp.broadcast_to(jnp.minimum(k, q_pos + 1).astype(jnp.int32)[:, None], scores.shape[:2])
    return i, jnp.where(forced, jnp.inf, s), count  # forced first (at most budget of them), invisible last


def select(scores: jax.Array, q_pos: jax.Array, *, budget: int, sink: int = 0, recent: int = 0,
           digit_bits: int = 2) -> Selection:
    """The shared read rule for one decode query per row.

    scores [S, Hkv, N] float (slot i holds position i); q_pos [S] int32 position of the current token (its
    slot must already hold its K/V). Visible slots are 0..q_pos; the current token, positions < sink and
    positions > q_pos - 1 - recent are forced; the rest of the budget goes to the highest scores (ties to
    the lower index). Returns ascending indices, count = min(budget, q_pos + 1) per head.
    """
    k = min(budget, scores.shape[-1])
    i, rank, count = _rank(scores, q_pos, k, sink, recent)
    # The count-th largest rank, then every slot above it and the lowest-index ties at it: no top-k sort,
    # and the taken slots come out ascending by a cumulative count.
    key = _order_key(rank)
    kth = kth_largest_key(key, count, digit_bits)[..., None]
    above = key > kth
    ties = (key == kth) & (jnp.cumsum(key == kth, axis=-1)
                           <= count[..., None] - jnp.sum(above, -1, keepdims=True))
    take = above | ties
    dest = jnp.where(take, jnp.cumsum(take, axis=-1) - 1, k)
    lead = jnp.indices(dest.shape[:-1] + (1,), sparse=True)[:-1]
    idx = jnp.zeros(dest.shape[:-1] + (k,), jnp.int32).at[(*lead, dest)].set(
        jnp.broadcast_to(i, dest.shape), mode="drop")
    if k < budget:
        idx = jnp.pad(idx, [(0, 0), (0, 0), (0, budget - k)])
    return Selection(idx=idx, count=count)


def overlap(prev: Selection, now: Selection) -> jax.Array:
    """[S, Hkv] int32: slots of `now` that `prev` already held (what an elastic buffer need not load)."""
    hit = (now.idx[..., :, None] == prev.idx[..., None, :]) & prev.mask()[..., None, :]
    return jnp.sum(jnp.any(hit, axis=-1) & now.mask(), axis=-1).astype(jnp.int32)


def select_sorted(scores: jax.Array, q_pos: jax.Array, *, budget: int, sink: int = 0, recent: int = 0
                  ) -> Selection:
    """`select` by `lax.top_k` and a sort: its twin (same rule, same ties), kept to check it and to time it
    against."""
    k = min(budget, scores.shape[-1])
    _, rank, count = _rank(scores, q_pos, k, sink, recent)
    _, top = jax.lax.top_k(rank, k)  # [S, Hkv, k] best first, ties to the lower index
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(jnp.arange(k) < count[..., None], top, big), axis=-1)
    idx = jnp.where(idx == big, 0, idx).astype(jnp.int32)
    if k < budget:
        idx = jnp.pad(idx, [(0, 0), (0, 0), (0, budget - k)])
    return Selection(idx=idx, count=count)

