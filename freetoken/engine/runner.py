"""The model runner: owns the KV tensors, builds the ForwardContext, runs the model.

Input of a step: the scheduled requests and how many tokens each feeds. Output: float32
logits `[S, V]`, one row per request that samples this step, in batch order (on the device:
the caller reads back only the sampled ids).

`prepare` builds a step's metadata with numpy over whole arrays (no loop per token), packs it
into one host buffer (pinned on CUDA; int32 fields viewed in its tail) and sends it in one
non-blocking copy. Pure-decode
steps on CUDA replay a captured graph (`freetoken.engine.cuda_graph`); the rest run eagerly.
"""

from __future__ import annotations

import logging
from itertools import chain

import numpy as np
import torch

from freetoken.engine.context import ForwardContext
from freetoken.engine.scheduler import ScheduledBatch
from freetoken.kernels import cpu_kernels

logger = logging.getLogger(__name__)


def kv_bytes_per_page(model, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV page over all attention layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * page_size * h * d * elem for h, d in model.kv_cache_shapes())


def has_recurrent_state(model) -> bool:
    """Hybrid models (qwen3.5) keep per-request recurrent state besides the KV pages."""
    return bool(getattr(model, "state_shapes", lambda: [])())


def new_token_ids(req, start: int, n: int) -> list[int]:
    """Tokens [start, start + n) of prompt + output, without joining the two lists."""
    prompt, p = req.prompt_token_ids, len(req.prompt_token_ids)
    if start >= p:
        return req.output_token_ids[start - p:start - p + n]
    if start + n <= p:
        return prompt[start:start + n]
    return prompt[start:] + req.output_token_ids[:start + n - p]


