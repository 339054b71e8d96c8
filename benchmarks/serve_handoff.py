"""The server's per-token hand-off cost on the engine thread and the event loop, without a model.

One multi-step decode call's outputs (128 requests x 16 tokens, one `RequestOutput` per token as the engine
gives them) through `EngineLoop._dispatch` (engine thread: regrouping, token metrics, the inbox post) and
the inbox drain (event loop: one queue put per item); and `TextStream.add` per token, the stop-string
detokenization the engine thread runs for a request that keeps its text. CPU microseconds per token,
median of 5 rounds. Run it in two trees to compare them:

    python -m benchmarks.serve_handoff --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from jaxkv.engine.detok import TextStream
from jaxkv.engine.request import RequestOutput
from jaxkv.serve.engine_loop import EngineLoop, _Track
from jaxkv.serve.metrics import ServeMetrics
from jaxkv.tokenizer import Tokenizer

REQUESTS, STEPS, ROUNDS, CALLS = 128, 16, 5, 60


def handoff_us() -> tuple[float, float]:
    """(engine thread `_dispatch`, event loop drain) CPU us per token."""
    loop = asyncio.new_event_loop()
    eng_loop = EngineLoop(engine=None, metrics=ServeMetrics("m"))
    outs = [RequestOutput(f"r{i}", [5 + k], "", False, None, 10, k, [0.0], 0)
            for k in range(STEPS) for i in range(REQUESTS)]  # step-major, as Engine._collect gives them
    dispatch, drain = [], []
    for _ in range(ROUNDS):
        spent = [0.0, 0.0]
        for _ in range(CALLS):
            now = time.perf_counter()
            for i in range(REQUESTS):
                eng_loop._tracks[f"r{i}"] = _Track(loop, asyncio.Queue(), 0, now, now, 10)
            t0 = time.process_time()
            eng_loop._dispatch(outs)
            t1 = time.process_time()
            for inbox in eng_loop._inboxes.values():
                inbox._drain()
            spent[0] += t1 - t0
            spent[1] += time.process_time() - t1
        tokens = CALLS * REQUESTS * STEPS
        dispatch.append(spent[0] / tokens * 1e6)
        drain.append(spent[1] / tokens * 1e6)
    loop.close()
    return statistics.median(dispatch), statistics.median(drain)


def detok_us(tok: Tokenizer) -> float:
    ids = tok.encode("king queen river music house light dark north south story chapter answer " * 8)
    rates = []
    for _ in range(ROUNDS):
        stream = TextStream(tok.decode, ids[:8], ())
        t0 = time.process_time()
        for t in ids[8:]:
            stream.add([t])
        rates.append((time.process_time() - t0) / len(ids[8:]) * 1e6)
    return statistics.median(rates)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (its tokenizer is used)")
    args = p.parse_args(argv)
    dispatch, drain = handoff_us()
    print(f"engine thread hand-off (EngineLoop._dispatch): {dispatch:.2f} us/token")
    print(f"event loop inbox drain: {drain:.2f} us/token")
    detok = detok_us(Tokenizer.from_dir(args.model))
    print(f"per-token TextStream.add (engine-side text): {detok:.2f} us/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
