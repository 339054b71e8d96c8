"""SpeContext (Xu et al. 2025, arXiv 2512.00722): a distilled retrieval head picks per-head KV each step.

The retrieval head is the pruned draft model of the paper: the target's own embedding path (its embedding
and its first ``tap_layer`` decoder layers, frozen, computed by the target's forward anyway) followed by
one small attention head that keeps only an RMSNorm and the Q/K projections (no V, O, MLP or LM head).
It owns a full key cache (post-RoPE, one entry per position). Each decode step its query scores every
past position per query head (post-softmax attention weights, Eq. 1), the GQA group's weights are
max-reduced to one row per KV head (Fig. 5), and the top ``budget`` positions of each KV head are read by
**every** target layer from ``tap_layer`` on (global, head-level selection). Layers before ``tap_layer``
run dense: they are the head's input. Distillation (`python -m tools.distil_retrieval_head`) fits the head's
attention to the target's layer-averaged attention (docs/specontext.md says why not the logit KL).

A *lagged* head (``key_layer > tap_layer``, docs/specontext.md "The lagged head") reads a deeper stream
for its keys than the step can afford before selecting: each token's key comes from the stream after
``key_layer`` layers, written when the token passes that layer, and the step's query reads the current
stream after ``tap_layer`` layers together with the *previous* token's ``key_layer`` stream (the paper's
head reads the target's previous-step features, after EAGLE-3). Its state is then ``(keys, last)``: the key
cache and each row's last ``key_layer`` stream [R, hidden].

The head ships next to its model (``<model>/retrieval_head/``: ``config.json`` + ``head.safetensors``);
`load_head` reads it, `save_head` writes it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.models import rope
from jaxkv.models.llama import rms_norm
from jaxkv.policies.registry import register
from jaxkv.policies.retrieve.base import RetrievalPolicy
from pallas_kernels.retrieval_logits import retrieval_logits

HEAD_DIR = "retrieval_head"
FORMAT = "jaxkv.retrieval_head/v1"


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """Static shape of a retrieval head (hashable: it is part of compiled programs)."""

    hidden_size: int
    num_heads: int  # query heads; a multiple of num_kv_heads (the target's KV heads)
    num_kv_heads: int
    head_dim: int
    tap_layer: int  # the head reads the residual stream after the target's first `tap_layer` layers
    rope_theta: float
    rms_norm_eps: float = 1e-5
    model_id: str = ""  # the target it was distilled from
    key_layer: int | None = None  # keys read the stream after this many layers (None: tap; > tap: lagged)

    def __post_init__(self):
        if self.key_layer is not None and self.key_layer < self.tap_layer:
            raise ValueError(f"retrieval head: key_layer {self.key_layer} is below tap_layer "
                             f"{self.tap_layer}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"retrieval head: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"retrieval head: head_dim must be even for RoPE (got {self.head_dim})")

    @classmethod
    def for_model(cls, cfg, *, tap_layer: int = 1, num_heads: int | None = None, head_dim: int | None = None,
                  model_id: str = "", key_layer: int | None = None) -> HeadConfig:
        """A head matching a target ModelConfig (its KV heads, hidden size and RoPE base)."""
        if not 0 <= tap_layer < cfg.num_layers:
            raise ValueError(f"tap_layer must be in [0, {cfg.num_layers}) (got {tap_layer})")
        if key_layer is not None and not tap_layer <= key_layer < cfg.num_layers:
            raise ValueError(f"key_layer must be in [tap_layer, {cfg.num_layers}) (got {key_layer})")
        return cls(cfg.hidden_size, num_heads or cfg.num_heads, cfg.num_kv_heads, head_dim or cfg.head_dim,
                   tap_layer, float(cfg.rope_theta), float(cfg.rms_norm_eps), model_id,
                   None if key_layer == tap_layer else key_layer)

    @property
    def keys_layer(self) -> int:
        """The stream the keys read: after this many target layers."""
        return self.tap_layer if self.key_layer is None else self.key_layer

    @property
    def lagged(self) -> bool:
        """Keys from a deeper stream than the step's query; the query adds the previous token's key stream."""
        return self.keys_layer > self.tap_layer

    @property
    def freqs(self) -> np.ndarray:
        d = self.head_dim
        return (1.0 / (self.rope_theta ** (np.arange(0, d, 2) / d))).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RetrievalHead:
    """Parameters {"norm": [H], "wq": [H, Hq*Dr], "wk": [H, Hkv*Dr]} and their static config. A lagged head
    adds "norm_k" [H] (its key stream's norm) and its "wq" is [2H, Hq*Dr] (current stream, previous key
    stream)."""

    params: dict
    config: HeadConfig = dataclasses.field(metadata={"static": True})


def param_shapes(config: HeadConfig) -> dict:
    h, d = config.hidden_size, config.head_dim
    shapes = {"norm": (h,), "wq": (2 * h if config.lagged else h, config.num_heads * d),
              "wk": (h, config.num_kv_heads * d)}
    if config.lagged:
        shapes["norm_k"] = (h,)
    return shapes


def init_head(config: HeadConfig, key: jax.Array, scale: float = 0.02) -> RetrievalHead:
    kq, kk = jax.random.split(key)
    shapes = param_shapes(config)
    params = {"norm": jnp.ones(shapes["norm"], jnp.float32),
              "wq": scale * jax.random.normal(kq, shapes["wq"], jnp.float32),
              "wk": scale * jax.random.normal(kk, shapes["wk"], jnp.float32)}
    if config.lagged:
        params["norm_k"] = jnp.ones(shapes["norm_k"], jnp.float32)
    return RetrievalHead(params, config)


def head_keys(head: RetrievalHead, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [S, T, hidden] (the stream after `keys_layer` layers), positions [S, T] -> post-RoPE keys
    [S, T, Hkv, Dr] float32."""
    c, p = head.config, head.params
    s, t, _ = x.shape
    h = rms_norm(x.astype(jnp.float32), p["norm_k" if c.lagged else "norm"], c.rms_norm_eps)
    return rope.apply_rope((h @ p["wk"]).reshape(s, t, c.num_kv_heads, c.head_dim), positions, c.freqs)


