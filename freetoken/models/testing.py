"""A minimal paged KV pool and ForwardContext builder for tests, goldens and scripts.

The engine's runner (freetoken/engine) is the real thing; this is the smallest correct driver
of a CausalLM: it hands out pages from a free list in a scrambled order (so paging bugs show),
and builds the context for a step in which each sequence appends some tokens.
"""

from __future__ import annotations

import torch

from freetoken.engine.context import ForwardContext


class SimpleKV:
    """Paged KV caches for `model.kv_cache_shapes()` and per-sequence page lists."""

    def __init__(self, kv_shapes, num_pages: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        self.page_size = page_size
        self.caches = [torch.zeros(2, num_pages, page_size, h, d, dtype=dtype, device=device)
                       for h, d in kv_shapes]
        # Scrambled free list: consecutive pages of a sequence are not adjacent in memory.
        self.free = [int(p) for p in torch.randperm(num_pages, generator=torch.Generator()
                                                    .manual_seed(0))]
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _grow(self, seq: int, new_len: int) -> None:
        pages = self.pages.setdefault(seq, [])
        while len(pages) * self.page_size < new_len:
            if not self.free:
                raise RuntimeError("SimpleKV: out of pages")
            pages.append(self.free.pop())

    def context(self, steps: list[tuple[int, int]], all_logits: bool = False) -> ForwardContext:
        """steps: (seq id, number of new tokens) per sequence, in batch order."""
        positions, slots, cu, seq_lens = [], [], [0], []
        for seq, n in steps:
            start = self.lens.get(seq, 0)
            self._grow(seq, start + n)
            pages = self.pages[seq]
            for p in range(start, start + n):
                positions.append(p)
                slots.append(pages[p // self.page_size] * self.page_size + p % self.page_size)
            self.lens[seq] = start + n
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
        width = max(len(self.pages[s]) for s, _ in steps)
        table = [self.pages[s] + [0] * (width - len(self.pages[s])) for s, _ in steps]
        dev = self.caches[0].device if self.caches else "cpu"
        logits_idx = list(range(cu[-1])) if all_logits else [c - 1 for c in cu[1:]]
        return ForwardContext(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            page_size=self.page_size, kv_caches=self.caches,
            cu_seqlens_q_list=cu, seq_lens_list=seq_lens,
        )


def pages_needed(lengths: list[int], page_size: int) -> int:
    return sum(-(-n // page_size) for n in lengths)


@torch.inference_mode()
def prefill_logits(model, token_lists: list[list[int]], page_size: int = 16) -> list[torch.Tensor]:
    """All-position logits [L_i, V] (fp32) of each sequence, in one batched forward."""
    dev = model.model.norm.weight.device
    kv = SimpleKV(model.kv_cache_shapes(), pages_needed([len(t) for t in token_lists], page_size),
                  page_size, dtype=_model_dtype(model), device=dev)
    ctx = kv.context([(i, len(t)) for i, t in enumerate(token_lists)], all_logits=True)
    attach_states(model, ctx, len(token_lists))
    ids = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.int64, device=dev)
    logits = model.compute_logits(model(ids, ctx)[ctx.logits_indices])
    return list(logits.split([len(t) for t in token_lists]))


def decode_logits(model, prompts: list[list[int]], continuations: list[list[int]],
                  page_size: int = 16) -> list[torch.Tensor]:
    """Teacher-forced logits [len(c), V] (fp32) of each continuation c, the way the engine
    decodes: the prompts prefilled in one forward, then one token per sequence per step (every
    sequence in one batch; all continuations have the same length)."""
    n = len(continuations[0])
    assert all(len(c) == n for c in continuations), "continuations of one length"
    dev = model.model.norm.weight.device
    lens = [len(p) + n for p in prompts]
    kv = SimpleKV(model.kv_cache_shapes(), pages_needed(lens, page_size), page_size,
                  dtype=_model_dtype(model), device=dev)
    states = None
    out = []
    for j in range(n):
        feed = prompts if j == 0 else [[c[j - 1]] for c in continuations]
        ctx = kv.context([(i, len(f)) for i, f in enumerate(feed)])
        states = attach_states(model, ctx, len(feed), states)
        ids = torch.tensor([t for f in feed for t in f], dtype=torch.int64, device=dev)
        out.append(model.compute_logits(model(ids, ctx)[ctx.logits_indices]).float())
    return list(torch.stack(out, dim=1))  # per sequence [n, V]


def attach_states(model, ctx: ForwardContext, num_seqs: int, states=None) -> list:
    """Recurrent-state pools for hybrid models (qwen3.5): sequence i uses slot i. Pass the
    returned pools back in on later steps of the same sequences."""
    shapes = getattr(model, "state_shapes", lambda: [])()
    if shapes:
        from freetoken.layers.gdn import alloc_states

        dev = model.model.norm.weight.device
        states = states if states is not None else alloc_states(shapes, num_seqs, dev)
        ctx.recurrent_states = states
        ctx.state_slots = torch.arange(num_seqs, device=dev)
    return states or []


def _model_dtype(model) -> torch.dtype:
    return model.model.embed_tokens.dtype
