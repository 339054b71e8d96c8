"""Pure-function decode with a retrieval policy over a dense per-layer cache (library path; no engine).

Cache layout: ``kc, vc [L, S, N, Hkv, D]`` with slot i of row s holding position i. Prefill is dense full
attention and fills the policy's state (the retrieval head's key cache) from the stream after
``tap_layer`` layers. Each decode step:

1. layers [0, tap_layer) run dense (they are the retrieval head's embedding path);
2. the policy scores every slot per KV head and `select` picks ``budget`` of them (shared by all layers);
3. layers tap_layer.. write their new K/V and attend over **only** the selected slots: the selection is
   gathered into one page of ``budget`` slots per (row, KV head) — the shape of the GPU buffer the host
   tier refills in place (docs/specontext.md) — and attended by the paged kernel (Pallas on GPU, its jnp
   twin elsewhere), whose lengths are the selection counts.

With ``budget >= context`` the step equals full attention (tests/test_specontext.py).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import ModelConfig
from jaxkv.models import llama, rope
from jaxkv.models.attention import dense_attention
from jaxkv.policies.retrieve.base import RetrievalPolicy, Selection, overlap
from pallas_kernels.paged_attention.api import paged_attention


def _write(kc, vc, layer, k, v, positions):
    rows = jnp.arange(k.shape[0])[:, None]
    kc = kc.at[layer, rows, positions].set(k.astype(kc.dtype), mode="drop")
    vc = vc.at[layer, rows, positions].set(v.astype(vc.dtype), mode="drop")
    return kc, vc


def dense_cache_attend(cfg: ModelConfig, positions):
    """AttendFn: write k, v at `positions` [S, T], attend causally over the whole row (state = (kc, vc))."""

    def attend(layer, q, k, v, state):
        kc, vc = _write(*state, layer, k, v, positions)
        kpos = jnp.broadcast_to(jnp.arange(kc.shape[2], dtype=jnp.int32), kc.shape[1:3])
        out = dense_attention(q, kc[layer], vc[layer], positions, kpos, window=cfg.layer_windows[layer])
        return out, (kc, vc)

    return attend


def gather_selected(cache_layer: jax.Array, sel: Selection) -> jax.Array:
    """cache_layer [S, N, Hkv, D], sel.idx [S, Hkv, B] -> selected slots [S, Hkv, B, D]."""
    per_head = jnp.swapaxes(cache_layer, 1, 2)  # [S, Hkv, N, D]
    return jnp.take_along_axis(per_head, sel.idx[..., None], axis=2)


def selected_attention(cfg: ModelConfig, layer: int, q, kc_layer, vc_layer, sel: Selection, q_pos, *,
                       implementation: str | None = None):
    """One decode query per row over only the selected slots of each KV head.

    q [S, Hq, D] (post-RoPE), kc_layer/vc_layer [S, N, Hkv, D], q_pos [S]. Returns (out [S, Hq, D],
    lse [S, Hq]). The selection becomes one page per (row, KV head): page id s*Hkv + h, slot positions =
    the selected indices (-1 past the count), length = count.
    """
    s, hkv, b = sel.idx.shape
    k_pages = gather_selected(kc_layer, sel).reshape(s * hkv, b, -1)
    v_pages = gather_selected(vc_layer, sel).reshape(s * hkv, b, -1)
    slot_pos = jnp.where(sel.mask(), sel.idx, -1).reshape(s * hkv, b)
    page_table = jnp.arange(s * hkv, dtype=jnp.int32).reshape(s, hkv, 1)
    window = jnp.full((hkv,), cfg.layer_windows[layer], jnp.int32)
    q_seq = jnp.arange(s, dtype=jnp.int32)
    return paged_attention(q, k_pages, v_pages, slot_pos, page_table, sel.count, q_seq,
                           q_pos.astype(jnp.int32), jnp.zeros((hkv,), jnp.int32), window,
                           scale=cfg.head_dim ** -0.5, implementation=implementation)


@functools.partial(jax.jit, static_argnames=("cfg", "policy"), donate_argnames=("kc", "vc", "hstate"))
def prefill(params, cfg: ModelConfig, policy: RetrievalPolicy, head, tokens, kc, vc, hstate, n_valid):
    """tokens [S, T] at positions 0..T-1 (rows padded past n_valid [S]) -> (logits [S, V] of each row's
    last valid token, kc, vc, hstate). Dense full attention; the policy observes the prompt."""
    s, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
    freqs = rope.inv_freq(cfg)
    attend = dense_cache_attend(cfg, positions)
    x = params["embed"][tokens]
    state = (kc, vc)
    # Padding rows past n_valid observe nothing: their positions are moved past the state (dropped).
    observed = jnp.where(positions < n_valid[:, None], positions, jnp.iinfo(jnp.int32).max // 2)
    for i, p in enumerate(llama.layer_list(params)):
        if i == policy.key_layer(head):
            hstate = policy.observe(head, hstate, x, observed)
        x, state = llama.decoder_layer(p, cfg, i, x, positions, freqs, attend, state)
    last = jnp.take_along_axis(x, (n_valid - 1)[:, None, None], axis=1)
    hidden = llama.rms_norm(last, params["final_norm"], cfg.rms_norm_eps)
    return llama.lm_head(params, cfg, hidden)[:, 0], *state, hstate


@functools.partial(jax.jit, static_argnames=("cfg", "policy", "implementation"),
                   donate_argnames=("kc", "vc", "hstate"))
def decode_step(params, cfg: ModelConfig, policy: RetrievalPolicy, head, tokens, positions, kc, vc, hstate,
                implementation: str | None = None):
    """tokens, positions [S, 1] -> (logits [S, V], kc, vc, hstate, Selection of this step)."""
    freqs = rope.inv_freq(cfg)
    tap = policy.tap_layer(head)
    dense = dense_cache_attend(cfg, positions)
    x = params["embed"][tokens]
    state = (kc, vc)
    for i in range(tap):
        p = llama.layer_params(params, i)
        x, state = llama.decoder_layer(p, cfg, i, x, positions, freqs, dense, state)
    scores, hstate = policy.scores(head, hstate, x, positions)
    sel = policy.select(scores, positions[:, 0])

    def attend(layer, q, k, v, state):
        kc, vc = _write(*state, layer, k, v, positions)
        out, _ = selected_attention(cfg, layer, q[:, 0], kc[layer], vc[layer], sel, positions[:, 0],
                                    implementation=implementation)
        return out[:, None], (kc, vc)

    key = policy.key_layer(head)  # a lagged head records the step's token after the selection
    for i in range(tap, cfg.num_layers):
        if i == key and key != tap:
            hstate = policy.observe(head, hstate, x, positions)
        p = llama.layer_params(params, i)
        x, state = llama.decoder_layer(p, cfg, i, x, positions, freqs, attend, state)
    hidden = llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return llama.lm_head(params, cfg, hidden)[:, 0], *state, hstate, sel


def generate(model, policy: RetrievalPolicy, head, prompt_ids: list[int], max_new_tokens: int,
             stop_ids: tuple[int, ...] = (), *, implementation: str | None = None) -> dict:
    """Greedy decoding of one prompt with `policy` (full-attention prefill, selected decode).

    Returns {"token_ids", "first_logits" (np [V]), "ttft_s" (prefill wall clock), "overlap" (per step:
    fraction of each head's selection the previous step already held, mean over heads)}.
    """
    cfg, params = model.config, model.params
    policy = policy.for_model(model)
    n = len(prompt_ids)
    tb = _bucket(n)
    size = _bucket(n + max_new_tokens)
    dtype = jax.tree.leaves(params)[0].dtype
    kc = jnp.zeros((cfg.num_layers, 1, size, cfg.num_kv_heads, cfg.head_dim), dtype)
    vc = jnp.zeros_like(kc)
    hstate = policy.init_state(head, 1, size)
    toks = jnp.asarray(np.pad(np.asarray(prompt_ids, np.int32), (0, tb - n))[None])
    t0 = time.perf_counter()
    n_valid = jnp.array([n], jnp.int32)
    logits, kc, vc, hstate = prefill(params, cfg, policy, head, toks, kc, vc, hstate, n_valid)
    first = np.asarray(logits[0])
    ttft = time.perf_counter() - t0
    out, overlaps, prev = [], [], None
    tok = int(first.argmax())
    while tok not in stop_ids and len(out) < max_new_tokens:
        out.append(tok)
        if len(out) == max_new_tokens:
            break
        pos = jnp.full((1, 1), n + len(out) - 1, jnp.int32)
        logits, kc, vc, hstate, sel = decode_step(params, cfg, policy, head, jnp.full((1, 1), tok, jnp.int32),
                                                  pos, kc, vc, hstate, implementation=implementation)
        if prev is not None:
            overlaps.append(float(jnp.mean(overlap(prev, sel) / jnp.maximum(sel.count, 1))))
        prev = sel
        tok = int(jnp.argmax(logits[0]))
    return {"token_ids": out, "first_logits": first, "ttft_s": ttft, "overlap": overlaps}


def _bucket(n: int, lo: int = 128) -> int:
    """Dense-cache length bucket of this oracle path (kept here: a policy module imports no engine code)."""
    b = lo
    while b < n:
        b *= 2
    return b