def head_query(head: RetrievalHead, x: jax.Array, positions: jax.Array, prev: jax.Array | None = None
               ) -> jax.Array:
    """x [S, T, hidden] (the stream after `tap_layer` layers) -> post-RoPE queries [S, T, Hq, Dr] float32.
    A lagged head also reads ``prev`` [S, T, hidden]: each query token's predecessor's `keys_layer` stream."""
    c, p = head.config, head.params
    s, t, _ = x.shape
    h = rms_norm(x.astype(jnp.float32), p["norm"], c.rms_norm_eps)
    if c.lagged:
        if prev is None:
            raise ValueError("a lagged retrieval head's query needs the previous token's key stream")
        h = jnp.concatenate([h, rms_norm(prev.astype(jnp.float32), p["norm_k"], c.rms_norm_eps)], axis=-1)
    return rope.apply_rope((h @ p["wq"]).reshape(s, t, c.num_heads, c.head_dim), positions, c.freqs)


def head_qk(head: RetrievalHead, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [S, T, hidden] (the stream after `tap_layer` layers), positions [S, T] -> post-RoPE
    q [S, T, Hq, Dr], k [S, T, Hkv, Dr] in float32 (a head whose query and keys read one stream)."""
    if head.config.lagged:
        raise ValueError("a lagged retrieval head reads two streams: use head_query and head_keys")
    return head_query(head, x, positions), head_keys(head, x, positions)


def head_logits(head: RetrievalHead, q: jax.Array, keys: jax.Array) -> jax.Array:
    """q [S, T, Hq, Dr], keys [S, N, Hkv, Dr] -> scaled logits [S, Hkv, G, T, N] (float32)."""
    c = head.config
    s, t = q.shape[:2]
    qg = q.reshape(s, t, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
    return jnp.einsum("sthgd,snhd->shgtn", qg, keys, precision=jax.lax.Precision.HIGHEST) * c.head_dim ** -0.5


def group_weights(logits: jax.Array, visible: jax.Array) -> jax.Array:
    """logits [S, Hkv, G, T, N], visible [S, T, N] -> [S, Hkv, T, N]: per-query-head softmax over the
    visible keys, then the max over the GQA group (post-softmax, as the paper's "attention weights")."""
    z = jnp.where(visible[:, None, None], logits, -jnp.inf)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.where(visible[:, None, None], jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    return jnp.max(probs, axis=2)


def init_state(head: RetrievalHead, num_seqs: int, max_len: int, dtype=jnp.float32):
    """The head's key cache [S, N, Hkv, Dr] (float32 unless asked), slot i = position i; a lagged head's
    state is (that cache, each row's last key-stream vector [S, hidden] float32)."""
    c = head.config
    keys = jnp.zeros((num_seqs, max_len, c.num_kv_heads, c.head_dim), dtype)
    return (keys, jnp.zeros((num_seqs, c.hidden_size), jnp.float32)) if c.lagged else keys


def own_key_lag(head: RetrievalHead) -> int:
    """1 for a lagged head: its query scores keys before the current token's (written later in the step;
    the read rule forces the current token anyway), 0 when the step's own key is scored too."""
    return int(head.config.lagged)


def key_cache(state) -> jax.Array:
    return state[0] if isinstance(state, tuple) else state


def write_keys(head: RetrievalHead, state: jax.Array, x: jax.Array, positions: jax.Array):
    """Appends the keys of x [S, T, hidden] at positions [S, T]; returns (state, q [S, T, Hq, Dr])."""
    q, k = head_qk(head, x, positions)
    rows = jnp.arange(state.shape[0])[:, None]
    return state.at[rows, positions].set(k.astype(state.dtype), mode="drop"), q


def observe_lagged(head: RetrievalHead, state, x: jax.Array, positions: jax.Array, rows: jax.Array):
    """A lagged head's state update from ragged tokens: x [T, hidden] (the key stream), positions [T], rows
    [T] (out of range: dropped). Writes each token's key and, per row, the stream of its newest token (the
    next step's query reads it)."""
    keys, last = state
    k = head_keys(head, x[None], positions[None])[0]
    keys = keys.at[rows, positions].set(k.astype(keys.dtype), mode="drop")
    r = last.shape[0]
    ok = (rows >= 0) & (rows < r) & (positions < keys.shape[1])
    newest = jnp.full((r + 1,), -1, jnp.int32).at[jnp.where(ok, rows, r)].max(positions)
    take = ok & (positions == newest[jnp.where(ok, rows, r)])
    last = last.at[jnp.where(take, rows, r)].set(x.astype(last.dtype), mode="drop")
    return keys, last


def successor_spread(scores: jax.Array, spread: int, weight: float = 1.0) -> jax.Array:
    """scores [..., N] -> max(scores[j], weight * max(scores[j - spread .. j - 1])) per slot j."""
    if spread == 0:
        return scores
    out, shifted = scores, scores
    for _ in range(spread):
        shifted = jnp.concatenate([jnp.zeros_like(shifted[..., :1]), shifted[..., :-1]], axis=-1)
        out = jnp.maximum(out, weight * shifted)
    return out


@register
@dataclasses.dataclass(frozen=True)
class SpeContext(RetrievalPolicy):
    """Head-level, layer-shared top-``budget`` selection by the distilled retrieval head (paper defaults: no
    forced sinks or recent tokens besides the current one)."""

    name = "specontext"
    # How the engine scores the key cache (`score_rows`): "auto" (the kernel on a GPU, else the XLA form),
    # "xla" (a fused gather + multiply-reduce), or the retrieval-logits kernel ("pallas"; "reference" = its
    # jnp twin). On an H200 the kernel reads the cache at about twice the XLA form's rate (benchmarks.md).
    scores_impl: str = "auto"
    # The dtype of the head's key cache; "auto" = the model's KV dtype (`for_model`). Scoring reads the
    # whole cache every step, so bfloat16 halves its bytes; logits still accumulate in float32.
    key_dtype: str = "auto"
    # Successor spread: a slot also scores ``spread_weight`` x the best of the ``spread`` slots before it, so
    # the tokens right after a key the head finds rank with it (an induction read needs the token *after*
    # the match; docs/specontext.md "Successor spread"). 0 = the paper's rule.
    spread: int = 0
    spread_weight: float = 1.0
    # The head's directory (`save_head`'s layout); "" = the one shipped beside the model. A model loaded from
    # a GGUF file or a catalog name has no directory of its own to ship one in.
    head_dir: str = ""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.spread, bool) or not isinstance(self.spread, int) or not 0 <= self.spread <= 64:
            raise ValueError(f"specontext: spread must be an integer in [0, 64] (got {self.spread!r})")
        if not 0.0 < float(self.spread_weight) <= 1.0:
            raise ValueError(f"specontext: spread_weight must lie in (0, 1] (got {self.spread_weight!r})")
        if self.scores_impl not in ("auto", "xla", "pallas", "reference"):
            raise ValueError(f"specontext: scores_impl must be 'auto', 'xla', 'pallas' or 'reference' "
                             f"(got {self.scores_impl!r})")
        if self.key_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"specontext: key_dtype must be 'auto', 'float32' or 'bfloat16' "
                             f"(got {self.key_dtype!r})")

    def select(self, scores: jax.Array, q_pos: jax.Array):
        return super().select(successor_spread(scores, self.spread, self.spread_weight), q_pos)

    def for_model(self, model) -> SpeContext:
        if self.key_dtype != "auto":
            return self
        dtype = jnp.dtype(jax.tree.leaves(model.params)[0].dtype)
        return dataclasses.replace(self, key_dtype="bfloat16" if dtype == jnp.bfloat16 else "float32")

    def tap_layer(self, head: RetrievalHead) -> int:
        return head.config.tap_layer

    def key_layer(self, head: RetrievalHead) -> int:
        return head.config.keys_layer

    def init_state(self, head: RetrievalHead, num_seqs: int, max_len: int):
        dtype = "float32" if self.key_dtype == "auto" else self.key_dtype  # unresolved (no for_model): fp32
        return init_state(head, num_seqs, max_len, jnp.dtype(dtype))

    def observe(self, head: RetrievalHead, state, x, positions):
        if head.config.lagged:
            s, t = positions.shape
            rows = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], (s, t))
            return observe_lagged(head, state, x.reshape(s * t, -1), positions.reshape(-1), rows.reshape(-1))
        return write_keys(head, state, x, positions)[0]

    def load_params(self, model) -> RetrievalHead:
        return load_head(self.head_dir, model) if self.head_dir else load_for_model(model)

    def observe_tokens(self, head: RetrievalHead, state, x, positions, rows):
        rows = jnp.where(rows >= 0, rows, key_cache(state).shape[0])  # out of bounds: dropped
        if head.config.lagged:
            return observe_lagged(head, state, x, positions, rows)
        k = head_keys(head, x[None], positions[None])
        return state.at[rows, positions].set(k[0].astype(state.dtype), mode="drop")

    def _query(self, head: RetrievalHead, state, x, positions, rows):
        """The decode query [S, 1, Hq, Dr] of each row (x [S, 1, hidden] the stream after `tap_layer`)."""
        if not head.config.lagged:
            return head_query(head, x, positions)
        return head_query(head, x, positions, state[1][rows][:, None])

    def scores(self, head: RetrievalHead, state, x, positions):
        if head.config.lagged:  # the step's keys are written at key_layer (`observe`), after the selection
            q = self._query(head, state, x[:, -1:], positions[:, -1:], jnp.arange(x.shape[0]))
        else:
            state, q = write_keys(head, state, x, positions)
            q = q[:, -1:]  # the decode query
        keys = key_cache(state)
        n = keys.shape[1]
        visible = jnp.arange(n)[None, None, :] <= positions[:, -1:, None] - own_key_lag(head)  # [S, 1, N]
        w = group_weights(head_logits(head, q, keys), visible)  # [S, Hkv, 1, N]
        return w[:, :, 0], state

    def score_rows(self, head: RetrievalHead, state, x, positions, rows, num_slots):
        """The decode query's weights over the state rows read in place: one multiply-reduce over the head
        dim that XLA fuses with the row gather, instead of copying the rows out and writing the step's keys
        (already in the state) into the copy (docs/specontext.md has the timings)."""
        c = head.config
        q = self._query(head, state, x[:, -1:], positions[:, -1:], rows)  # [S, 1, Hq, Dr]
        keys = key_cache(state)
        s = q.shape[0]
        qg = q.reshape(s, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim) * c.head_dim ** -0.5
        impl = self.scores_impl
        if impl == "auto":
            impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        if impl == "xla":
            kr = keys[rows, :num_slots]  # [S, N, Hkv, Dr]: a gather XLA fuses into the reduce below
            logits = jnp.sum(qg[:, None] * kr[:, :, :, None, :], axis=-1)  # [S, N, Hkv, G]
            logits = jnp.moveaxis(logits, 1, -1)[:, :, :, None]  # [S, Hkv, G, 1, N]
        else:
            logits = retrieval_logits(qg, keys, rows, positions[:, -1], num_slots=num_slots,
                                      implementation=impl)[:, :, :, None]
        visible = jnp.arange(num_slots)[None, None, :] <= positions[:, -1:, None] - own_key_lag(head)
        return group_weights(logits, visible)[:, :, 0]


