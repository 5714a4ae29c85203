"""A request's state as it moves through the engine: a plain dataclass.

The engine keeps one rule: every token of `all_token_ids` must have its KV computed before the
next token can be sampled. `num_computed` counts the tokens whose KV is in the cache, so
prefill, chunked prefill, decode and recompute after preemption are the same thing: feed
tokens `[num_computed, num_tokens)`, and sample once none are left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.tokenizer.detokenizer import IncrementalDetokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the context leaves
    arrival: int  # order of arrival; the newest running request is preempted first
    detok: IncrementalDetokenizer
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)  # KV page ids, in position order
    num_computed: int = 0  # tokens whose KV is in `pages`
    state_slot: int | None = None  # recurrent-state slot (hybrid models) while running
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    text: str = ""  # output text so far (stop strings cut off)
    emitted_chars: int = 0  # how much of `text` has been sent out
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    pending_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
