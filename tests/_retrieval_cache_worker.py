"""One side of tests/test_retrieval_precompile.py's step-cache test, in a fresh process: `write` precompiles
an engine with SpeContext and Quest (keeping every program) and records the tokens of an engine that
compiles as it goes; `read` builds the same engine on the same cache, then serves one SpeContext and one
Quest request. Prints one JSON line."""

import json
import sys
from pathlib import Path

import jaxkv
from jaxkv.engine import compilations
from tests.test_retrieval_precompile import KW, engine, policies, serve


def main(phase: str, ckpt: str, cache: str, head_dir: str) -> None:
    compilations.install()
    model = jaxkv.load(ckpt)
    pols = policies(model, head_dir)
    eng = engine(model)
    before = compilations.xla_programs()["compiled"]
    n = eng.precompile(progress=False, step_cache=Path(cache), retrieval=pols)
    row = {"programs": n, "retrieval_programs": len(eng.retriever.compiled), "hits": eng.step_cache_hits,
           "compiled_in_precompile": compilations.xla_programs()["compiled"] - before}
    if phase == "write":
        row["kept"] = len(list(Path(cache).glob("*.bin")))
        row["reference_tokens"] = serve(engine(model), model, pols)
    else:
        steps, xla = compilations.step_programs(), compilations.xla_programs()["compiled"]
        row["tokens"] = serve(eng, model, pols)
        row["step_programs_while_serving"] = compilations.step_programs() - steps
        row["xla_programs_while_serving"] = compilations.xla_programs()["compiled"] - xla
    row["kw"] = KW
    print(json.dumps(row))


if __name__ == "__main__":
    main(*sys.argv[1:5])
