"""Gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one linear at load time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.cpu_kernels import cpu_glu
from freetoken.layers.linear import Linear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
# HF config `hidden_act` / `hidden_activation` spellings.
HF_ACT = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
          "gelu_tanh": "gelu_tanh"}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = Linear(intermediate, hidden)
        self.act, self.act_name = ACTIVATIONS[act], act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)  # [T, 2I]
        a = cpu_glu(gu, self.intermediate, self.act_name)  # fp32 on the CPU: the executor's
        if a is None and gu.is_cuda and gu.stride(-1) == 1:
            from freetoken.kernels.triton.glu import glu_triton  # lazy: needs triton

            a = glu_triton(gu, self.intermediate, self.act_name)  # one launch
        if a is None:
            g, u = gu.split(self.intermediate, dim=-1)
            a = self.act(g) * u
        return self.down_proj(a)
