"""Plain requests on the retrieval tap's step programs against the runner's own.

With a retrieval method that keeps a device state enabled for requests (SpeContext), the server runs every
plain ragged step through that method's tap program (`Retriever.tap_every_step`), so each step shape
compiles once, not twice. This times what plain requests pay for it: one engine, alternating the two
routes (A B A B), each timed after one untimed round of its own (programs compiled through jit there):
the first token of one prompt of max_model_len / 4 tokens (median of 3) and 32 greedy streams of 1,000
prompt tokens + 256 decoded (`benchmarks.startup.speed`).

    python -m benchmarks.step_tap --shape 1b --max-model-len 32768        # GPU
    python -m benchmarks.step_tap --shape small --max-model-len 512        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.harness import SHAPES, append_jsonl, command_line, describe_device, random_model
from benchmarks.startup import random_retrieval_head, speed


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-step-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--kv-cache-gib", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds of each route, alternated")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxkv.engine.engine import Engine

    model = random_model(args.shape, args.dtype, args.max_model_len)
    engine = Engine(model, max_num_seqs=args.max_num_seqs, max_step_tokens=args.max_step_tokens,
                    max_model_len=args.max_model_len, kv_cache_bytes=int(args.kv_cache_gib * 2**30),
                    enable_prefix_caching=False)
    head = random_retrieval_head(model)
    runner = engine.runner

    def route(tap: bool) -> None:
        if tap:
            assert engine.retriever.tap_every_step(head), "the method keeps no device state"
        else:
            runner.step_tap = None

    runs = {"plain program": [], "tap program": []}
    for r in range(args.rounds + 1):
        for name, tap in (("plain program", False), ("tap program", True)):
            route(tap)
            got = speed(engine, model.config.vocab_size, args.max_model_len)
            if r:  # the first round of each compiles its programs
                runs[name].append(got)
    row = {"shape": args.shape, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs}
    for name, got in runs.items():
        row[name] = {k: statistics.median(g[k] for g in got) for k in ("ttft_s", "streams_32x1000x256_s")}
        row[name]["runs"] = got
    row.update(command=command_line("benchmarks.step_tap", argv), device=describe_device())
    print(f"| route | TTFT {args.max_model_len // 4} tokens | 32 x (1,000 + 256) |")
    print("|---|---:|---:|")
    for name in runs:
        print(f"| {name} | {row[name]['ttft_s'] * 1e3:.1f} ms | {row[name]['streams_32x1000x256_s']:.3f} s |")
    print(json.dumps(row), flush=True)
    if args.json:
        append_jsonl(args.json, row)
    return row


if __name__ == "__main__":
    main()