# ---------------------------------------------------------------------------------------------- files


def save_head(path: str | Path, head: RetrievalHead, meta: dict | None = None) -> Path:
    """Writes ``config.json`` (format, shape, provenance in ``meta``) and ``head.safetensors``."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"format": FORMAT, **dataclasses.asdict(head.config), "meta": meta or {}}
    (path / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    save_file({k: np.asarray(v, np.float32) for k, v in head.params.items()}, str(path / "head.safetensors"))
    return path


def load_head(path: str | Path, model=None) -> RetrievalHead:
    """Reads a head written by `save_head`. With `model` (a `jaxkv.load` result), also checks the head
    was distilled from that model (same shapes and model id)."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "head.safetensors").is_file():
        raise ValueError(f"{path} is not a retrieval head directory (needs config.json + head.safetensors)")
    raw = json.loads((path / "config.json").read_text())
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path}/config.json: format {raw.get('format')!r}, expected {FORMAT!r}")
    fields = {f.name for f in dataclasses.fields(HeadConfig)}
    config = HeadConfig(**{k: v for k, v in raw.items() if k in fields})
    arrays = load_file(str(path / "head.safetensors"))
    h = config.hidden_size
    want = param_shapes(config)
    got = {k: tuple(v.shape) for k, v in arrays.items()}
    if got != want:
        raise ValueError(f"{path}/head.safetensors: tensors {got} do not match config.json {want}")
    head = RetrievalHead({k: jnp.asarray(v) for k, v in arrays.items()}, config)
    if model is not None:
        mc = model.config
        fits = (mc.hidden_size, mc.num_kv_heads) == (h, config.num_kv_heads)
        if not fits or config.keys_layer >= mc.num_layers:
            raise ValueError(f"retrieval head {path} does not fit model {model.model_id}")
        if config.model_id and config.model_id != model.model_id:
            raise ValueError(f"retrieval head {path} was distilled from {config.model_id}, "
                             f"not {model.model_id}")
    return head


def load_for_model(model) -> RetrievalHead:
    """The head shipped beside a loaded model (``<model.path>/retrieval_head``)."""
    return load_head(Path(model.path) / HEAD_DIR, model)
