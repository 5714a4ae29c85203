"""Two small fusions of a decoder layer's MLP tail, one launch each where torch runs several:

- `glu_triton(gu, I, act)`: a = act(g) * u from the fused gate/up output [T, 2I] (torch: the
  activation, then the product, two launches and an intermediate);
- `gated_add_triton(y, sh, x, w)`: y + sigmoid(x . w) * sh, the shared expert's scalar gate
  per token and the sum with the routed experts (torch: a GEMV with N = 1, dtype casts, the
  sigmoid, the product and the sum, seven launches).
Both compute in fp32 and round once to the output dtype (torch rounds after each op in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.moe_grouped import glu

_ACT = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def _glu_kernel(gu_ptr, a_ptr, inter, stride_gu, stride_a, ACT: tl.constexpr,
                BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < inter
    g = tl.load(gu_ptr + t * stride_gu + n, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + inter + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(a_ptr + t * stride_a + n, glu(g, u, ACT).to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_add_kernel(y_ptr, sh_ptr, x_ptr, w_ptr, out_ptr, stride_y, stride_sh, stride_x,
                      stride_o, H: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        ok = h < H
        acc += tl.load(x_ptr + t * stride_x + h, mask=ok, other=0.0).to(tl.float32) * \
            tl.load(w_ptr + h, mask=ok, other=0.0).to(tl.float32)
    gate = tl.sigmoid(tl.sum(acc, axis=0))
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        ok = h < H
        y = tl.load(y_ptr + t * stride_y + h, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sh_ptr + t * stride_sh + h, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + h, (y + gate * s).to(out_ptr.dtype.element_ty),
                 mask=ok)


def glu_triton(gu: torch.Tensor, inter: int, act: str) -> torch.Tensor:
    """gu [T, 2 inter] (unit stride in the last dim) -> act(gu[:, :I]) * gu[:, I:] [T, I]."""
    T = gu.shape[0]
    a = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    if T:
        block = min(1024, triton.next_power_of_2(inter))
        _glu_kernel[(T, triton.cdiv(inter, block))](gu, a, inter, gu.stride(0), a.stride(0),
                                                    ACT=_ACT[act], BLOCK=block, num_warps=4)
    return a


def gated_add_triton(y: torch.Tensor, sh: torch.Tensor, x: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
    """y, sh, x [T, H] (unit stride in H), w [H] -> y + sigmoid(x . w) * sh in y's dtype."""
    T, H = y.shape
    out = torch.empty_like(y)
    if T:
        block = min(1024, triton.next_power_of_2(H))
        _gated_add_kernel[(T,)](y, sh, x, w, out, y.stride(0), sh.stride(0), x.stride(0),
                                out.stride(0), H=H, BLOCK=block, num_warps=4)
    return out
