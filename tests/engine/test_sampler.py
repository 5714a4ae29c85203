"""The sampler against references we did not write: transformers' logits processors and numpy.

Tolerances: the filtered distributions are compared at 1e-6 absolute (float32 softmax of the
same logits by two implementations); sampling frequencies within 5 standard errors.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from freetoken.engine.sampler import (
    apply_penalties,
    check_late,
    probs_from_logits,
    sample_token,
    token_logprob,
)
from freetoken.engine.sampling_params import SamplingParams

V = 64


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 3


def _hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits[None].clone()
    procs = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k:
        procs.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        procs.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        procs.append(MinPLogitsWarper(p.min_p))
    for proc in procs:
        x = proc(None, x)
    return torch.softmax(x, dim=-1)[0]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=5),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=0.5, min_p=0.1),
        dict(temperature=1.1, top_k=20, top_p=0.9, min_p=0.05),
    ],
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_filtered_distribution_matches_transformers(kw, seed):
    p = SamplingParams(**kw)
    logits = _logits(seed)
    ours = probs_from_logits(logits, p)
    ref = _hf_probs(logits, p)
    assert torch.allclose(ours, ref, atol=1e-6), (ours - ref).abs().max()


def test_repetition_penalty_matches_transformers():
    logits = _logits(3)
    prompt, output = [1, 5, 9], [9, 12, 40, 40]
    p = SamplingParams(repetition_penalty=1.3)
    ours = apply_penalties(logits, p, prompt, output)
    ids = torch.tensor([prompt + output])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[None].clone())[0]
    assert torch.equal(ours, ref)


def test_frequency_presence_penalties_match_openai_formula():
    logits = _logits(4)
    output = [3, 3, 3, 7, 50]
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    ours = apply_penalties(logits, p, [1, 2], output).numpy()
    ref = logits.numpy().astype(np.float64).copy()
    counts = np.bincount(output, minlength=V)
    ref -= counts * 0.5 + (counts > 0) * 0.25  # OpenAI's documented formula, output tokens only
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_greedy_takes_argmax_after_penalties():
    logits = torch.zeros(V)
    logits[10], logits[11] = 2.0, 1.9
    g = torch.Generator()
    assert sample_token(logits, SamplingParams(temperature=0), [], [], g) == 10
    p = SamplingParams(temperature=0, repetition_penalty=1.2)
    assert sample_token(logits, p, [10], [], g) == 11  # 2.0 / 1.2 < 1.9


def test_sampling_frequencies_follow_the_distribution():
    logits = _logits(5)
    p = SamplingParams(temperature=0.8, top_k=6)
    probs = _hf_probs(logits, p).double().numpy()
    g = torch.Generator().manual_seed(7)
    n = 4000
    draws = np.bincount([sample_token(logits, p, [], [], g) for _ in range(n)], minlength=V)
    se = np.sqrt(probs * (1 - probs) / n) + 1e-12
    assert np.all(np.abs(draws / n - probs) <= 5 * se + 1e-9)
    assert draws[probs == 0].sum() == 0  # filtered tokens never drawn


def test_seed_reproducible():
    logits = _logits(6)
    p = SamplingParams(temperature=1.0, seed=3)
    a = [sample_token(logits, p, [], [], torch.Generator().manual_seed(3)) for _ in range(5)]
    b = [sample_token(logits, p, [], [], torch.Generator().manual_seed(3)) for _ in range(5)]
    assert a == b


def test_logprobs_are_raw_log_softmax():
    logits = _logits(8)
    lp = token_logprob(logits, 4, 3)
    ref = logits.double() - torch.logsumexp(logits.double(), 0)
    assert abs(lp.logprob - ref[4].item()) < 1e-5
    order = torch.argsort(ref, descending=True)[:3].tolist()
    assert [t for t, _ in lp.top] == order
    assert all(abs(v - ref[t].item()) < 1e-5 for t, v in lp.top)


def test_bad_values():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        check_late(SamplingParams(stop_token_ids=[V]), V)
    with pytest.raises(ValueError, match="temperature"):
        check_late(SamplingParams(temperature=1e-9), V)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
