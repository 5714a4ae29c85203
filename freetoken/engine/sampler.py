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


# ---- batched sampling on the device ----------------------------------------------------------
# Rows without penalties or logprobs are sampled together by tensor ops over [S, V], with no
# host sync until the caller reads the ids. A draw is the Gumbel-max trick: argmax of the
# filtered logits / T plus Gumbel noise, which picks token i with probability p_i exactly. The
# noise is a counter-based hash of (request seed, step, token id), so a seeded request draws
# the same tokens alone or in any batch, and no per-request generator state is needed.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def batchable(params: SamplingParams) -> bool:
    """Whether `sample_batch` can sample this request (no penalties, no logprobs)."""
    return (params.repetition_penalty == 1.0 and not params.frequency_penalty
            and not params.presence_penalty and params.logprobs is None)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplication wraps around, as in C)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [S, V] (float32) from int64 seeds [S] and steps [S]."""
    row = _mix(_mix(seeds) ^ steps)[:, None]  # [S, 1]
    ids = torch.arange(vocab, dtype=torch.long, device=seeds.device)[None, :]
    bits = _shr(_mix(row + ids * _GOLDEN), 11)  # 53 random bits
    u = (bits.double() + 0.5) * 2.0**-53  # (0, 1)
    return (-torch.log(-torch.log(u))).float()


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a sync (pinned, non-blocking on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def filter_logits(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Temperature-scaled logits [S, V] with top-k, top-p, min-p (per row, as in
    `probs_from_logits`) applied as -inf; a row's limit that is off changes nothing."""
    vocab = x.shape[1]
    srt, order = torch.sort(x, dim=-1, descending=True)
    on = (top_k > 0) & (top_k < vocab)
    kth = srt.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # [S, 1]
    kth = torch.where(on[:, None], kth, torch.full_like(kth, float("-inf")))
    srt = srt.masked_fill(srt < kth, float("-inf"))  # ties with the k-th are kept
    probs = torch.softmax(srt, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
    drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # cumsum may round past 1
    drop |= probs < min_p[:, None] * probs[:, :1]
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, srt)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 steps: list[int]) -> torch.Tensor:
    """Token ids int64 [S] (on logits' device) for rows that are all `batchable`.

    Greedy rows take the argmax; the others temperature -> top-k -> top-p -> min-p -> a draw
    keyed by (seed, step). Launches only device work: the ids stay on the device."""
    dev = logits.device
    greedy = torch.argmax(logits, dim=-1)
    if all(p.greedy for p in params):
        return greedy
    temp = upload([p.temperature or 1.0 for p in params], torch.float32, dev)
    x = logits.float() / temp[:, None]
    if any(0 < p.top_k < x.shape[1] or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        lim = upload([[p.top_p, p.min_p] for p in params], torch.float32, dev)
        k = upload([p.top_k for p in params], torch.long, dev)
        x = filter_logits(x, k, lim[:, 0], lim[:, 1])
    ints = upload([[s & (2**63 - 1) for s in seeds], steps], torch.long, dev)  # any seed fits
    drawn = torch.argmax(x + gumbel_noise(ints[0], ints[1], x.shape[1]), dim=-1)
    is_greedy = upload([p.greedy for p in params], torch.bool, dev)
    return torch.where(is_greedy, greedy, drawn)


def start_read(ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Device ids -> a pinned buffer, non-blocking, and the event recorded after that copy
    (None off CUDA: a copy made at once). `finish_read` waits for it."""
    if not ids.is_cuda:
        return ids.clone(), None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def finish_read(host: torch.Tensor, done: torch.cuda.Event | None) -> list[int]:
    """`start_read`'s ids as a list, after waiting for that copy's event alone."""
    if done is not None:
        done.synchronize()
    return host.tolist()


def read_ids(ids: torch.Tensor) -> list[int]:
    """The step's one host sync: device ids -> a pinned buffer (non-blocking), wait for that
    copy's event alone, then a list."""
    if not ids.is_cuda:
        return ids.tolist()
    return finish_read(*start_read(ids))
