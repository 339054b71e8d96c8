"""Rotary position embeddings: frequencies (default and llama3 scaling) and the half-rotation.

Pairing follows Hugging Face Llama ("rotate_half"): dimension i rotates with dimension i + D/2.
Angles, cos/sin and the rotation are computed in fp32 whatever the activation dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """float32[head_dim // 2] inverse frequencies, with llama3 scaling when the config asks for it."""
    d = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_type == "llama3":
        old_len = cfg.rope_original_max_len
        low_wavelen = old_len / cfg.rope_low_freq_factor
        high_wavelen = old_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > low_wavelen, freq / cfg.rope_factor, freq)
        smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        freq = np.where(medium, smoothed, scaled)
    return freq.astype(np.float32)


def cos_sin(positions: jax.Array, freqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions int[...] -> cos, sin float32[..., head_dim] (angles duplicated over both halves)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [..., D] by cos/sin [..., D] in fp32; returns x.dtype. Also used for delta rotations."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, freqs: jax.Array) -> jax.Array:
    """x [B, T, H, D] at positions [B, T] -> rotated x (same dtype)."""
    cos, sin = cos_sin(positions, freqs)
    return rotate(x, cos[..., None, :], sin[..., None, :])