class ModelRunner:
    def __init__(
        self, model, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
        num_state_slots: int = 0, *, max_model_len: int | None = None,
        cuda_graph_max_bs: int = 0, step_hook=None,
    ) -> None:
        """`cuda_graph_max_bs` > 0 on a CUDA device: capture decode graphs for batches up to
        that size now, at start-up (0, or a CPU device: every step runs eagerly). `step_hook`
        (num_tokens) runs before every forward, graph replays included (the MoE runtime's
        begin_step)."""
        self.model = model
        self.page_size = page_size
        self.device = torch.device(device)
        # One [2, num_pages, page_size, n_kv, d] tensor per attention layer (K = 0, V = 1).
        self.kv_caches = [
            torch.zeros(2, num_pages, page_size, h, d, dtype=dtype, device=device)
            for h, d in model.kv_cache_shapes()
        ]
        # Recurrent-state pools (one slot per running request) for linear-attention layers,
        # plus one scratch slot (the last) that padded rows of a captured batch write.
        self.states: list = []
        self.free_slots: list[int] = []
        self.scratch_slot = num_state_slots
        if has_recurrent_state(model):
            from freetoken.layers.gdn import alloc_states

            self.states = alloc_states(model.state_shapes(), num_state_slots + 1, device)
            self.free_slots = list(range(num_state_slots - 1, -1, -1))
        self.graphs = None
        self.step_hook = step_hook
        # Decode steps with torch's intra-op threads at 1 (cpu_kernels.torch_threads): on the
        # CPU the weights run on the executor's pool between small torch ops.
        self.single_thread_decode = self.device.type == "cpu"
        if self.device.type == "cpu":
            cpu_kernels.executor()  # its pool takes torch's thread count now, not a decode step's
        if cuda_graph_max_bs > 0 and self.device.type == "cuda":
            self._capture(cuda_graph_max_bs, max_model_len or num_pages * page_size)

    def _capture(self, max_bs: int, max_model_len: int) -> None:
        from freetoken.engine.cuda_graph import CudaGraphRunner

        graphs = CudaGraphRunner(self, max_bs, -(-max_model_len // self.page_size))
        try:
            graphs.capture()
        except Exception:  # noqa: BLE001 - graphs are an optimisation: run eagerly instead
            logger.exception("CUDA graph capture failed; decode runs eagerly")
            return
        self.graphs = graphs

    def release_state(self, req) -> None:
        """Give a request's state slot back (finished, aborted or preempted; idempotent)."""
        if req.state_slot is not None:
            self.free_slots.append(req.state_slot)
            req.state_slot = None

    def _state_slots(self, batch: ScheduledBatch) -> list[int]:
        if not self.states:
            return []
        for req in batch.requests:
            if req.state_slot is None:  # NOTE: slots = max running requests, so one is free
                req.state_slot = self.free_slots.pop()
        return [r.state_slot for r in batch.requests]

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits of the batch's sampling rows. `input_ids` (a device tensor, one id per new
        token) replaces the ids the requests hold: a decode step launched from the previous
        step's ids before the host has read them (the engine's overlap)."""
        ctx, ids = self.prepare(batch)
        if input_ids is None:
            input_ids = ids
        elif input_ids.shape != ids.shape:
            raise ValueError(f"forward: {tuple(input_ids.shape)} input ids for a step of "
                             f"{ids.shape[0]} tokens")
        if self.step_hook is not None:
            self.step_hook(input_ids.shape[0])
        if self.graphs is not None and self.graphs.can_run(ctx):
            return self.graphs.run(input_ids, ctx)
        if self.single_thread_decode and ctx.is_decode:
            with cpu_kernels.torch_threads(1):
                return self.run_model(input_ids, ctx)
        return self.run_model(input_ids, ctx)

    def run_model(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.model.forward(input_ids, ctx)  # [T, H]
        return self.model.compute_logits(hidden[ctx.logits_indices]).float()  # [S, V]

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardContext, torch.Tensor]:
        """Flatten the batch's new tokens and describe their place in the paged KV cache."""
        reqs = batch.requests
        b = len(reqs)
        width = max(len(r.pages) for r in reqs)
        table = np.zeros((b, width), np.int64)
        for i, r in enumerate(reqs):
            table[i, :len(r.pages)] = r.pages
        decode = all(k == 1 for k in batch.num_new)
        ids, positions, slots, rows, cu, seq_lens = (
            self._decode_rows(reqs) if decode else self._token_rows(batch, table))
        state_slots = self._state_slots(batch)
        longs = [ids, positions, slots, rows, state_slots]
        ints = [cu, seq_lens, table.reshape(-1)]
        (ids_t, pos_t, slots_t, rows_t, state_t), (cu_t, lens_t, table_t) = self._upload(
            longs, ints)
        ctx = ForwardContext(
            positions=pos_t,
            cu_seqlens_q=cu_t,
            seq_lens=lens_t,
            page_table=table_t.reshape(b, width),
            slot_mapping=slots_t,
            logits_indices=rows_t,
            page_size=self.page_size,
            kv_caches=self.kv_caches,
            state_slots=state_t if self.states else None,
            recurrent_states=self.states,
            cu_seqlens_q_list=list(cu),
            seq_lens_list=list(seq_lens),
            state_slots_list=state_slots,
            max_seqlen_q=max(batch.num_new),
        )
        return ctx, ids_t

    def _decode_rows(self, reqs: list) -> tuple[list[int], ...]:
        """One new token per request (the hot path): plain lists of length B."""
        ps = self.page_size
        pos = [r.num_computed for r in reqs]
        ids = [new_token_ids(r, p, 1)[0] for r, p in zip(reqs, pos)]
        slots = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, pos)]
        rows = [i for i, (r, p) in enumerate(zip(reqs, pos)) if p + 1 == r.num_tokens]
        return ids, pos, slots, rows, list(range(len(reqs) + 1)), [p + 1 for p in pos]

    def _token_rows(self, batch: ScheduledBatch, table: np.ndarray) -> tuple[list[int], ...]:
        """Any mix of prefill chunks and decodes: numpy over the T tokens (no loop per token).
        """
        ps, reqs = self.page_size, batch.requests
        b = len(reqs)
        n = np.asarray(batch.num_new, dtype=np.int64)
        start = np.fromiter((r.num_computed for r in reqs), np.int64, b)
        total = np.fromiter((r.num_tokens for r in reqs), np.int64, b)
        cu = np.zeros(b + 1, np.int64)
        np.cumsum(n, out=cu[1:])
        seq = np.repeat(np.arange(b), n)  # [T] sequence of each token
        positions = np.arange(cu[-1]) - cu[:-1][seq] + start[seq]
        slots = table[seq, positions // ps] * ps + positions % ps
        rows = cu[1:][start + n == total] - 1
        ids = list(chain.from_iterable(
            new_token_ids(r, s, k) for r, s, k in zip(reqs, start.tolist(), n.tolist())))
        return (ids, positions.tolist(), slots.tolist(), rows.tolist(), cu.tolist(),
                (start + n).tolist())

    def _upload(self, longs: list[list[int]], ints: list
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """int64 arrays and int32 arrays on the device in one host -> device copy: the int32
        values ride in the int64 buffer's tail and come out as an int32 view (no conversion
        kernels). On CUDA the copy is from pinned memory and non-blocking: the caching host
        allocator keeps the pinned block until the copy has run, so nothing waits here."""
        small = np.concatenate([np.asarray(a, np.int32) for a in ints])
        if small.size % 2:
            small = np.append(small, np.int32(0))
        flat = list(chain.from_iterable(longs))
        host = torch.from_numpy(np.concatenate([np.asarray(flat, np.int64),
                                                small.view(np.int64)]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        n_long = sum(len(a) for a in longs)
        tail = dev[n_long:].view(torch.int32)
        sizes = [len(a) for a in ints]
        return (list(dev[:n_long].split([len(a) for a in longs])),
                list(tail.split(sizes + [small.size - sum(sizes)]))[:len(ints)])
