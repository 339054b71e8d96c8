"""One functional Llama-family model: Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3.

Parameters are a plain pytree (weights stored [in, out], so `x @ w`):

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied),
     "layers": [ {"attn_norm": [H], "wq": [H, Hq*D], "wk": [H, Hkv*D], "wv": [H, Hkv*D], "wo": [Hq*D, H],
                  "bq"/"bk"/"bv": [..] (cfg.qkv_bias), "bo": [H] (cfg.o_bias),
                  "q_norm"/"k_norm": [D] (cfg.qk_norm),
                  "mlp_norm": [H], "w_gate": [H, I], "w_up": [H, I], "w_down": [I, H]}, ... ]}

or the same dicts as `SharedLayers` (one traced layer body called per layer), or, after `stack_layers`,
"layers" as one dict whose leaves carry a leading layer axis L (run under one `lax.scan`); the note above
`forward` says what each form costs.

Attention is a callback (`AttendFn`), so the dense `.logits` path and the engine's paged path share the
layer code. Per-layer differences (windows, head classes, page-table rows) are `[L, ...]` arrays the callback
indexes with its `layer` (a Python int in the unrolled form, a traced int32 scalar under the scan), or
`layer_xs` that the loop slices for it. Norms and RoPE run in fp32; matmuls in the parameter dtype.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.config import ModelConfig
from jaxkv.models import rope
from jaxkv.models.attention import dense_attention

State = Any
# (layer, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], state[, xs]) -> (out [B,T,Hq,D], state); `layer` is an
# int32 scalar (traced under the scan); `xs` is this layer's slice of `forward(layer_xs=...)` when given.
AttendFn = Callable[..., tuple[jax.Array, State]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32; the normalised value is cast back before the weight, as transformers does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _qkv(p: dict, cfg: ModelConfig, h: jax.Array, positions: jax.Array, freqs):
    b, t, _ = h.shape
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return rope.apply_rope(q, positions, freqs), rope.apply_rope(k, positions, freqs), v


# Three layouts of "layers", three loops:
# * a list of per-layer dicts (what `jaxkv.load` returns) runs unrolled: every layer traced and lowered on
#   its own, each layer's weights their own buffers;
# * `SharedLayers` (the same dicts) runs one jitted layer body, traced and lowered once per step and called
#   per layer with that layer's weights and its index (traced, as under the scan); XLA inlines the calls,
#   so the compiled step is the unrolled one while tracing and lowering cost about one layer (SmolLM2-135M,
#   30 layers, CPU: trace 2.6 -> 0.4 s, lowering 1.6 -> 0.4 s for the same steps; a forward split at taps,
#   e.g. the retrieval decode, reuses the body across its ranges and has one per distinct attend);
# * stacked leaves (`stack_layers`) run under one rolled `lax.scan`: on an H100 a 1B step variant compiled
#   no faster (3.9 s against 3.5 s unrolled) and the decode step took 4.2 against 2.1 ms at batch 32 (XLA's
#   dynamic-slice fusion flag did not change it): slices of stacked weights feeding GEMMs are copied every
#   step.
# A forward whose layer body is too large to compile L times runs `SharedLayers` rolled instead
# (`run_layers(rolled=True)`: one `lax.fori_loop`, each layer's weights picked by a switch; the RedKnot
# reuse pass).


@jax.tree_util.register_pytree_node_class
class SharedLayers(tuple):
    """Per-layer parameter dicts that `forward` runs through one shared layer body (see above)."""

    def tree_flatten(self):
        return tuple(self), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children)


def forward(
    params: dict, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, attend: AttendFn, state: State,
    reduce: Callable[[jax.Array], jax.Array] | None = None, layer_xs: Any = None, rolled: bool = False,
) -> tuple[jax.Array, State]:
    """tokens, positions int32[B, T] -> (hidden [B, T, hidden] after the final norm, state).

    The layers run unrolled (a list), through one shared layer body (`SharedLayers`) or under `lax.scan`
    (stacked layers).
    `attend(layer, q, k, v, state)` receives q, k after q/k-norm and RoPE at `positions`; with `layer_xs`
    (a pytree of `[L, ...]` arrays) it is called as `attend(layer, q, k, v, state, xs)` with this layer's
    slice. `reduce` (tensor parallelism, jaxkv.parallel) sums the shards' partial O and down projections.
    `rolled`: `SharedLayers` as one rolled loop (`run_layers`).
    """
    freqs = rope.inv_freq(cfg)
    x = params["embed"][tokens]
    x, state = run_layers(params["layers"], cfg, x, positions, freqs, attend, state, reduce, layer_xs,
                          rolled=rolled)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), state


def run_layers(layers, cfg: ModelConfig, x: jax.Array, positions: jax.Array, freqs, attend: AttendFn,
               state: State, reduce=None, layer_xs: Any = None, *, start: int = 0, stop: int | None = None,
               per_layer: Sequence | None = None, layer: Callable = None,
               rolled: bool = False) -> tuple[jax.Array, State]:
    """Layers [start, stop) (default: every layer) over the residual stream x: unrolled for a list of layers,
    one shared layer body for `SharedLayers`, one `lax.scan` for stacked layers.

    `rolled` (`SharedLayers` only): the range runs as one `lax.fori_loop` whose iteration takes its layer's
    weights through a switch over the range's layers (`_rolled_layers`), so XLA compiles the layer body
    once instead of inlining it per layer; for a body too large to compile L times.

    A forward that runs plain code between layers (a tap: "before layer k") calls this once per range; with
    `SharedLayers` every range run with the same `attend` (and `layer`) in one trace calls the same jitted
    body, so the trace holds one layer function per distinct attend, not one per range. `layer_xs` ([L, ...]
    arrays) is sliced at the absolute layer index. `per_layer` (one pytree per layer of the range, e.g. a
    per-layer buffer kept as separate arrays): the attend sees `(state, item)` as its state and returns the
    pair; the result's state is then `(state, items)` (the scan stacks the items, a copy; the other loops
    hand each layer its own arrays). `layer` replaces `decoder_layer` (same signature)
    for a forward whose layer is not the plain decoder layer (e.g. one that keeps each FFN output); `attend`
    may then be None when that layer does its own attention."""
    layer = decoder_layer if layer is None else layer
    stop = cfg.num_layers if stop is None else stop
    items = None if per_layer is None else list(per_layer)
    if items is not None and len(items) != stop - start:
        raise ValueError(f"per_layer has {len(items)} items for layers [{start}, {stop})")
    if start >= stop:
        return x, (state if items is None else (state, ()))
    if isinstance(layers, SharedLayers) and rolled and items is None:
        return _rolled_layers(layers, cfg, x, positions, freqs, attend, state, reduce, layer_xs, start, stop,
                              layer)
    if isinstance(layers, SharedLayers):
        call = _shared_layer(cfg, attend, reduce, layer_xs is not None, layer)
        for i in range(start, stop):
            xs = None if layer_xs is None else jax.tree.map(functools.partial(_take, i), layer_xs)
            st = state if items is None else (state, items[i - start])
            x, st = call(layers[i], jnp.int32(i), x, positions, freqs, st, xs)
            state = st if items is None else _keep_item(items, i - start, st)
        return x, (state if items is None else (state, tuple(items)))
    if isinstance(layers, list | tuple):
        for i in range(start, stop):
            take = functools.partial(_take, i)
            p = layers[i]
            fn = attend if layer_xs is None else functools.partial(_with_xs, attend,
                                                                   jax.tree.map(take, layer_xs))
            st = state if items is None else (state, items[i - start])
            x, st = layer(p, cfg, i, x, positions, freqs, fn, st, reduce)
            state = st if items is None else _keep_item(items, i - start, st)
        return x, (state if items is None else (state, tuple(items)))
    whole = (start, stop) == (0, cfg.num_layers)
    part, sliced = (layers, layer_xs) if whole else jax.tree.map(lambda a: a[start:stop], (layers, layer_xs))
    stacked = None if items is None else jax.tree.map(lambda *a: jnp.stack(a), *items)
    xs = (part, jnp.arange(start, stop, dtype=jnp.int32), sliced, stacked)

    def body(carry, xs):
        x, state = carry
        p, i, extra, item = xs
        fn = attend if layer_xs is None else (lambda *a: attend(*a, extra))
        st = state if items is None else (state, item)
        x, st = layer(p, cfg, i, x, positions, freqs, fn, st, reduce)
        return (x, st if items is None else st[0]), (None if items is None else st[1])

    (x, state), out = jax.lax.scan(body, (x, state), xs)
    if items is None:
        return x, state
    return x, (state, tuple(jax.tree.map(functools.partial(_take, j), out) for j in range(stop - start)))


def _rolled_layers(layers, cfg, x, positions, freqs, attend, state, reduce, layer_xs, start: int, stop: int,
                   layer: Callable):
    """Layers [start, stop) of `SharedLayers` as one `lax.fori_loop`: the compiled program holds one layer
    body whatever the layer count, where inlined shared bodies hold L (SmolLM2-135M's RedKnot reuse pass at
    8K on an H100: compile 78.8 -> 10.9 s; docs/benchmarks.md, "Reuse pass compile"). Each iteration takes
    its layer's weights through a switch over the range's layers, a copy of one layer's weights, never a
    stacked copy of the model: one extra pass over the
    weights per forward, which a small-row forward would feel and an 8K prefill did not (that pass: 168 ->
    143 ms)."""
    part = tuple(layers[start:stop])
    if len({jax.tree.structure(p) for p in part}) > 1:
        raise ValueError("a rolled layer loop needs every layer of the range to have the same parameters")
    pick = [functools.partial(_take, j) for j in range(len(part))]

    def body(i, carry):
        x, state = carry
        p = jax.lax.switch(i - start, pick, part)
        fn = attend if layer_xs is None else functools.partial(
            _with_xs, attend, jax.tree.map(functools.partial(_take, i), layer_xs))
        return layer(p, cfg, i, x, positions, freqs, fn, state, reduce)

    return jax.lax.fori_loop(start, stop, body, (x, state))


def _no_attend(*args):
    """The attend of a `layer` that does its own attention (`run_layers(attend=None, layer=...)`)."""
    raise TypeError("this layer loop was given no attend function")


def _keep_item(items: list, j: int, st):
    state, items[j] = st
    return state


# One jitted body per (attend, layer function) and loop options, alive as long as the attend: weak keys, and
# the body reaches both functions through weak references, so a finished trace frees its closures.
_SHARED_BODIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared_layer(cfg, attend, reduce, with_xs: bool, layer_fn=None):
    """One jitted layer body for every layer of one forward trace: traced and lowered on its first call,
    reused (one private function, called L times) by the others, also across the layer ranges of a forward
    split at taps; XLA inlines the calls when it compiles."""
    layer_fn = decoder_layer if layer_fn is None else layer_fn
    per_layer_fn = _SHARED_BODIES.setdefault(layer_fn, weakref.WeakKeyDictionary())
    bodies = per_layer_fn.setdefault(_no_attend if attend is None else attend, {})
    key = (cfg, reduce, with_xs)
    if key not in bodies:
        attend_ref, layer_ref = weakref.ref(_no_attend if attend is None else attend), weakref.ref(layer_fn)
        given = attend is not None

        def layer(p, i, x, positions, freqs, state, xs):
            fn = attend_ref() if given else None
            fn = fn if not with_xs else functools.partial(_with_xs, fn, xs)
            return layer_ref()(p, cfg, i, x, positions, freqs, fn, state, reduce)

        bodies[key] = jax.jit(layer)
    return bodies[key]


def _take(i, a):
    return a[i]


def _with_xs(attend, xs, layer, q, k, v, state):
    return attend(layer, q, k, v, state, xs)


def layer_params(params: dict, layer) -> dict:
    """One layer's parameters, from either layout (`layer` may be traced for stacked leaves)."""
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        return layers[layer]
    return jax.tree.map(lambda a: a[layer], layers)


