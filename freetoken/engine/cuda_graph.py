"""Decode steps as CUDA graphs, one per batch-size bucket (the nano-vllm way).

Buckets are 1, 2, 4, 8, then multiples of 16 up to `max_bs` (and `max_bs` itself). They are
captured at engine start, largest first, all in one memory pool (a smaller graph reuses the
larger one's memory). A graph reads its inputs from static buffers sized for `max_bs`; a step
copies its inputs in (device to device), pads the bucket's extra rows, replays and returns a
view of the static logits. Only pure-decode steps (every request feeds one token and samples)
replay a graph; prefill runs eagerly.

Padded rows are harmless by construction: slot -1 (the KV store skips it), one key of page 0,
position 0, and the runner's scratch recurrent-state slot.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken.engine.context import ForwardContext

logger = logging.getLogger(__name__)


def buckets(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, 16, 32, ... (multiples of 16), and max_bs."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes) | {max_bs})


class CudaGraphRunner:
    def __init__(self, runner, max_bs: int, max_pages: int) -> None:
        self.runner = runner
        self.max_bs, self.max_pages = max_bs, max_pages
        self.sizes = buckets(max_bs)
        dev = runner.device

        def z(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        self.input_ids = z(max_bs)
        self.positions = z(max_bs)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.page_table = z(max_bs, max_pages, dtype=torch.int32)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(max_bs, dtype=torch.long, device=dev)
        self.state_slots = torch.full((max_bs,), runner.scratch_slot, dtype=torch.long,
                                      device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def _ctx(self, bs: int) -> ForwardContext:
        """A context over the first bs rows of the static buffers (no host lists: a graph
        must not depend on them)."""
        r = self.runner
        return ForwardContext(
            positions=self.positions[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
            seq_lens=self.seq_lens[:bs], page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[:bs], logits_indices=self.logits_indices[:bs],
            page_size=r.page_size, kv_caches=r.kv_caches,
            state_slots=self.state_slots[:bs] if r.states else None,
            recurrent_states=r.states, max_seqlen_q=1,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool."""
        t0 = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):
            ctx = self._ctx(bs)
            ids = self.input_ids[:bs]
            self.runner.run_model(ids, ctx)  # warm-up: Triton JIT, lazy buffers
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.logits[bs] = self.runner.run_model(ids, ctx)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) at start-up in %.1f s",
                    len(self.sizes), ",".join(map(str, self.sizes)), time.perf_counter() - t0)

    def can_run(self, ctx: ForwardContext) -> bool:
        """Pure decode (one token per sequence, every one sampling), within the buckets."""
        bs = ctx.num_seqs
        return (ctx.is_decode and bs <= self.max_bs and ctx.logits_indices.shape[0] == bs
                and ctx.page_table.shape[1] <= self.max_pages)

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Copy the step in, pad the bucket, replay; logits [bs, V] (a view of the graph's)."""
        bs = ctx.num_seqs
        size = next(s for s in self.sizes if s >= bs)
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(ctx.positions)
        self.slot_mapping[:bs].copy_(ctx.slot_mapping)
        self.seq_lens[:bs].copy_(ctx.seq_lens)
        self.page_table[:bs, :ctx.page_table.shape[1]].copy_(ctx.page_table)
        if ctx.state_slots is not None:
            self.state_slots[:bs].copy_(ctx.state_slots)
        if size > bs:  # rows a larger step left behind: back to harmless padding
            self.slot_mapping[bs:size].fill_(-1)
            self.seq_lens[bs:size].fill_(1)
            self.positions[bs:size].zero_()
            self.page_table[bs:size].zero_()
            self.state_slots[bs:size].fill_(self.runner.scratch_slot)
        self.graphs[size].replay()
        return self.logits[size][:bs]
