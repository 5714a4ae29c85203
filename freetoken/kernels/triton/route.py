"""MoE router on the GPU: scores, top-k and renormalisation of one token in one program.

softmax scoring: p = softmax(logits), the k largest p (largest first), optionally divided by
their sum. sigmoid scoring: p = sigmoid(logits), experts chosen by the k largest p + bias,
weights p of the chosen (without the bias), optionally renormalised. Ties go to the lower
expert id. One launch per layer where torch runs five to seven (cast, softmax, top-k's sort
and gather, sum, divide).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(logits_ptr + t * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        p = tl.sigmoid(x)
        choice = p
        if HAS_BIAS:
            choice = p + tl.load(bias_ptr + e, mask=ok, other=0.0)
    else:
        z = tl.exp(x - tl.max(x, axis=0))
        p = z / tl.sum(z, axis=0)
        choice = p
    choice = tl.where(ok, choice, float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    ws = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(choice, axis=0)
        idx = tl.min(tl.where(choice == best, e, BLOCK_E), axis=0)  # lowest id on ties
        wj = tl.sum(tl.where(e == idx, p, 0.0), axis=0)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        ws = tl.where(kk == j, wj, ws)
        choice = tl.where(e == idx, float("-inf"), choice)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    kmask = kk < TOPK
    tl.store(ids_ptr + t * TOPK + kk, ids, mask=kmask)
    tl.store(w_ptr + t * TOPK + kk, ws, mask=kmask)


def route_triton(logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride in E), bias fp32 [E] or None -> (ids int64 [T, k],
    weights fp32 [T, k]). Checked by `freetoken.kernels.route`."""
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, w
    block_e = triton.next_power_of_2(e)
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, ids, w, e, logits.stride(0),
        SIGMOID=sigmoid, HAS_BIAS=bias is not None, RENORM=renormalize, TOPK=top_k,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 256 else 4)
    return ids, w
