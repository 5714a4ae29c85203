"""Turn one logits row per request into a token: penalties, filters, a draw, logprobs.

Order (as transformers' logits processors apply them): repetition penalty (prompt and output
tokens; positive logits divided, negative multiplied), frequency / presence penalties (OpenAI:
output tokens only, `l -= f * count + p * (count > 0)`), then greedy argmax, or temperature ->
top-k -> top-p -> min-p -> renormalise -> draw with the request's own generator. A request's
generator is seeded from its `seed` (or from the engine's seed stream), so a seeded request
draws the same tokens alone or in any batch.

Logprobs are those of the model's raw distribution, `log_softmax(logits)`, before penalties
and temperature (what OpenAI's `logprobs` reports and vLLM's default).
"""

from __future__ import annotations

import torch

from freetoken.engine.outputs import TokenLogprob
from freetoken.engine.sampling_params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Penalised copy of one logits row [V] (or the row itself when no penalty is set)."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        vals = logits[seen]
        p = params.repetition_penalty
        logits = logits.clone()
        logits[seen] = torch.where(vals > 0, vals / p, vals * p)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        ids, counts = torch.unique(torch.tensor(output_ids, dtype=torch.long), return_counts=True)
        delta = params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
        logits = logits.clone()
        logits[ids] -= delta
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution [V] (float32) after temperature, top-k, top-p and min-p."""
    x = logits.float() / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th are kept
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly better tokens
        drop = before >= params.top_p  # keep the smallest prefix reaching top_p; never the 1st
        probs = probs.clone()
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    generator: torch.Generator,
) -> int:
    """One token id from one logits row [V]."""
    x = apply_penalties(logits, params, prompt_ids, output_ids)
    if params.greedy:
        return int(torch.argmax(x))
    probs = probs_from_logits(x, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """The raw-distribution logprob of `token_id` and the k most likely alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = torch.topk(lp, k)
        top = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return TokenLogprob(token_id=token_id, logprob=float(lp[token_id]), top=top)


def check_late(params: SamplingParams, vocab_size: int) -> None:
    """Sampling values that only the engine can judge (it knows the vocabulary)."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad} outside the vocabulary [0, {vocab_size})")
    if params.temperature != 0 and params.temperature < 1e-5:
        raise ValueError(f"temperature {params.temperature} is too small; use 0 for greedy")
