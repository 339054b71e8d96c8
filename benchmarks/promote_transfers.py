"""Host-side cost of issuing a promotion: how many host-to-device transfers a reuse request issues for its
segments coming up from host memory, and how long from the start of the promotion until the pass's first
program is dispatched (the host work a device waits behind before it computes anything).

A layout like the 8B one scaled down so it runs on a CPU: many layers and KV heads, several segments, a tiny
hidden size (random weights, no checkpoint). Host copies use the host memory kind's layout (``pinned_host``,
which the CPU backend offers too) unless ``--numpy``. Counts come from wrapping ``jax.device_put`` from the
promotion's start to the end of the reuse pass's admission, so they hold for any version of the engine.
Median of ``--repeats`` runs after one warm-up (compiles) per layer-group setting.

    python -m benchmarks.promote_transfers                          # 32 layers, 8 KV heads, 8 segments
    python -m benchmarks.promote_transfers --groups 1,4,8 --segment-len 512
    python -m benchmarks.promote_transfers --device-put     # jax.device_put alone: per-layer arrays vs blocks
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np


def small_deep_model(layers: int, kv_heads: int, max_len: int):
    """A random llama with `layers` layers and `kv_heads` KV heads of dimension 16 (hidden 64)."""
    import jax.numpy as jnp

    from jaxkv.config import ModelConfig
    from jaxkv.loading import Model
    from jaxkv.models import llama

    cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_layers=layers, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=16,
                      tie_word_embeddings=True,
                      max_position_embeddings=max_len, rope_theta=500000.0, rms_norm_eps=1e-5)
    params = jax.jit(lambda k: llama.init_params(cfg, k, jnp.float32))(jax.random.key(0))
    return Model(cfg, params, None, {}, f"random-{layers}x{kv_heads}", None)


class TransferCounter:
    """Counts `jax.device_put` calls and the arrays they move from a promotion's start until the reuse
    admission ends, and the time from that start to the pass's first program being dispatched (while
    entered: the wrapped functions are restored on exit)."""

    def __init__(self):
        import jaxkv.engine.reuse as reuse_mod
        from jaxkv.engine.reuse import Reuser
        from jaxkv.engine.segment_tiers import SegmentTiers

        self.on, self.t0, self.first = False, 0.0, None
        self.calls = self.arrays = self.calls_first = self.arrays_first = 0
        put, promote, admit = jax.device_put, SegmentTiers.promote, Reuser._admit
        prefill = reuse_mod.reuse_prefill

        def counted_put(x, *a, **kw):
            if self.on:
                self.calls += 1
                self.arrays += len(jax.tree_util.tree_leaves(x))
            return put(x, *a, **kw)

        def timed_promote(tiers, *a, **kw):
            self.on, self.t0, self.first = True, time.perf_counter(), None
            self.calls = self.arrays = 0
            return promote(tiers, *a, **kw)

        def first_dispatch(*a, **kw):
            out = prefill(*a, **kw)
            if self.on and self.first is None:
                self.first = time.perf_counter() - self.t0
                self.calls_first, self.arrays_first = self.calls, self.arrays
            return out

        def admit_done(reuser, *a, **kw):
            try:
                return admit(reuser, *a, **kw)
            finally:
                self.on = False

        def patch(on: bool) -> None:
            jax.device_put = counted_put if on else put
            SegmentTiers.promote, Reuser._admit = (timed_promote, admit_done) if on else (promote, admit)
            reuse_mod.reuse_prefill = first_dispatch if on else prefill

        self._patch = patch

    def __enter__(self):
        self._patch(True)
        return self

    def __exit__(self, *exc):
        self._patch(False)


def run(args) -> list[dict]:
    from benchmarks.reuse import (
        Workload,
        make_engine,
        place_segments,
        policy_for,
        register_segments,
        ttft_once,
    )

    w = Workload(args.segments, args.segment_len, 16, 32, args.page_size)
    model = small_deep_model(args.layers, args.kv_heads, w.max_model_len + 64)
    rows = []
    with TransferCounter() as counter:
        for groups in [int(g) for g in args.groups.split(",")]:
            eng = make_engine(model, w, 4096, lambda m: None)
            eng.reuser.layer_groups = groups
            eng.reuser.tiers.memory_kinds = not args.numpy
            prompt = register_segments(eng, w, np.random.default_rng(0), lambda m: None, frozen=False)
            policy = policy_for(args.method)
            got = []
            for i in range(args.repeats + 1):
                place_segments(eng, prompt, "host")
                ttft, stats = ttft_once(eng, policy, prompt)
                if i:
                    got.append((counter.first, counter.calls_first, counter.arrays_first, counter.calls,
                                counter.arrays, ttft, stats.layer_groups))
            med = lambda j, got=got: float(np.median([g[j] for g in got]))  # noqa: E731
            rows.append({"groups": groups, "programs": got[-1][6], "first_dispatch_ms": 1e3 * med(0),
                         "puts_before_first": int(med(1)), "arrays_before_first": int(med(2)),
                         "puts": int(med(3)), "arrays": int(med(4)), "ttft_ms": 1e3 * med(5)})
            del eng
    return rows


def device_put_only(args) -> list[tuple[str, float]]:
    """Seconds to issue (return from) `jax.device_put` of every segment's K/V from host memory kind arrays to
    the device, the same bytes cut three ways: one array per layer and K/V in one call per segment, all of
    them in one call, or one array per segment (every layer, K and V) in one call. Median of --repeats."""
    import jax.numpy as jnp

    from jaxkv.cache.memory_kinds import device_sharding, host_sharding

    L, H, S, D, N = args.layers, args.kv_heads, args.segment_len, 16, args.segments
    host = host_sharding()
    per_layer = [jax.device_put([jnp.ones((H, S, D)) for _ in range(2 * L)], host) for _ in range(N)]
    blocks = jax.device_put([jnp.ones((L, 2, H, S, D)) for _ in range(N)], host)
    dev = device_sharding()

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        return float(np.median(times))

    return [(f"{2 * L} arrays per call, {N} calls",
             timed(lambda: [jax.device_put(x, dev) for x in per_layer])),
            (f"{2 * L * N} arrays in one call", timed(lambda: jax.device_put(sum(per_layer, []), dev))),
            (f"{N} arrays in one call", timed(lambda: jax.device_put(blocks, dev)))]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.promote_transfers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--segments", type=int, default=8)
    p.add_argument("--segment-len", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--groups", default="1,4,8",
                   help="comma list of layer-group settings (Reuser.layer_groups)")
    p.add_argument("--method", default="naive")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--numpy", action="store_true", help="host copies as numpy (no host memory kind)")
    p.add_argument("--device-put", action="store_true", help="time jax.device_put alone (no engine)")
    args = p.parse_args(argv)
    if args.device_put:
        rows = device_put_only(args)
        print(f"{args.segments} segments x {args.layers} layers x {args.kv_heads} KV heads x "
              f"{args.segment_len} slots, host memory kind -> device, {jax.default_backend()}; "
              f"median of {args.repeats}")
        print("| transfers | issue time (ms) |\n|---|---|")
        for name, s in rows:
            print(f"| {name} | {1e3 * s:.1f} |")
        return [{"transfers": name, "issue_s": s} for name, s in rows]
    rows = run(args)
    print(f"{args.layers} layers x {args.kv_heads} KV heads, {args.segments} segments x {args.segment_len} "
          f"tokens from host memory ({'numpy' if args.numpy else 'host memory kind'}), {args.method}, "
          f"{jax.default_backend()}; median of {args.repeats}")
    print("| layer groups | pass programs | promote -> first program (ms) | device_put calls / arrays before "
          "it | device_put calls / arrays in all | TTFT (ms) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['groups']} | {r['programs']} | {r['first_dispatch_ms']:.1f} | "
              f"{r['puts_before_first']} / {r['arrays_before_first']} | {r['puts']} / {r['arrays']} | "
              f"{r['ttft_ms']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
