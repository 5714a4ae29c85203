"""The offline API: `LLM(model).generate(prompts, params)` and `LLM(model).chat(messages)`.

It drives the same `Engine` the server uses (one code path): all prompts are queued at once
and run with continuous batching until every one is done.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.sampling_params import SamplingParams


@dataclass
class Completion:
    """One finished sequence."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    """The result for one prompt; `.text` etc. are those of the first of its `n` completions."""

    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.completions[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.completions[0].logprobs


Prompt = str | list[int]


class LLM:
    """Offline batch generation on one model; `engine_kwargs` are EngineConfig fields."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        """Complete each prompt (text, or token ids used as they are)."""
        items = _as_list(prompts)
        encoded = [
            (p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in items
        ]
        return self._run(encoded, params or SamplingParams())

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> list[GenerationResult]:
        """Answer one conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(
                conv, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, params or SamplingParams())

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[GenerationResult]:
        results = [GenerationResult(text, ids) for text, ids in encoded]
        ids = {}
        for i, (_, prompt) in enumerate(encoded):
            for j in range(params.n):
                # n > 1 with a seed: each completion gets its own seed, still reproducible.
                p = params if params.seed is None or j == 0 else dataclasses.replace(
                    params, seed=params.seed + j)
                rid = f"llm-{id(self)}-{i}-{j}"
                self.engine.add_request(rid, prompt, p)
                ids[rid] = (i, j)
        done: dict[str, Completion] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}  # streamed pieces, joined at the end
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.request_id not in ids:
                    continue
                logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
                if out.finished:
                    done[out.request_id] = _completion(out, logprobs.pop(out.request_id))
        for rid, (i, _) in sorted(ids.items(), key=lambda kv: kv[1]):
            results[i].completions.append(done[rid])
        return results


def _completion(out, logprobs: list[TokenLogprob]) -> Completion:
    lps = logprobs if out.logprobs is not None else None
    return Completion(out.text, out.output_token_ids, out.finish_reason, out.stop_reason, lps,
                      out.error)


def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt as token ids
    return list(prompts)
