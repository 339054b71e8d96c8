"""One side of tests/test_engine.py's step-cache test, in a fresh process: `write` compiles and keeps every
program (and the reference tokens of jit's own path); `read` loads them, runs the mix, then tries another
configuration and a damaged entry. Prints one JSON line."""

import json
import sys
from pathlib import Path

import numpy as np

import jaxkv
from jaxkv.engine import compilations
from jaxkv.engine.engine import Engine
from jaxkv.engine.runner import num_compilations
from jaxkv.sampling import SamplingParams

KW = dict(page_size=8, max_model_len=48, max_num_seqs=2, max_step_tokens=16, decode_steps=4)


def mix(model):
    rng = np.random.default_rng(0)
    return [(rng.integers(3, model.config.vocab_size, size=3).tolist(),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
            (rng.integers(3, model.config.vocab_size, size=30).tolist(),
             SamplingParams(temperature=0.7, max_tokens=9, seed=1))]


def outputs(eng, requests):
    ids = [eng.add_request(prompt, sp) for prompt, sp in requests]
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[i] for i in ids]


def main(phase: str, ckpt: str, cache: str) -> None:
    compilations.install()
    model = jaxkv.load(ckpt)
    requests = mix(model)
    eng = Engine(model, **KW)
    before = compilations.xla_programs()["compiled"]
    # the first start keeps its programs on a writer thread (`background`), the next loads them in place
    n = eng.precompile(progress=False, step_cache=Path(cache), background=phase == "write")
    row = {"programs": n, "hits": eng.step_cache_hits,
           "compiled_in_precompile": compilations.xla_programs()["compiled"] - before}
    if phase == "write":
        writer = eng.program_writer
        row["writer_thread"] = writer is not None and not writer.daemon
        writer.join()
        row["kept"] = len(list(Path(cache).glob("*.bin")))
        row["reference_tokens"] = outputs(Engine(model, **KW), requests)  # jit's own path, no precompile
    else:
        steps = num_compilations()
        row["tokens"] = outputs(eng, requests)
        row["step_programs_compiled_while_running"] = num_compilations() - steps
        bg = Engine(model, **KW)  # ready before its programs are loaded: a step loads what it needs
        bg.precompile(progress=False, step_cache=Path(cache), background=True)
        row["background_hits"] = bg.step_cache_hits
        steps = num_compilations()
        row["background_tokens"] = outputs(bg, requests)
        row["background_compiled_while_running"] = num_compilations() - steps
        bg.program_loader.join()
        row["background_loaded"] = len(bg.runner.compiled) + len(bg.compressor.compiled)
        row["background_pending"] = len(bg.runner.compiled.pending) + len(bg.compressor.compiled.pending)
        kept = sorted(Path(cache).glob("*.bin"))
        other = Engine(model, **{**KW, "page_size": 4})
        other.precompile(progress=False, step_cache=Path(cache))
        row["other_config_hits"] = other.step_cache_hits
        damaged = kept[0]
        damaged.write_bytes(damaged.read_bytes()[:100])
        third = Engine(model, **KW)
        third.precompile(progress=False, step_cache=Path(cache))
        row["damaged_hits"] = third.step_cache_hits
        row["damaged_tokens"] = outputs(third, requests)
    print(json.dumps(row))


if __name__ == "__main__":
    main(*sys.argv[1:4])
