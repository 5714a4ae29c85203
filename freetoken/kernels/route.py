"""MoE routing entry point: router logits -> (expert ids, routing weights).

The torch reference (CPU, and the oracle of the kernel tests) and, on CUDA, one Triton launch
(`freetoken.kernels.triton.route`); `gate_topk` starts from the hidden states and, at decode
sizes on CUDA, computes the router's logits in the same launch. Scoring as
`freetoken.layers.moe` documents it:
- "softmax": p = softmax(logits), top-k of p, optionally renormalised to sum 1;
- "sigmoid": p = sigmoid(logits), experts chosen by top-k of p + bias, weights p of the chosen,
  optionally renormalised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from freetoken import env
from freetoken.formats.qweight import QuantWeight
from freetoken.kernels import xq

SCORINGS = ("softmax", "sigmoid")


def route_reference(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    if scoring == "softmax":
        probs = torch.softmax(logits, dim=-1)
        w, ids = torch.topk(probs, top_k, dim=-1)
    else:
        probs = torch.sigmoid(logits)
        choice = probs if bias is None else probs + bias.float()
        ids = torch.topk(choice, top_k, dim=-1).indices
        w = probs.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def _check(logits: torch.Tensor, top_k: int, scoring: str, bias: torch.Tensor | None) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"unknown router scoring {scoring!r} (expected one of {SCORINGS})")
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"route: logits must be [T, E] with 0 < top_k <= E, got "
                         f"{list(logits.shape)} and top_k={top_k}")
    if bias is not None and bias.shape != (logits.shape[1],):
        raise ValueError(f"route: bias must be [{logits.shape[1]}], got {list(bias.shape)}")


def _on_gpu(logits: torch.Tensor, bias: torch.Tensor | None) -> bool:
    # Up to 1024 experts in one program's registers (today's models: 8 to 512).
    return (logits.is_cuda and logits.shape[1] <= 1024 and logits.stride(-1) == 1
            and (bias is None or (bias.is_cuda and bias.dtype == torch.float32
                                  and bias.is_contiguous())))


def route_topk(logits: torch.Tensor, top_k: int, scoring: str = "softmax",
               renormalize: bool = True, bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (expert ids int64 [T, k], routing weights fp32 [T, k]), largest
    first. `bias` fp32 [E] (sigmoid scoring only) shifts the choice, not the weights."""
    _check(logits, top_k, scoring, bias)
    if scoring == "softmax":
        bias = None
    if _on_gpu(logits, bias):
        from freetoken.kernels.triton.route import route_triton  # lazy: needs triton

        return route_triton(logits, top_k, scoring == "sigmoid", renormalize, bias)
    return route_reference(logits, top_k, scoring, renormalize, bias)


def _gate_on_gpu(x: torch.Tensor, gate: QuantWeight, bias: torch.Tensor | None) -> bool:
    from freetoken.kernels.triton.route import GATE_TOKENS  # lazy: needs triton

    g = gate.data
    return (x.dim() == 2 and x.shape[0] <= GATE_TOKENS and x.stride(-1) == 1
            and gate.is_float and gate.scale2 is None and g.is_cuda and g.dtype == x.dtype
            and g.stride(-1) == 1 and _on_gpu(x.new_empty(0, g.shape[0]), bias))


def gate_topk(x: torch.Tensor, gate: QuantWeight, top_k: int, scoring: str = "softmax",
              renormalize: bool = True, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router from hidden states: x [T, H] -> route_topk of the logits x @ gate^T,
    computed in x's dtype as `linear` (and HF) computes them. On CUDA at decode sizes (a float
    router weight, up to GATE_TOKENS tokens) one launch computes the logits and routes; the
    unfused path runs three (GEMM, cast, route)."""
    if x.shape[-1] != gate.in_features:
        raise ValueError(f"gate_topk: x [..., {x.shape[-1]}] does not fit router weight "
                         f"{list(gate.shape)}")
    if x.is_cuda and _gate_on_gpu(x, gate, None if scoring == "softmax" else bias):
        from freetoken.kernels.triton.route import gate_route_triton

        _check(x.new_empty(0, gate.out_features), top_k, scoring, bias)
        return gate_route_triton(x, gate.data, top_k, scoring == "sigmoid", renormalize,
                                 None if scoring == "softmax" else bias)
    from freetoken.kernels.linear import linear

    return route_topk(linear(x, gate).float(), top_k, scoring, renormalize, bias)


class Router(NamedTuple):
    """An MoE layer's router, as `gate_topk` takes it (`SparseMoE.router`)."""

    gate: QuantWeight
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    bias: torch.Tensor | None = None


_ROUTES = "_freetoken_routes"


def routes_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (ids, weights) `add_rms_norm_route` computed with this very tensor, else None."""
    return xq.tagged(x, _ROUTES)


def add_rms_norm_route(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quantize: bool, router: Router
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.add_rms_norm`, and where the GPU can, the router's routes of its output in
    the same launch, carried by it (`routes_of`): the MoE that takes y skips its own router
    launch. On CUDA at decode sizes (what `gate_topk` fuses, H <= NORM_ROUTE_MAX_H, a 16-bit
    activation) unless FREETOKEN_GPU_NORM_ROUTE=0; elsewhere the plain residual step."""
    from freetoken.kernels.norm import _check as norm_check
    from freetoken.kernels.norm import _on_gpu as norm_on_gpu
    from freetoken.kernels.norm import add_rms_norm

    bias = None if router.scoring == "softmax" else router.bias
    # _gate_on_gpu (needs triton: CUDA tensors only): [T, H] rows of unit stride, few tokens,
    # a float router weight on the device
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and env.gpu_norm_route()
            and _gate_on_gpu(x, router.gate, bias) and norm_on_gpu(x, weight)
            and residual.stride(-1) == 1 and x.shape[-1] == router.gate.in_features):
        return add_rms_norm(x, residual, weight, eps, quantize)
    from freetoken.kernels.triton.route import NORM_ROUTE_MAX_H, norm_gate_route_triton

    if x.shape[-1] > NORM_ROUTE_MAX_H:
        return add_rms_norm(x, residual, weight, eps, quantize)
    norm_check(x, weight, residual)
    _check(x.new_empty(0, router.gate.out_features), router.top_k, router.scoring, bias)
    y, s, q, ids, w = norm_gate_route_triton(
        x, residual, weight, eps, quantize and xq.wanted(x), router.gate.data, router.top_k,
        router.scoring == "sigmoid", router.renormalize, bias)
    return xq.tag(xq.attach(y, q), _ROUTES, (ids, w)), s
