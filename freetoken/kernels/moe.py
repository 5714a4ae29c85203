"""The fused MoE entry point: every expert resident on the compute device (torch reference).

For each token t and each of its k (expert e, routing weight r):
`y[t] += r * ((glu(x Wg[e]^T * s[e,0], x Wu[e]^T * s[e,1])) @ Wd[e]^T * s[e,2])`, the contract
of `freetoken.moe.reference.moe_reference` (DESIGN.md, seed 000). Tokens are grouped by
expert, each expert's rows are dequantized once per call, products accumulate in fp32 and the
second-level scales multiply results before the GLU (gate, up) and before the routing weight
(down). A GPU kernel will slot in behind this function with the same checks.
"""

from __future__ import annotations

import torch

from freetoken.kernels.linear import linear
from freetoken.moe.banks import ExpertBank, expert_weight
from freetoken.moe.reference import glu


def _check(x: torch.Tensor, bank: ExpertBank, ids: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != bank.hidden:
        raise ValueError(f"fused_moe: x must be [T, {bank.hidden}], got {list(x.shape)}")
    if ids.shape != w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: expert ids {list(ids.shape)} and routing weights "
                         f"{list(w.shape)} must both be [T={x.shape[0]}, k]")
    if bank.scales.shape != (bank.num_experts, 4) or bank.scales.dtype != torch.float32:
        raise ValueError(f"fused_moe: scales must be fp32 [{bank.num_experts}, 4], got "
                         f"{bank.scales.dtype} {list(bank.scales.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bank.num_experts):
        raise ValueError(f"fused_moe: expert id out of range [0, {bank.num_experts})")


def fused_moe(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [T, H], topk_ids int [T, k], topk_weights [T, k] -> y [T, H] in x's dtype."""
    _check(x, bank, topk_ids, topk_weights)
    xf = x.float()
    out = torch.zeros(x.shape[0], bank.hidden, dtype=torch.float32, device=x.device)
    inter = bank.intermediate
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routes grouped by expert
    counts = torch.bincount(flat, minlength=bank.num_experts).tolist()
    tokens = order // topk_ids.shape[1]  # [T*k] token of each sorted route
    route = topk_weights.reshape(-1)[order].float()
    s = bank.scales
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok, r = tokens[start:start + n], route[start:start + n]
        start += n
        h = linear(xf[tok], expert_weight(bank.w13, e)).float()  # [n, 2I]
        a = glu(h[:, :inter] * s[e, 0], h[:, inter:] * s[e, 1], activation)  # [n, I]
        y = linear(a, expert_weight(bank.w2, e)).float() * s[e, 2]  # [n, H]
        out.index_add_(0, tok, y * r[:, None])
    return out.to(x.dtype)
