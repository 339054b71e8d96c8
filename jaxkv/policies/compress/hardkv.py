"""HARD-KV (arXiv 2606.28831): calibrated per-head scores, top-p budgets between a lower and an upper cap.

Per (sequence, KV head) and layer, following ../shared/references/hardkv.md §3.3-3.4 with its §9 decisions:

1. raw logits z = max over the GQA group of q.k / sqrt(D) for each window query (NEG where not visible;
   `gqa="mean"` averages the group instead);
2. the method transform g(z): `snapkv` = max-pool (kernel 7) along the sequence, `vanilla` = identity;
3. the oracle count n* per query row = |TopP_p(softmax(z))|, the tokens true attention needs for mass p;
4. one temperature T per head, solved by bisection on log T in [1e-3, 10] (24 steps, jit-friendly), so the
   top-n* tokens of softmax(g / T) hold mass p on average over the window rows (the mass function sums
   the n* *largest* entries, fixing the reference code's index-order bug);
5. score = the window mean of softmax(g / T): a probability per slot, comparable across heads (returned as
   its log, so slots whose probability underflows fp32 under a sharp temperature still rank);
6. count = |TopP_p(score)| + forced (sinks + recent window), clamped to [lower, upper]; upper = the
   request's budget, lower = `lower_fraction` of it, or the head class `budget(lower, upper)` when the map
   has one. Counts really differ per head, and pages past each head's count are freed.

`calibration` (optional) is a per-(layer, KV head) temperature file fitted offline by
`python -m tools.calibrate_hardkv`; with it the bisection is skipped (the paper's "temperatures are stable").
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

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
    # Observation window: 64, not the paper's 32. On the embedded model 32 queries vote too noisily: +3-4
    # points of mean accuracy at 12.5 % and 25 % on two tuning draws (docs/eval.md, "HARD-KV's window").
    window: int = 64
    sink: int = 1
    p: float = 0.9
    lower_fraction: float = 0.5
    transform: str = "snapkv"  # "snapkv" (max-pool 7 on logits) or "vanilla"
    kernel: int = 7
    gqa: str = "max"  # how a KV head's query group is reduced on the logits: "max" (the reference) or "mean"
    calibration: tuple | str | None = None  # ((T per KV head) per layer), a calibration file's path, or None
    # The cascade's LSE-preserving merge (evicted tokens folded into similar kept ones, base.CompressPolicy):
    # on by default here (off in the reference code). Held-out 8K draws, five tasks: +9.0 / +7.8 / +4.7 points
    # at 12.5 / 25 / 50 % for 1.6 % more bytes (docs/eval.md, "LSE-preserving merge").
    merge: bool = True
    use_calibration_file: bool = True  # False: always solve T online, even with a file beside the model

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"hardkv: p must lie in (0, 1] (got {self.p!r})")
        if not 0.0 <= self.lower_fraction <= 1.0:
            raise ValueError(f"hardkv: lower_fraction must lie in [0, 1] (got {self.lower_fraction!r})")
        if self.transform not in ("snapkv", "vanilla"):
            raise ValueError(f"hardkv: transform must be 'snapkv' or 'vanilla' (got {self.transform!r})")
        if self.gqa not in ("max", "mean"):
            raise ValueError(f"hardkv: gqa must be 'max' or 'mean' (got {self.gqa!r})")

    def _z(self, obs: Observation):
        """[S, H, W, N] raw logits per KV head: the query group reduced (padding stays NEG)."""
        if self.gqa == "max":
            return jnp.max(obs.logits, axis=2)
        return jnp.where(jnp.max(obs.logits, axis=2) > NEG / 2, jnp.mean(obs.logits, axis=2), NEG)

    def _g(self, z):
        if self.transform == "vanilla":
            return z
        pooled = pool1d(jnp.where(z > NEG / 2, z, -jnp.inf), self.kernel, "max")
        return jnp.where(z > NEG / 2, pooled, NEG)

    def temperatures(self, obs: Observation):
        """[S, Hkv] temperatures solved on this window (what the calibration script averages)."""
        z = self._z(obs)  # [S, H, W, N]
        ok = z > NEG / 2
        row_ok = jnp.any(ok, axis=-1)  # [S, H, W]
        real = jnp.where(ok, jax.nn.softmax(jnp.where(ok, z, -jnp.inf), axis=-1), 0.0)
        n_star = topp_count(real, self.p)
        return solve_temperature(-jnp.sort(-self._g(z), axis=-1), n_star, row_ok, self.p)

    def score(self, obs: Observation):
        """[S, H, N] log of the window-mean calibrated probability (NEG where no window row sees the slot).
        Logs, not probabilities: a sharp head (T ~ 0.01) underflows most slots' probability to 0 in fp32,
        and the keep rule then ranks them by position (the earliest kept); their logs still rank them."""
        z = self._z(obs)  # [S, H, W, N]
        ok = z > NEG / 2
        row_ok = jnp.any(ok, axis=-1)  # [S, H, W]
        g = self._g(z)
        if self.calibration is not None:
            t = jnp.asarray(self.calibration, jnp.float32)[obs.layer][None, :]  # [1, H]
        else:
            t = self.temperatures(obs)  # [S, H]
        logp = jax.nn.log_softmax(jnp.where(ok, g / t[..., None, None], -jnp.inf), axis=-1)
        logp = jnp.where(ok & row_ok[..., None], logp, -jnp.inf)
        rows = jnp.maximum(jnp.sum(row_ok, axis=-1), 1)[..., None]  # [S, H, 1]
        out = jax.nn.logsumexp(logp, axis=2) - jnp.log(rows.astype(jnp.float32))
        return jnp.where(jnp.isfinite(out), out, NEG)

    def counts(self, scores, ctx: SelectContext):
        forced = forced_mask(ctx.positions, self.sink, ctx.recent_from)
        probs = jnp.where(scores > NEG / 2, jnp.exp(scores), 0.0)  # `score` gives log-probabilities
        free = jnp.where(forced | (ctx.positions < 0), 0.0, probs)
        n = topp_count(free, self.p) + jnp.sum(forced, axis=-1)
        upper = jnp.where(ctx.upper[None] > 0, ctx.upper[None], ctx.target[:, None, None])
        lower = jnp.where(ctx.upper[None] > 0, ctx.lower[None],
                          (self.lower_fraction * ctx.target).astype(jnp.int32)[:, None, None])
        return jnp.clip(n, lower, upper).astype(jnp.int32)

    def max_count(self, target: int, num_kv_heads: int = 1) -> int:
        return target

    def bind(self, model) -> HardKV:
        """Uses `hardkv_calibration.json` beside the model when present and none was given. A file fitted
        for another observation window or GQA reduction is not used (temperatures are solved online
        instead): the temperature that gives the window's rows mass p depends on both. `calibration` given
        as a file path loads that file (checked against the model and the policy's fields)."""
        if isinstance(self.calibration, str | os.PathLike):
            return load_calibration(self.calibration, model, dataclasses.replace(self, calibration=None))
        if self.calibration is not None or not self.use_calibration_file or not getattr(model, "path", None):
            return self
        path = os.path.join(model.path, CALIBRATION_FILE)
        if not os.path.exists(path):
            return self
        obj = read_calibration(path)
        if (obj.get("window"), obj.get("gqa", "max")) != (self.window, self.gqa):
            return self
        return _calibrated(obj, path, model, self)


CALIBRATION_FILE = "hardkv_calibration.json"
FORMAT = "jaxkv.hardkv_calibration/v1"


def save_calibration(path, model, policy: HardKV, temperatures) -> None:
    t = np.asarray(temperatures, np.float64)
    cfg = model.config
    if t.shape != (cfg.num_layers, cfg.num_kv_heads):
        raise ValueError(f"temperatures must be [{cfg.num_layers}, {cfg.num_kv_heads}] (got {t.shape})")
    obj = {"format": FORMAT, "model_id": model.model_id, "num_layers": cfg.num_layers,
           "num_kv_heads": cfg.num_kv_heads, "transform": policy.transform, "kernel": policy.kernel,
           "p": policy.p, "window": policy.window, "gqa": policy.gqa, "temperatures": np.round(t, 6).tolist()}
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def read_calibration(path) -> dict:
    """The file's JSON object; a clear error when it is not a calibration file."""
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"hardkv calibration {path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"hardkv calibration {path}: format must be {FORMAT!r}")
    return obj


def load_calibration(path, model, policy: HardKV | None = None) -> HardKV:
    """A HARD-KV policy with the file's temperatures; a clear error for a file made for another model,
    transform, window or GQA reduction."""
    return _calibrated(read_calibration(path), path, model, policy or HardKV())


def _calibrated(obj: dict, path, model, policy: HardKV) -> HardKV:
    cfg = model.config
    if (obj.get("num_layers"), obj.get("num_kv_heads")) != (cfg.num_layers, cfg.num_kv_heads):
        raise ValueError(f"hardkv calibration {path} is for {obj.get('num_layers')} layers x "
                         f"{obj.get('num_kv_heads')} KV heads; the model has "
                         f"{cfg.num_layers} x {cfg.num_kv_heads}")
    if obj.get("model_id") != model.model_id:
        raise ValueError(f"hardkv calibration {path} was fitted on model {obj.get('model_id')!r}, "
                         f"not {model.model_id!r}")
    if obj.get("gqa", "max") != policy.gqa:
        raise ValueError(f"hardkv calibration {path} was fitted for gqa {obj.get('gqa', 'max')!r}; "
                         f"the policy uses {policy.gqa!r}")
    if obj.get("window") != policy.window:
        raise ValueError(f"hardkv calibration {path} was fitted for window {obj.get('window')!r}; "
                         f"the policy uses {policy.window!r}")
    if obj.get("transform") != policy.transform:
        raise ValueError(f"hardkv calibration {path} was fitted for transform {obj.get('transform')!r}; "
                         f"the policy uses {policy.transform!r}")
    t = np.asarray(obj["temperatures"], np.float64)
    if t.shape != (cfg.num_layers, cfg.num_kv_heads) or not np.isfinite(t).all() or (t <= 0).any():
        raise ValueError(f"hardkv calibration {path}: temperatures must be positive, "
                         f"[{cfg.num_layers}, {cfg.num_kv_heads}]")
    return dataclasses.replace(policy, calibration=tuple(tuple(float(x) for x in row) for row in t))
