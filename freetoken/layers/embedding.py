"""Token embedding over a QuantWeight (quantized tables gather rows, then dequantize them)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight
from freetoken.layers.linear import _to


class Embedding(nn.Module):
    """ids [T] -> [T, hidden] * scale (gemma multiplies by sqrt(hidden); others by 1)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float = 1.0):
        super().__init__()
        self.vocab_size, self.hidden_size, self.scale = vocab_size, hidden_size, scale
        self.weight: QuantWeight | None = None
        self.dtype = torch.float32

    def load(self, qw: QuantWeight) -> None:
        want = (self.vocab_size, self.hidden_size)
        if tuple(qw.shape) != want:
            raise FormatError(f"shape {list(qw.shape)}, expected {list(want)}", tensor=qw.source)
        self.weight = qw

    def finalize(self, dtype: torch.dtype, device) -> None:
        self.weight = _to(self.weight, dtype, device)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = kernels.embedding(ids, self.weight, self.dtype)
        if self.scale != 1.0:
            # HF gemma: the scale is a tensor in the weights' dtype, multiplied in that dtype.
            x = x * torch.tensor(self.scale, dtype=self.dtype)
        return x
