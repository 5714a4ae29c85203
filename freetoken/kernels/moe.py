"""The fused MoE entry point: every expert resident on the compute device (torch reference).

For each token t and each of its k (expert e, routing weight r):
`y[t] += r * ((glu(x Wg[e]^T * s[e,0], x Wu[e]^T * s[e,1])) @ Wd[e]^T * s[e,2])`, the contract
of `freetoken.moe.reference.moe_reference` (DESIGN.md, seed 000). Tokens are grouped by
expert, each expert's rows are dequantized once per call, products accumulate in fp32 and the
second-level scales multiply results before the GLU (gate, up) and before the routing weight
(down).

Slot indirection: with `expert_map` (int32 `[E]`) the bank is a pool of slots (`w13`
`[S, 2I, H]`, `w2` `[S, H, I]`, `scales` `[S, 4]`) and expert e lives in slot `expert_map[e]`;
a route whose expert maps to -1 contributes nothing (another path, the CPU, computes it).
CUDA tensors go to the Triton kernels (`freetoken.kernels.triton.moe`), which check the same
shapes but never read device values back to the host (the step may be a CUDA graph); a bank
format without a kernel takes this torch path on the GPU too (with its host syncs). On the CPU,
a bank in the executor's layout (no `expert_map`: slot pools interleave their parts) goes to
the C++ executor's int8 dots (`freetoken.kernels.cpu_kernels.cpu_fused_moe`), as dense layers
do; slot pools and FREETOKEN_CPU_FLOAT=1 take this path in float math, each expert's rows
decoded by the executor (bit for bit the codecs) for torch's GEMM; formats it has no kernel
for, by the torch codecs.
"""

from __future__ import annotations

import torch

from freetoken.kernels import cpu_kernels
from freetoken.kernels.linear import linear, linear_float
from freetoken.moe.banks import ExpertBank, expert_weight
from freetoken.moe.reference import glu


def _check_shapes(x: torch.Tensor, bank: ExpertBank, ids: torch.Tensor, w: torch.Tensor,
                  expert_map: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] != bank.hidden:
        raise ValueError(f"fused_moe: x must be [T, {bank.hidden}], got {list(x.shape)}")
    if ids.shape != w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: expert ids {list(ids.shape)} and routing weights "
                         f"{list(w.shape)} must both be [T={x.shape[0]}, k]")
    if bank.scales.shape != (bank.num_experts, 4) or bank.scales.dtype != torch.float32:
        raise ValueError(f"fused_moe: scales must be fp32 [{bank.num_experts}, 4], got "
                         f"{bank.scales.dtype} {list(bank.scales.shape)}")
    if expert_map is None:
        return
    if expert_map.dim() != 1 or expert_map.dtype != torch.int32:
        raise ValueError(f"fused_moe: expert_map must be int32 [E], got {expert_map.dtype} "
                         f"{list(expert_map.shape)}")
    if expert_map.device != x.device:
        raise ValueError(f"fused_moe: expert_map is on {expert_map.device}, x on {x.device}")


def _check_values(bank: ExpertBank, ids: torch.Tensor, expert_map: torch.Tensor | None) -> None:
    """Range checks that read device values: CPU path only (a host sync on CUDA)."""
    experts = bank.num_experts if expert_map is None else expert_map.numel()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= experts):
        raise ValueError(f"fused_moe: expert id out of range [0, {experts})")
    if expert_map is not None and expert_map.numel() and (
            int(expert_map.min()) < -1 or int(expert_map.max()) >= bank.num_experts):
        raise ValueError(f"fused_moe: expert_map holds a slot outside [-1, {bank.num_experts})")


def _check(x: torch.Tensor, bank: ExpertBank, ids: torch.Tensor, w: torch.Tensor,
           expert_map: torch.Tensor | None = None) -> None:
    _check_shapes(x, bank, ids, w, expert_map)
    if not x.is_cuda:
        _check_values(bank, ids, expert_map)


def fused_moe(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, activation: str = "silu",
              expert_map: torch.Tensor | None = None, norm_fold=None) -> torch.Tensor:
    """x [T, H], topk_ids int [T, k], topk_weights [T, k] -> y [T, H] in x's dtype.

    `expert_map` int32 [E] (on x's device): expert -> slot of the bank, -1 = not here.
    `norm_fold` (`kernels/norm.py` NormFold): the residual step that takes y next, which the
    GPU kernels may compute too (y then carries it); ignored elsewhere.
    """
    _check(x, bank, topk_ids, topk_weights, expert_map)
    if x.is_cuda and bank.w13.data.is_cuda:
        from freetoken.kernels.triton.moe import fused_moe_triton, supported  # lazy: triton

        if supported(bank):
            return fused_moe_triton(x, bank, topk_ids, topk_weights, activation, expert_map,
                                    norm_fold=norm_fold)
    if not x.is_cuda and expert_map is None and cpu_kernels.int8_dots():
        y = cpu_kernels.cpu_fused_moe(x, bank, topk_ids, topk_weights, activation)
        if y is not None:
            return y
    return fused_moe_reference(x, bank, topk_ids, topk_weights, activation, expert_map)


def fused_moe_reference(x: torch.Tensor, bank: ExpertBank, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, activation: str = "silu",
                        expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of `fused_moe` (float math; the oracle of the kernels' tests)."""
    xf = x.float()
    out = torch.zeros(x.shape[0], bank.hidden, dtype=torch.float32, device=x.device)
    inter = bank.intermediate
    k = topk_ids.shape[1]
    slots = topk_ids.reshape(-1).long()
    if expert_map is not None:
        slots = expert_map.long()[slots]  # [T*k] slot of each route, -1 = computed elsewhere
    keep = torch.nonzero(slots >= 0).reshape(-1)  # route indices (t * k + j) handled here
    slots = slots[keep]
    order = torch.argsort(slots, stable=True)  # routes grouped by slot
    counts = torch.bincount(slots, minlength=bank.num_experts).tolist()
    routes = keep[order]
    tokens = routes // k  # [n] token of each sorted route
    route = topk_weights.reshape(-1)[routes].float()
    s = bank.scales
    lin = linear if x.is_cuda else linear_float  # float math (the CPU's linear: int8 dots)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok, r = tokens[start:start + n], route[start:start + n]
        start += n
        h = lin(xf[tok], expert_weight(bank.w13, e)).float()  # [n, 2I]
        a = glu(h[:, :inter] * s[e, 0], h[:, inter:] * s[e, 1], activation)  # [n, I]
        y = lin(a, expert_weight(bank.w2, e)).float() * s[e, 2]  # [n, H]
        out.index_add_(0, tok, y * r[:, None])
    return out.to(x.dtype)
