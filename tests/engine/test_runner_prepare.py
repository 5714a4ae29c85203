"""ModelRunner.prepare (numpy over whole arrays, one upload) builds the same ForwardContext as
the per-token loop it replaced, kept here as the oracle."""

from __future__ import annotations

import sys

import pytest
import torch

from freetoken.engine.context import ForwardContext
from freetoken.engine.request import Request
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import ScheduledBatch


class FakeModel:
    """What the runner asks of a model before any forward: KV (and state) shapes."""

    def __init__(self, states: bool):
        self.states = states

    def kv_cache_shapes(self):
        return [(2, 8)]

    def state_shapes(self):
        return [((6, 3), (2, 4, 4))] if self.states else []


def old_prepare(runner, batch: ScheduledBatch) -> tuple[ForwardContext, torch.Tensor]:
    """The per-token loop of the original runner (state slots as the runner assigned them)."""
    ps = runner.page_size
    ids, positions, slots, cu, seq_lens, logits_rows = [], [], [], [0], [], []
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_new)):
        start, end = req.num_computed, req.num_computed + n
        ids += req.all_token_ids[start:end]
        positions += range(start, end)
        slots += [req.pages[p // ps] * ps + p % ps for p in range(start, end)]
        cu.append(cu[-1] + n)
        seq_lens.append(end)
        if batch.samples(i):
            logits_rows.append(cu[-1] - 1)
    max_pages = max(len(r.pages) for r in batch.requests)
    table = [r.pages + [0] * (max_pages - len(r.pages)) for r in batch.requests]
    ctx = ForwardContext(
        positions=torch.tensor(positions, dtype=torch.long),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
        page_size=ps, cu_seqlens_q_list=cu, seq_lens_list=seq_lens,
        state_slots=(torch.tensor([r.state_slot for r in batch.requests], dtype=torch.long)
                     if runner.states else None),
    )
    return ctx, torch.tensor(ids, dtype=torch.long)


def request(rid: int, prompt_len: int, out_len: int, computed: int, ps: int,
            gen: torch.Generator) -> Request:
    prompt = torch.randint(0, 1000, (prompt_len,), generator=gen).tolist()
    req = Request(request_id=str(rid), prompt_token_ids=prompt, params=SamplingParams(),
                  max_tokens=64, arrival=rid, detok=None, generator=gen)
    req.output_token_ids = torch.randint(0, 1000, (out_len,), generator=gen).tolist()
    req.num_computed = computed
    pages = torch.randperm(200, generator=gen)[: -(-(prompt_len + out_len) // ps)]
    req.pages = pages.tolist()
    return req


# (prompt length, output length, computed, new tokens): a fresh prompt, a chunk after a
# cached prefix (does not sample), decodes across page boundaries, a recompute after
# preemption whose new tokens span prompt and output, a one-token prompt.
CASES = [(23, 0, 0, 23), (40, 0, 16, 10), (9, 7, 15, 1), (5, 12, 16, 1), (8, 4, 0, 12),
         (1, 0, 0, 1), (17, 0, 16, 1)]
FIELDS = ("positions", "cu_seqlens_q", "seq_lens", "page_table", "slot_mapping",
          "logits_indices", "state_slots")


@pytest.mark.parametrize("states", [False, True])
@pytest.mark.parametrize("order", [list(range(len(CASES))), [2, 3, 6], [0]])
def test_prepare_matches_per_token_loop(states, order):
    gen = torch.Generator().manual_seed(len(order) + states)
    ps = 4
    runner = ModelRunner(FakeModel(states), 200, ps, torch.float32, torch.device("cpu"),
                         num_state_slots=8 if states else 0)
    batch = ScheduledBatch()
    for i in order:
        p, o, c, n = CASES[i]
        batch.add(request(i, p, o, c, ps, gen), n)
    ctx, ids = runner.prepare(batch)
    ref, ref_ids = old_prepare(runner, batch)
    assert torch.equal(ids, ref_ids)
    for f in FIELDS:
        a, b = getattr(ctx, f), getattr(ref, f)
        if b is None:
            assert a is None, f
            continue
        assert a.dtype == b.dtype and torch.equal(a, b), f
    assert ctx.cu_seqlens_q_list == ref.cu_seqlens_q_list
    assert ctx.seq_lens_list == ref.seq_lens_list
    assert ctx.max_seqlen_q == max(CASES[i][3] for i in order)
    assert ctx.is_decode == all(CASES[i][3] == 1 for i in order)
    if states:  # slots handed out once, never the scratch slot
        assert ctx.state_slots_list == [r.state_slot for r in batch.requests]
        assert runner.scratch_slot not in ctx.state_slots_list
        assert runner.states[0][0].shape[0] == 9


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
