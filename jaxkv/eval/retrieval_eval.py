"""Retrieval methods in the eval harness: ``specontext`` (B = 1024) and ``specontext_256`` / ``_512``.

Full-attention prefill, then greedy decoding where layers from the retrieval head's tap on read only the
head's top-B slots per KV head (`jaxkv.policies.retrieve.decode.generate`, dense cache, library path: the
engine integration with the host tier is planned in docs/specontext.md). The head is the one shipped
beside the model (``<model>/retrieval_head``). Nothing is evicted: KV held is the full cache; KV loaded
counts the prefill, the dense tap layers and ``min(B, length)`` slots per head of the other layers.
"""

from __future__ import annotations

from jaxkv.eval import metrics
from jaxkv.eval.methods import Method, MethodOutput, PromptPieces, register_method


class SpeContextMethod(Method):
    name = "specontext"
    budget = 1024

    def __init__(self, model, budget: int | None = None):
        from jaxkv.policies.retrieve.specontext import SpeContext, load_for_model

        super().__init__(model)
        self.head = load_for_model(model)
        self.policy = SpeContext(budget=budget or self.budget)

    def run(self, pieces: PromptPieces, max_new_tokens: int, stop_ids: tuple[int, ...]) -> MethodOutput:
        import jax

        from jaxkv.policies.retrieve.decode import generate

        cfg = self.model.config
        ids = pieces.ids
        n = len(ids)
        out = generate(self.model, self.policy, self.head, ids, max_new_tokens, stop_ids)
        item = jax.tree.leaves(self.model.params)[0].dtype.itemsize
        tap = self.policy.tap_layer(self.head)
        per_layer = metrics.kv_bytes(cfg, 1, item) // cfg.num_layers  # one token, one layer, all KV heads
        loaded = metrics.kv_bytes(cfg, n * (n + 1) // 2, item)
        for step in range(1, len(out["token_ids"])):
            length = n + step
            loaded += per_layer * (tap * length + (cfg.num_layers - tap) * min(self.policy.budget, length))
        held = metrics.kv_bytes(cfg, n + len(out["token_ids"]), item)
        return MethodOutput(out["token_ids"], out["first_logits"], out["ttft_s"], held, loaded,
                            metrics.prefill_flops(cfg, n))


def _variant(budget: int):
    cls = type(f"SpeContext{budget}", (SpeContextMethod,), {"budget": budget})
    return register_method(f"specontext_{budget}")(cls)


register_method("specontext")(SpeContextMethod)
SpeContext256 = _variant(256)
SpeContext512 = _variant(512)
