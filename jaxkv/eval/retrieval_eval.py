"""Retrieval methods in the eval harness, through the serving engine: ``specontext`` (B = 1024),
``specontext_256`` / ``_512``, and ``quest`` (B = 1024).

A budget below 1 is a fraction of each prompt (rounded up to a multiple of 64 tokens), as the compression
presses take it. Each is the engine method (`jaxkv.eval.methods.EngineMethod`: the paged engine that
serves, all heads global) with the retrieval policy as its `kv_policy` (jaxkv/engine/retrieval.py):
full-attention prefill, then greedy multi-step decoding in which attention reads only the policy's selection
per KV head. SpeContext's head is the one shipped beside the model (``<model>/retrieval_head``), or the
directory its ``head_dir`` field names. Nothing is evicted:
KV held is the full cache; KV loaded counts the prefill, the dense layers (SpeContext's tap layers,
Quest's ``dense_layers``) over the whole cache and ``min(B, length)`` slots per head of the other layers
(Quest's page-bound pass over every key of those layers is not counted: it reads K min/max, see
docs/policies.md).
"""

from __future__ import annotations

import dataclasses
import math

from jaxkv.eval import metrics
from jaxkv.eval.methods import EngineMethod, PromptPieces, register_method


class RetrievalEngineMethod(EngineMethod):
    budget = 1024
    BUDGET_STEP = 64  # a fraction budget rounds up to this many tokens, so prompts of one length class share
    # a compilation (the selection size is a static shape)

    def __init__(self, model, budget: float | None = None, **policy_fields):
        budget = self.budget if budget is None else budget
        if not (0 < budget < 1 or (budget == int(budget) and budget >= 1)):
            raise ValueError(f"method {self.name!r}: --budget is tokens per KV head (a positive integer) "
                             f"or a fraction of the prompt in (0, 1) (got {budget})")
        self.fraction = float(budget) if budget < 1 else None
        super().__init__(model, budget=self.BUDGET_STEP if self.fraction else int(budget), **policy_fields)
        self.policy.load_params(model)  # fail early (e.g. no retrieval head beside the model)

    def _tokens(self, num_prompt: int) -> int:
        if self.fraction is None:
            return self.policy.budget
        return max(1, math.ceil(self.fraction * num_prompt / self.BUDGET_STEP)) * self.BUDGET_STEP

    def _request_policy(self, num_prompt: int):
        if self.fraction is None:
            return None
        return dataclasses.replace(self.policy, budget=self._tokens(num_prompt))

    def _dense_layers(self) -> int:
        """Layers that read the whole cache every step (the policy's `tap_layer`)."""
        pol = self.policy
        return pol.tap_layer(pol.load_params(self.model))

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]):
        out = super().run(pieces, max_new_tokens, stop_ids)
        cfg = self.model.config
        n = len(pieces.ids)
        budget = self._tokens(n)
        item = self._engine.runner.pool.k.dtype.itemsize
        dense = self._dense_layers()
        per_layer = metrics.kv_bytes(cfg, 1, item) // cfg.num_layers  # one token, one layer, all KV heads
        loaded = metrics.kv_bytes(cfg, n * (n + 1) // 2, item)
        for step in range(1, len(out.token_ids)):
            length = n + step
            sparse = (cfg.num_layers - dense) * min(budget, length)
            loaded += per_layer * (dense * length + sparse)
        return dataclasses.replace(out, kv_bytes_loaded=loaded)


def _variant(name: str, policy: str, budget: int):
    cls = type(f"Retrieval_{name}", (RetrievalEngineMethod,), {"name": name, "policy_name": policy,
                                                                "budget": budget})
    return register_method(name)(cls)


SpeContextMethod = _variant("specontext", "specontext", 1024)
SpeContext256 = _variant("specontext_256", "specontext", 256)
SpeContext512 = _variant("specontext_512", "specontext", 512)
QuestMethod = _variant("quest", "quest", 1024)
