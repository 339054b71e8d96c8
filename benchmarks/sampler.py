"""Micro benchmark of the device sampler: argmax only, the sort-based twin, the sort-free sampler (one column
per --radix-bits width of its threshold search), and the sort-free kept set with a Gumbel-max draw (V random
numbers a row) in place of the two-level inverse CDF.

Each cell is the median of --iters jitted calls, each timed with the host clock around `block_until_ready`
(`harness.time_host`). Rows sample with temperature 0.8, top_k 50 on half of them, top_p 0.9.

    python -m benchmarks.sampler                                   # S in {1, 32, 256} x V in {49152, 128256}
    python -m benchmarks.sampler --rows 4 --vocab 4096 --iters 3   # seconds on a CPU
    python -m benchmarks.sampler --radix-bits 2 4 5 8              # threshold search widths side by side
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import command_line, describe_device, markdown_table, time_host
from jaxkv.sampling import RADIX_BITS, _logprob, _scaled, kept_mask, sample, sample_sorted


def greedy(logits, temperature, top_k, top_p, seeds, counters):
    """What a greedy-only step runs: argmax and its log-probability."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tokens, _logprob(logits, tokens)


def sample_gumbel(logits, temperature, top_k, top_p, seeds, counters, *, radix_bits: int = RADIX_BITS):
    """`sample` with a Gumbel-max draw over the kept set instead of the inverse CDF."""
    vocab = logits.shape[-1]
    keep = kept_mask(logits, temperature, top_k, top_p, radix_bits=radix_bits)

    def noise(seed, counter):
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), counter), (vocab,))

    g = jax.vmap(noise)(seeds, counters)
    sampled = jnp.argmax(jnp.where(keep, _scaled(logits, temperature) + g, -jnp.inf), axis=-1)
    tokens = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    return tokens, _logprob(logits, tokens)


def inputs(rows: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    args = (rng.standard_normal((rows, vocab), np.float32) * 3,
            np.full(rows, 0.8, np.float32),
            np.where(np.arange(rows) % 2 == 0, 50, 0).astype(np.int32),
            np.full(rows, 0.9, np.float32),
            np.arange(rows, dtype=np.uint32),
            np.zeros(rows, np.int32))
    return tuple(jax.device_put(a) for a in args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--radix-bits", type=int, nargs="+", default=[RADIX_BITS],
                    help="bits of the threshold fixed per search pass (the first also runs the Gumbel draw)")
    args = ap.parse_args(argv)
    first = f"sort-free {args.radix_bits[0]}b"
    variants = {"argmax": greedy, "sorted": sample_sorted}
    variants |= {f"sort-free {b}b": functools.partial(sample, radix_bits=b) for b in args.radix_bits}
    variants[f"{first}, Gumbel draw"] = functools.partial(sample_gumbel, radix_bits=args.radix_bits[0])

    print(describe_device())
    print(f"`{command_line('benchmarks.sampler', argv)}`; ms per call, median of {args.iters}\n", flush=True)
    fns = {name: jax.jit(fn) for name, fn in variants.items()}
    rows = []
    for s in args.rows:
        for v in args.vocab:
            x = inputs(s, v)
            ms = {name: time_host(fn, *x, iters=args.iters) for name, fn in fns.items()}
            rows.append([s, v] + [f"{ms[n]:.3f}" for n in variants] + [f"{ms['sorted'] / ms[first]:.2f}"])
    print(markdown_table(["S", "V"] + [f"{n} ms" for n in variants] + [f"sorted / {first}"], rows))


if __name__ == "__main__":
    main()
