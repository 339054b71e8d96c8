"""`jaxkv.generate`: batched generation through the engine (the same path the server uses)."""

from __future__ import annotations

import dataclasses

from tqdm.auto import tqdm

from jaxkv.engine.detok import TextStream
from jaxkv.engine.engine import Engine
from jaxkv.sampling import SamplingParams


@dataclasses.dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]


def generate(model, prompts, sampling: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False, engine: Engine | None = None, **engine_kwargs) -> list[Completion]:
    """Generates a completion per prompt (a string or a list of token ids), in prompt order.

    `sampling` is one SamplingParams for all prompts or one per prompt; by default greedy or sampled as the
    model's generation_config.json says. Extra keyword arguments configure the Engine (page_size,
    num_pages, max_num_seqs, max_step_tokens, head_classes, ...); pass `engine` to reuse one.
    """
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a list of prompts (strings or token-id lists), not a single prompt")
    token_prompts = [model.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if sampling is None:
        sampling = default_sampling(model)
    samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(token_prompts)
    if len(samplings) != len(token_prompts):
        raise ValueError(f"got {len(samplings)} SamplingParams for {len(token_prompts)} prompts")
    if engine is None:
        longest = max((len(p) + s.max_tokens for p, s in zip(token_prompts, samplings)), default=1)
        engine_kwargs.setdefault("max_num_seqs", max(1, min(len(token_prompts), 16)))
        engine_kwargs.setdefault("max_model_len", min(longest, model.config.max_position_embeddings))
        engine = Engine(model, **engine_kwargs)
    # Text once per completion, after its last token, instead of per token between engine steps (host
    # work a GPU's decode steps wait on; docs/benchmarks.md, "Checked again against the unrolled tree");
    # stop strings still need it as the tokens arrive.
    late = [engine.tokenizer is not None and s.detokenize and not s.stop for s in samplings]
    ids = [engine.add_request(p, dataclasses.replace(s, detokenize=False) if lt else s)
           for p, s, lt in zip(token_prompts, samplings, late)]
    results = {rid: Completion(p, [], "", "", []) for rid, p in zip(ids, token_prompts)}
    total = sum(s.max_tokens for s in samplings)
    with tqdm(total=total, disable=not use_tqdm, desc="generate", unit="tok") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                c = results[out.request_id]
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(out.new_logprobs)
                c.text, c.finish_reason = out.text, out.finish_reason or ""
                bar.update(len(out.new_token_ids))
    for rid, lt in zip(ids, late):
        if lt:
            results[rid].text = _text(engine.tokenizer, results[rid])
    return [results[rid] for rid in ids]


def _text(tokenizer, c: Completion) -> str:
    """The text the engine's stream would have built token by token (a stop token, the only way such a
    completion stops, is never text)."""
    stream = TextStream(tokenizer.decode, c.prompt_token_ids, ())
    stream.add(c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids, final=True)
    return stream.text


def default_sampling(model, **overrides) -> SamplingParams:
    """SamplingParams from the model's generation_config.json (HF semantics: do_sample=False is greedy)."""
    gc = getattr(model, "generation_config", None) or {}
    kw = {}
    if gc.get("do_sample", False):
        kw["temperature"] = float(gc.get("temperature", 1.0))
        kw["top_k"] = int(gc.get("top_k", 0) or 0)
        kw["top_p"] = float(gc.get("top_p", 1.0) or 1.0)
    else:
        kw["temperature"] = 0.0
    if gc.get("max_new_tokens"):
        kw["max_tokens"] = int(gc["max_new_tokens"])
    kw.update(overrides)
    return SamplingParams(**kw)
