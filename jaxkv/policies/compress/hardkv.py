"""HARD-KV (arXiv 2606.28831): calibrated per-head scores, top-p budgets between a lower and an upper cap.

Per (sequence, KV head) and layer, following ../shared/references/hardkv.md §3.3-3.4 with its §9 decisions:

1. raw logits z = max over the GQA group of q.k / sqrt(D) for each window query (NEG where not visible);
2. the method transform g(z): `snapkv` = max-pool (kernel 7) along the sequence, `vanilla` = identity;
3. the oracle count n* per query row = |TopP_p(softmax(z))|, the tokens true attention needs for mass p;
4. one temperature T per head, solved by bisection on log T in [1e-3, 10] (24 steps, jit-friendly), so the
   top-n* tokens of softmax(g / T) hold mass p on average over the window rows (the mass function sums
   the n* *largest* entries, fixing the reference code's index-order bug);
5. score = the window mean of softmax(g / T): a probability per slot, comparable across heads;
6. count = |TopP_p(score)| + forced (sinks + recent window), clamped to [lower, upper]; upper = the
   request's budget, lower = `lower_fraction` of it, or the head class `budget(lower, upper)` when the map
   has one. Counts really differ per head, and pages past each head's count are freed.

`calibration` (optional) is a per-(layer, KV head) temperature file fitted offline by
`scripts/calibrate_hardkv.py`; with it the bisection is skipped (the paper's "temperatures are stable").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.policies.base import NEG, CompressPolicy, Observation, SelectContext, forced_mask, pool1d
from jaxkv.policies.registry import register


def topp_count(probs, p: float, axis: int = -1):
    """Smallest number of entries (largest first) whose sum reaches p, per row."""
    s = -jnp.sort(-probs, axis=axis)
    c = jnp.cumsum(s, axis=axis)
    return 1 + jnp.sum(c < p * jnp.sum(probs, axis=axis, keepdims=True), axis=axis)


def solve_temperature(g_sorted, n_star, row_ok, p: float, iters: int = 24):
    """Bisection on log T: mean over valid rows of the top-n* mass of softmax(g / T) equals p.

    g_sorted [..., W, N] descending (NEG for invalid); n_star [..., W]; row_ok [..., W]. Returns T [...].
    The top-n* set by g does not depend on T (softmax is monotone), so sorting once is enough.
    """
    n = g_sorted.shape[-1]
    top = jnp.arange(n) < n_star[..., None]
    ok = g_sorted > NEG / 2

    def mass(log_t):
        z = g_sorted / jnp.exp(log_t)[..., None, None]
        z = jnp.where(ok, z, -jnp.inf)
        pr = jax.nn.softmax(z, axis=-1)
        pr = jnp.where(ok, pr, 0.0)
        m = jnp.sum(jnp.where(top, pr, 0.0), axis=-1)  # [..., W]
        return jnp.sum(jnp.where(row_ok, m, 0.0), axis=-1) / jnp.maximum(jnp.sum(row_ok, axis=-1), 1)

    lo = jnp.full(g_sorted.shape[:-2], jnp.log(1e-3), jnp.float32)
    hi = jnp.full(g_sorted.shape[:-2], jnp.log(10.0), jnp.float32)

    def body(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        too_peaked = mass(mid) > p  # mass decreases with T: more than p means T can grow
        return jnp.where(too_peaked, mid, lo), jnp.where(too_peaked, hi, mid)

    lo, hi = jax.lax.fori_loop(0, iters, body, (lo, hi))
    return jnp.exp(0.5 * (lo + hi))


@register
@dataclasses.dataclass(frozen=True)
class HardKV(CompressPolicy):
    name = "hardkv"
    window: int = 32
    sink: int = 1
    p: float = 0.9
    lower_fraction: float = 0.5
    transform: str = "snapkv"  # "snapkv" (max-pool 7 on logits) or "vanilla"
    kernel: int = 7
    calibration: tuple | None = None  # ((T per KV head) per layer) from a calibration file, or None

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"hardkv: p must lie in (0, 1] (got {self.p!r})")
        if not 0.0 <= self.lower_fraction <= 1.0:
            raise ValueError(f"hardkv: lower_fraction must lie in [0, 1] (got {self.lower_fraction!r})")
        if self.transform not in ("snapkv", "vanilla"):
            raise ValueError(f"hardkv: transform must be 'snapkv' or 'vanilla' (got {self.transform!r})")

    def _g(self, z):
        if self.transform == "vanilla":
            return z
        pooled = pool1d(jnp.where(z > NEG / 2, z, -jnp.inf), self.kernel, "max")
        return jnp.where(z > NEG / 2, pooled, NEG)

    def score(self, obs: Observation):
        z = jnp.max(obs.logits, axis=2)  # [S, H, W, N] GQA max
        ok = z > NEG / 2
        row_ok = jnp.any(ok, axis=-1)  # [S, H, W]
        zt = jnp.where(ok, z, -jnp.inf)
        real = jnp.where(ok, jax.nn.softmax(zt, axis=-1), 0.0)
        n_star = topp_count(real, self.p)
        g = self._g(z)
        if self.calibration is not None:
            t = jnp.asarray(self.calibration, jnp.float32)[obs.layer][None, :]  # [1, H]
        else:
            t = solve_temperature(-jnp.sort(-g, axis=-1), n_star, row_ok, self.p)  # [S, H]
        pr = jax.nn.softmax(jnp.where(ok, g / t[..., None, None], -jnp.inf), axis=-1)
        pr = jnp.where(ok & row_ok[..., None], pr, 0.0)
        return jnp.sum(pr, axis=2) / jnp.maximum(jnp.sum(row_ok, axis=-1), 1)[..., None]  # [S, H, N]

    def counts(self, scores, ctx: SelectContext):
        forced = forced_mask(ctx.positions, self.sink, ctx.recent_from)
        free = jnp.where(forced | (ctx.positions < 0), 0.0, scores)
        n = topp_count(free, self.p) + jnp.sum(forced, axis=-1)
        upper = jnp.where(ctx.upper[None] > 0, ctx.upper[None], ctx.target[:, None, None])
        lower = jnp.where(ctx.upper[None] > 0, ctx.lower[None],
                          (self.lower_fraction * ctx.target).astype(jnp.int32)[:, None, None])
        return jnp.clip(n, lower, upper).astype(jnp.int32)

    def max_count(self, target: int, num_kv_heads: int = 1) -> int:
        return target