def layer_list(params: dict) -> list[dict]:
    """Every layer's parameters as a list (for code that visits layers one by one in Python)."""
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        return list(layers)
    return [layer_params(params, i) for i in range(jax.tree.leaves(layers)[0].shape[0])]


def share_layers(params: dict) -> dict:
    """The same parameters with the layer list as `SharedLayers` (one traced layer body)."""
    return {**params, "layers": SharedLayers(layer_list(params))}


def unshare_layers(params: dict) -> dict:
    """The same parameters with the layers as a plain list (the unrolled loop)."""
    return {**params, "layers": list(layer_list(params))}


def stack_layers(params: dict) -> dict:
    """The same parameters with every per-layer leaf stacked on a leading layer axis (the scanned form)."""
    layers = params["layers"]
    if not isinstance(layers, list | tuple):
        return params
    return {**params, "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def decoder_layer(
    p: dict, cfg: ModelConfig, layer, x: jax.Array, positions: jax.Array, freqs, attend: AttendFn,
    state: State, reduce: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, State]:
    """One pre-norm decoder layer (parameters `p` of that layer) on the residual stream x [B, T, hidden]."""
    q, k, v = _qkv(p, cfg, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), positions, freqs)
    out, state = attend(layer, q, k, v, state)
    out = out.reshape(*out.shape[:2], -1) @ p["wo"]
    if reduce is not None:
        out = reduce(out)
    x = x + (out + p["bo"] if cfg.o_bias else out)
    mlp = ffn(p, cfg, x)
    return x + (reduce(mlp) if reduce is not None else mlp), state


