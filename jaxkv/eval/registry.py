"""The eval method interface and its registry.

A method turns one prompt (given as its pieces: prefix ids, segment ids, suffix ids, so reuse methods can
cache segments) into a greedy completion plus the numbers the harness reports. Modules that define methods
import this one (and `jaxkv.eval.methods` for its engine base class), never register each other;
`all_methods()` / `get_method()` import the modules listed in `METHOD_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass
class PromptPieces:
    prefix: list[int]
    segments: list[list[int]]
    suffix: list[int]

    @property
    def ids(self) -> list[int]:
        return self.prefix + [t for s in self.segments for t in s] + self.suffix


@dataclasses.dataclass
class MethodOutput:
    token_ids: list[int]            # generated ids (stop token excluded)
    first_logits: np.ndarray        # float32 [vocab], logits of the first generated token
    ttft_s: float                   # prefill + first token, wall clock (after compilation)
    kv_bytes_held: int              # peak KV bytes resident for this request
    kv_bytes_loaded: int            # KV bytes read by attention over prefill and decode
    prefill_flops: dict[str, float]  # analytical, see metrics.prefill_flops


class Method:
    """Interface: `run(pieces, max_new_tokens, stop_ids) -> MethodOutput`."""

    name = "base"
    compare_to_full = True   # the harness also runs `full` for first-token logit agreement

    def __init__(self, model):
        self.model = model

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]) -> MethodOutput:
        raise NotImplementedError


METHODS: dict[str, Callable[..., Method]] = {}


def register_method(name: str):
    """Class decorator: `get_method(name, model, **kwargs)` builds this class."""
    def deco(cls):
        METHODS[name] = cls
        return cls

    return deco


# The modules that define methods, imported in this order the first time the registry is read: one explicit
# list, so no method module imports another to register it.
METHOD_MODULES = ("jaxkv.eval.methods", "jaxkv.eval.reuse_methods", "jaxkv.eval.retrieval_eval")


def all_methods() -> dict[str, Callable[..., Method]]:
    """Every registered method by name (imports the method modules on first use)."""
    for module in METHOD_MODULES:
        importlib.import_module(module)
    return METHODS


def get_method(name: str, model, **kwargs) -> Method:
    methods = all_methods()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; choose from {sorted(methods)}")
    return methods[name](model, **kwargs)
