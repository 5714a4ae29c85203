"""Thin kernel entry points. Torch references on the CPU; GPU kernels slot in behind them.

Model and layer code calls these functions only; it never imports Triton or the C++ extension.
"""

from freetoken.kernels.attention import paged_attention
from freetoken.kernels.linear import embedding, linear

__all__ = ["embedding", "linear", "paged_attention"]