def ffn(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The layer's pre-norm SwiGLU FFN output (what it adds to the residual stream x [..., hidden])."""
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    return (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]


def lm_head(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [..., H] -> float32 logits [..., vocab] (tied embeddings when there is no "lm_head")."""
    w = params["embed"].T if cfg.tie_word_embeddings or "lm_head" not in params else params["lm_head"]
    return jnp.matmul(hidden, w, preferred_element_type=jnp.float32)


def dense_attend(cfg: ModelConfig) -> AttendFn:
    """Dense causal attention with each layer's own window; state = positions [B, T]."""
    windows = tuple(cfg.layer_windows)
    per_layer = jnp.asarray(windows, jnp.int32) if any(windows) else None

    def attend(layer, q, k, v, positions):
        window = 0 if per_layer is None else per_layer[layer]
        return dense_attention(q, k, v, positions, positions, window=window), positions

    return attend


def dense_logits(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens int32[B, T] at positions 0..T-1 -> float32 logits [B, T, vocab]."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = forward(params, cfg, tokens, positions, dense_attend(cfg), positions)
    return lm_head(params, cfg, hidden)


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter tree's shapes (tuples), the one description init and loading derive from."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kd = cfg.num_heads * d, cfg.num_kv_heads * d
    layer = {
        "attn_norm": (h,),
        "wq": (h, qd),
        "wk": (h, kd),
        "wv": (h, kd),
        "wo": (qd, h),
        "mlp_norm": (h,),
        "w_gate": (h, i),
        "w_up": (h, i),
        "w_down": (i, h),
    }
    if cfg.qkv_bias:
        layer.update(bq=(qd,), bk=(kd,), bv=(kd,))
    if cfg.o_bias:
        layer["bo"] = (h,)
    if cfg.qk_norm:
        layer.update(q_norm=(d,), k_norm=(d,))
    shapes = {
        "embed": (cfg.vocab_size, h),
        "final_norm": (h,),
        "layers": [dict(layer) for _ in range(cfg.num_layers)],
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (h, cfg.vocab_size)
    return shapes


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random parameters (normal * scale; norms near 1, biases small) for tests and training."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    paths = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))[0]
    ]
    keys = jax.random.split(key, len(leaves))
    out = []
    for path, shape, k in zip(paths, leaves, keys, strict=True):
        noise = jax.random.normal(k, shape, jnp.float32)
        if "norm" in path:
            value = 1.0 + 0.1 * noise
        else:
            value = scale * noise
        out.append(value.astype(dtype))
    return jax.tree.unflatten(treedef, out)
