"""The batched sampler (`sampler.sample_batch`, tensor ops over all rows) against the per-row
sampler: the same greedy tokens, the same filtered distributions, and seeded draws whose
frequencies match the reference distribution (chi-square bound below; fixed seeds, so the
test is deterministic, not flaky)."""

from __future__ import annotations

import sys

import pytest
import torch

from freetoken.engine import sampler
from freetoken.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_matches_per_row(device):
    x = logits(9, 1000)
    x[3, 17] = x[3, 400] = x[3].max() + 1  # a tie: both take the first
    params = [SamplingParams(temperature=0)] * 9
    ids = sampler.sample_batch(x.to(device), params, [0] * 9, [0] * 9)
    ref = [sampler.sample_token(r, params[0], [], [], torch.Generator()) for r in x]
    assert sampler.read_ids(ids) == ref


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_a_mixed_batch(device):
    x = logits(6, 300, seed=1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5)] * 3
    ids = sampler.read_ids(sampler.sample_batch(x.to(device), params, [1] * 6, [2] * 6))
    assert ids[0::2] == x[0::2].argmax(-1).tolist()
    for row, tok in zip(x[1::2], ids[1::2]):  # drawn from the top 5
        assert tok in torch.topk(row, 5).indices.tolist()


KW = [dict(temperature=0.8), dict(temperature=1.3, top_k=7), dict(temperature=0.9, top_p=0.8),
      dict(temperature=1.0, min_p=0.05), dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.01)]


def test_filtered_distribution_equals_per_row():
    x = logits(len(KW), 200, seed=2)
    params = [SamplingParams(**kw) for kw in KW]
    temp = torch.tensor([p.temperature for p in params])
    f = sampler.filter_logits(x / temp[:, None], torch.tensor([p.top_k for p in params]),
                              torch.tensor([p.top_p for p in params]),
                              torch.tensor([p.min_p for p in params]))
    for row, p, frow in zip(x, params, f):
        ref = sampler.probs_from_logits(row, p)
        torch.testing.assert_close(torch.softmax(frow, -1), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", KW[1:3] + KW[4:])
def test_seeded_draws_follow_the_distribution(device, kw):
    """20,000 draws of one row (steps 0..N-1 of one seed). Pearson's chi-square over the
    tokens of probability >= 5/N, with the rest pooled, must stay below df + 8 sqrt(2 df)
    (about 5.7 standard deviations: a correct sampler fails it with probability < 1e-6);
    tokens the filters remove must never appear."""
    n, vocab = 20000, 60
    row = logits(1, vocab, seed=3)[0]
    p = SamplingParams(**kw)
    probs = sampler.probs_from_logits(row, p).double()
    ids = sampler.sample_batch(row.expand(n, vocab).contiguous().to(device), [p] * n,
                               [1234] * n, list(range(n)))
    counts = torch.bincount(ids.cpu(), minlength=vocab).double()
    assert counts[probs == 0].sum() == 0
    big = probs * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([probs[big], probs[~big].sum()[None]]) * n
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 8 * (2 * df) ** 0.5, (chi2, df)


def test_seeded_draw_independent_of_batch():
    x = logits(4, 500, seed=4)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    alone = sampler.sample_batch(x[2:3], [p], [77], [5]).tolist()
    batched = sampler.sample_batch(x, [p] * 4, [1, 2, 77, 3], [0, 9, 5, 1]).tolist()
    assert batched[2] == alone[0]
    again = sampler.sample_batch(x[2:3], [p], [78], [5]).tolist()
    other = [sampler.sample_batch(x[2:3], [p], [s], [5]).item() for s in range(20)]
    assert len(set(other)) > 1 and isinstance(again[0], int)  # the seed matters


def test_batchable():
    assert sampler.batchable(SamplingParams(temperature=0.5, top_k=3, min_p=0.1))
    assert not sampler.batchable(SamplingParams(repetition_penalty=1.1))
    assert not sampler.batchable(SamplingParams(presence_penalty=0.5))
    assert not sampler.batchable(SamplingParams(logprobs=2))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
