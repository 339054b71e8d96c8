"""Per-request state (host only): tokens, progress through prefill, output text and stop logic."""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxkv.engine.detok import TextStream
from jaxkv.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the whole output text so far (stop strings removed)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[float] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    # With SamplingParams.logprobs > 0: per new token, its `logprobs` most likely [(token id, logprob)].
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    # With SamplingParams.prompt_logprobs (on the request's first output only): per prompt token its
    # log-probability given the tokens before it (None for the first token) ...
    prompt_logprobs: list[float | None] | None = None
    # ... and its `prompt_logprobs` most likely alternatives (None for the first token).
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int  # resolved seed (drawn by the engine when the caller gave none)
    extra_key: str | None = None  # prefix-cache namespace
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_cached: int = 0  # prompt tokens served by the prefix cache at the last admission
    stream: TextStream | None = None  # incremental output text + stop strings (None without a tokenizer)
    text: str = ""
    finish_reason: str | None = None
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    num_preemptions: int = 0
    kv_policy: object | None = None  # a jaxkv.policies CompressPolicy, or None for the full cache
    kv_compressed_at: int | None = None  # output tokens at the last compression (None = not yet)
    kv_compressed_epoch: int = 0  # num_preemptions at the last compression (a preemption recomputes all)
    # Prompt log-probabilities as the prefill computes them (SamplingParams.prompt_logprobs): [P] float32,
    # entry j = log p(prompt[j] | prompt[:j]) (NaN until computed; entry 0 never is), and the alternatives
    # (ids, logprobs) [P, W]; handed out with the first output, then dropped.
    prompt_lp: object = None
    prompt_top: tuple | None = None
    prompt_lp_sent: bool = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prefill must compute prompt log-probabilities (asked for, not handed out yet)."""
        return self.sampling.prompt_logprobs is not None and not self.prompt_lp_sent

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; the last of them is fed to produce the next token."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
