"""Thin kernel entry points. Torch references on the CPU; GPU kernels slot in behind them.

Model and layer code calls these functions only; it never imports Triton or the C++ extension.
"""

from freetoken.kernels import xq
from freetoken.kernels.attention import paged_attention, qk_rope_attention, sigmoid_gate
from freetoken.kernels.l2 import l2_ahead, l2_join
from freetoken.kernels.linear import embedding, linear
from freetoken.kernels.norm import add_rms_norm, rms_norm
from freetoken.kernels.rotary import qk_rope, qk_rope_store
from freetoken.kernels.route import route_topk

__all__ = ["add_rms_norm", "embedding", "l2_ahead", "l2_join", "linear", "paged_attention",
           "qk_rope", "qk_rope_attention", "qk_rope_store", "rms_norm", "route_topk",
           "sigmoid_gate", "xq"]
