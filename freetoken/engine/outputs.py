"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One step's news for one request.

    `new_token_ids` / `new_text` are the delta since the previous output of this request;
    `text` is the text so far (stop strings removed). `finish_reason` is None while running,
    else "stop" (EOS, stop string or stop token), "length" (max_tokens or context), "abort" or
    "error" (then `error` says why).
    """

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    text: str
    output_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] | None = None  # for new_token_ids
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
