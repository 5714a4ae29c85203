"""The model runner: owns the KV tensors, builds the ForwardContext, runs the model.

Input of a step: the scheduled requests and how many tokens each feeds. Output: float32
logits `[S, V]`, one row per request that samples this step, in batch order.
"""

from __future__ import annotations

import torch

from freetoken.engine.context import ForwardContext
from freetoken.engine.scheduler import ScheduledBatch


def kv_bytes_per_page(model, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV page over all attention layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * page_size * h * d * elem for h, d in model.kv_cache_shapes())


def has_recurrent_state(model) -> bool:
    """Hybrid models (qwen3.5) keep per-request recurrent state besides the KV pages."""
    return bool(getattr(model, "state_shapes", lambda: [])())


class ModelRunner:
    def __init__(
        self, model, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
        num_state_slots: int = 0,
    ) -> None:
        self.model = model
        self.page_size = page_size
        self.device = device
        # One [2, num_pages, page_size, n_kv, d] tensor per attention layer (K = 0, V = 1).
        self.kv_caches = [
            torch.zeros(2, num_pages, page_size, h, d, dtype=dtype, device=device)
            for h, d in model.kv_cache_shapes()
        ]
        # Recurrent-state pools (one slot per running request) for linear-attention layers.
        self.states: list = []
        self.free_slots: list[int] = []
        if has_recurrent_state(model):
            from freetoken.layers.gdn import alloc_states

            self.states = alloc_states(model.state_shapes(), num_state_slots, device)
            self.free_slots = list(range(num_state_slots - 1, -1, -1))

    def release_state(self, req) -> None:
        """Give a request's state slot back (finished, aborted or preempted; idempotent)."""
        if req.state_slot is not None:
            self.free_slots.append(req.state_slot)
            req.state_slot = None

    def _state_slots(self, batch: ScheduledBatch) -> torch.Tensor | None:
        if not self.states:
            return None
        for req in batch.requests:
            if req.state_slot is None:  # NOTE: slots = max running requests, so one is free
                req.state_slot = self.free_slots.pop()
        return torch.tensor([r.state_slot for r in batch.requests], dtype=torch.long,
                            device=self.device)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        ctx, input_ids = self.prepare(batch)
        hidden = self.model.forward(input_ids, ctx)  # [T, H]
        return self.model.compute_logits(hidden[ctx.logits_indices]).float()  # [S, V]

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardContext, torch.Tensor]:
        """Flatten the batch's new tokens and describe their place in the paged KV cache."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
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
        dev = self.device
        ctx = ForwardContext(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            page_size=ps,
            kv_caches=self.kv_caches,
            cu_seqlens_q_list=cu,
            seq_lens_list=seq_lens,
            state_slots=self._state_slots(batch),
            recurrent_states=self.states,
        )
        return ctx, torch.tensor(ids, dtype=torch.long, device=dev)
