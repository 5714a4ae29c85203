"""Rotary position embedding (NeoX / HF "rotate_half" layout), with rope scaling from config.

Supported `scaling` (HF `rope_parameters` / `rope_scaling` dicts): none/"default", "linear"
(positions divided by `factor`) and "llama3" (frequency bands). llama.cpp's GGUFs carry llama3
scaling as per-frequency divisors (`rope_freqs.weight`): pass those as `freq_factors` instead.
The llama-family GGUFs store q/k rows permuted for an interleaved rotary; the loader undoes
that permutation, so one layout serves both sources.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from freetoken import kernels
from freetoken.formats.errors import FormatError

SCALING_TYPES = ("default", "linear", "llama3")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """HF's llama3 band scaling: long wavelengths / factor, short kept, smooth in between."""
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """inv_freq [head_dim/2] in fp32, as HF computes it."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise FormatError(f"rope scaling {kind!r} is not supported (supported: {SCALING_TYPES})",
                      key="rope_scaling")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions; `apply` rotates q or k [T, H, head_dim]."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling),
                             persistent=False)

    def load_freq_factors(self, factors: torch.Tensor, name: str = "rope_freqs") -> None:
        """llama.cpp's per-frequency divisors (llama3 scaling in a GGUF)."""
        if tuple(factors.shape) != tuple(self.inv_freq.shape):
            raise FormatError(f"shape {list(factors.shape)}, expected {list(self.inv_freq.shape)}",
                              tensor=name)
        self.inv_freq = self.inv_freq / factors.float().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) each [T, head_dim] in fp32."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] rotated in fp32 (rotate_half convention), returned in x's dtype (one Triton
    launch on CUDA: `kernels.qk_rope` with no key heads)."""
    return kernels.qk_rope(x, x[:, :0], cos, sin)[0]
