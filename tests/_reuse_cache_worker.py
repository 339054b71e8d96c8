"""One side of tests/test_startup_mix.py's reuse step-cache test, in a fresh process (XLA:CPU serializes a
program completely only when no earlier compile of the process defined its kernels): `write` compiles and
keeps every reuse pass of two methods (and the reference tokens of jit's own path); `read` loads them, in
the foreground and in the background, and serves a request of each method. Prints one JSON line."""

import json
import sys
from pathlib import Path

import numpy as np

import jaxkv
from jaxkv.cache.head_classes import all_global
from jaxkv.engine import compilations
from jaxkv.engine.engine import Engine
from jaxkv.policies.reuse.apply import num_compilations
from jaxkv.sampling import SamplingParams

METHODS = ("naive", "redknot")


def engine(model):
    cfg = model.config
    return Engine(model, page_size=8, max_model_len=128, max_num_seqs=2, max_step_tokens=16,
                  enable_prefix_caching=False, head_classes=all_global(cfg.num_layers, cfg.num_kv_heads))


def serve(eng, model):
    """A reuse request of each method on two registered segments: (tokens per method, reuse passes compiled
    while serving; the segments' own prefill is an ordinary step, not counted)."""
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(3, model.config.vocab_size, size=n).tolist()  # noqa: E731
    segments = [eng.register_segment(ids(20), frozen=True) for _ in range(2)]
    before, out = num_compilations(), {}
    for method in METHODS:
        rid = eng.add_reuse_request(ids(6), segments, ids(9), reuse=method,
                                    sampling=SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        out[method] = out.pop(rid)
    return [out[m] for m in METHODS], num_compilations() - before


def main(phase: str, ckpt: str, cache: str) -> None:
    compilations.install()
    model = jaxkv.load(ckpt)
    eng = engine(model)
    before = compilations.xla_programs()["compiled"]
    n = eng.reuser.precompile(list(METHODS), progress=False, background=False, step_cache=Path(cache))
    row = {"passes": n, "hits": eng.step_cache_hits, "installed": len(eng.reuser.compiled),
           "compiled_in_precompile": compilations.xla_programs()["compiled"] - before}
    if phase == "write":
        row["kept"] = len(list(Path(cache).glob("*.bin")))
        row["reference_tokens"] = serve(engine(model), model)[0]  # jit's own path, no precompile
    else:
        row["tokens"], row["passes_compiled_while_serving"] = serve(eng, model)
        bg = engine(model)  # ready before its passes are loaded: a pass loads itself when first needed
        bg.reuser.precompile(list(METHODS), progress=False, background=True, step_cache=Path(cache))
        row["background_hits"] = bg.step_cache_hits
        row["background_tokens"], row["background_compiled_while_serving"] = serve(bg, model)
        bg.program_loader.join()
        row["background_loaded"], row["background_pending"] = (len(bg.reuser.compiled),
                                                               len(bg.reuser.compiled.pending))
    print(json.dumps(row))


if __name__ == "__main__":
    main(*sys.argv[1:4])
