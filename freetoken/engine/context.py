"""The forward context: what one model forward needs to know about the batch and the KV cache.

The runner builds one per step and passes it down; attention layers read the paged KV cache
through it. Tokens of all sequences are flattened into one dimension T (prefill chunks and
decode tokens mixed). Shapes:

- `positions` int64 [T]: absolute position of each token in its sequence.
- `cu_seqlens_q` int32 [B+1]: token offsets of each sequence's new tokens within T.
- `seq_lens` int32 [B]: each sequence's KV length after this step (cached + new).
- `page_table` int32 [B, max_pages]: page ids of each sequence, in order (padded with 0).
- `slot_mapping` int64 [T]: flat KV slot (page * page_size + offset) each new token writes.
- `logits_indices` int64 [S]: rows of the final hidden state whose logits are wanted (the last
  token of each sequence that samples this step), in sampling order.
- `kv_caches`: one tensor per attention layer, [2, num_pages, page_size, n_kv_heads, head_dim].
- `state_slots` int64 [B] or None: per-request slot of recurrent state (linear-attention layers).
- `recurrent_states`: one tuple of state pools per linear-attention layer, each `[slots, ...]`
  (layers/gdn.py: conv state and recurrent state), indexed by `state_slots`.

Host copies (`cu_seqlens_q_list`, `seq_lens_list`, `state_slots_list`, `max_seqlen_q`) let the
torch reference kernels and the prefill launchers loop or size grids without reading device
tensors back. A pure-decode step (`is_decode`: T == B, one new token per sequence) is known
from the tensors' shapes alone, so a captured CUDA graph needs none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardContext:
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    page_size: int
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    state_slots: torch.Tensor | None = None
    recurrent_states: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    # Host copies for Python-side loops in the torch reference kernels (avoid device syncs).
    cu_seqlens_q_list: list[int] = field(default_factory=list)
    seq_lens_list: list[int] = field(default_factory=list)
    state_slots_list: list[int] = field(default_factory=list)
    max_seqlen_q: int = 0  # longest new-token run of one sequence; 0 = unknown (use T)
    # Values every layer of one step would compute alike (the CPU decode attention's masks),
    # made by the first layer that needs them.
    memo: dict = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token (decided by shapes, no device read)."""
        return int(self.positions.shape[0]) == int(self.seq_lens.shape[0])

    def host_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(cu_seqlens_q, seq_lens, state_slots) on the host. The runner fills them; a context
        built without them (tests) reads the tensors back once and keeps the copies."""
        if not self.cu_seqlens_q_list:
            self.cu_seqlens_q_list = self.cu_seqlens_q.tolist()
        if not self.seq_lens_list:
            self.seq_lens_list = self.seq_lens.tolist()
        if not self.state_slots_list and self.state_slots is not None:
            self.state_slots_list = self.state_slots.tolist()
        return self.cu_seqlens_q_list, self.seq_lens_list, self.state_slots_list

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
