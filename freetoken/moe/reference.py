"""The torch reference of the CPU MoE executor's contract (float64 math on dequantized banks).

`y[t] = sum_j r[t,j] * (glu(x Wg[e]^T * s[e,0], x Wu[e]^T * s[e,1]) @ Wd[e]^T * s[e,2])`,
e = expert_ids[t, j]. Weights go through `freetoken.formats.dequant.dequantize` (bit-exact
codecs); activations stay unquantized, so this is the "dequantize, then float matmul" truth
that the int8 kernels approximate.
"""

from __future__ import annotations

import torch

from freetoken.formats.dequant import dequantize
from freetoken.formats.qweight import QuantWeight


def glu(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return torch.nn.functional.silu(g) * u
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(g, approximate="tanh") * u
    raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")


def moe_reference(x: torch.Tensor, expert_ids: torch.Tensor, route_weights: torch.Tensor,
                  w13: QuantWeight, w2: QuantWeight, scales: torch.Tensor,
                  activation: str = "silu") -> torch.Tensor:
    """x [T, H]; expert_ids [T, k]; route_weights [T, k]; scales [E, 4]. Returns fp32 [T, H]."""
    W13 = dequantize(w13).to(torch.float64)  # [E, 2I, H]
    W2 = dequantize(w2).to(torch.float64)  # [E, H, I]
    inter = W13.shape[1] // 2
    xd = x.to(torch.float64)
    s = scales.to(torch.float64)
    out = torch.zeros(x.shape[0], W2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            h = W13[e] @ xd[t]  # [2I]
            a = glu(h[:inter] * s[e, 0], h[inter:] * s[e, 1], activation)  # [I]
            out[t] += float(route_weights[t, j]) * ((W2[e] @ a) * s[e, 2])
    return out.to(torch.float32)
