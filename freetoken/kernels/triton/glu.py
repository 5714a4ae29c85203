"""Small fusions of a decoder layer's tails, one launch each where torch runs several:

- `glu_triton(gu, I, act)`: a = act(g) * u from the fused gate/up output [T, 2I] (torch: the
  activation, then the product, two launches and an intermediate);
- `gated_add_triton(y, sh, x, w)`: y + sigmoid(x . w) * sh, the shared expert's scalar gate
  per token and the sum with the routed experts (torch: a GEMV with N = 1, dtype casts, the
  sigmoid, the product and the sum, seven launches);
- `sigmoid_gate_triton(o, gate)`: o * sigmoid(gate), qwen3.5's gated attention output, with
  its int8 codes for the output projection's GEMV (torch: a cast, the sigmoid, a cast and the
  product, four launches, and every GEMV program quantizing again).
They compute in fp32 and round once to the output dtype (torch rounds after each op in bf16),
except the gate, rounded to the dtype before the product, as the model computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels.triton.gemv_i8 import quant_store, xq_len
from freetoken.kernels.triton.moe_grouped import glu
from freetoken.kernels.triton.norm import norm_row, norm_warps

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


def gate_block(hidden: int) -> int:
    """`sigmoid_dot`'s chunk for a row of `hidden` values (callers that must agree bit for bit
    take this one, with num_warps=GATE_WARPS: the reduction's order follows both)."""
    return min(1024, triton.next_power_of_2(hidden))


GATE_WARPS = 4


def gate_folds(hidden: int) -> bool:
    """Whether a kernel that adds the gated shared expert can also compute the next residual
    step (`kernels/norm.py`: folding) of rows of `hidden` values: a program a token holding
    its row runs the gate's reduction (`sigmoid_dot`, GATE_WARPS warps) and the RMSNorm
    kernel's, so it must run with the warps the RMSNorm kernel takes for that row (the
    reductions' order follows the warps): rows of 257 to 2048 values."""
    return norm_warps(triton.next_power_of_2(hidden)) == GATE_WARPS


@triton.jit
def sigmoid_dot(x_row, w_ptr, H: tl.constexpr, BLOCK: tl.constexpr):
    """sigmoid(x . w) in fp32 over the H values (unit stride) at x_row and w_ptr, BLOCK at a
    time: the shared expert's gate of one token, in `_gated_add_kernel` and in the hand-off's
    receive (kernels/triton/handoff.py), which compute the same bits with it. The products are
    added by explicit FMAs (what a kernel compiled with FP fusion makes of `acc += x * w`), so
    that a kernel compiled without it (one that also quantizes as the RMSNorm kernel does)
    gets the same gate."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        ok = h < H
        acc = tl.fma(tl.load(x_row + h, mask=ok, other=0.0).to(tl.float32),
                     tl.load(w_ptr + h, mask=ok, other=0.0).to(tl.float32), acc)
    return tl.sigmoid(tl.sum(acc, axis=0))


@triton.jit
def gated_sum(y, gate, s):
    """y + gate * s in fp32 by one FMA (`sigmoid_dot`'s reason): the shared expert's gated
    term added to the routed experts' sum, by every kernel that adds it."""
    return tl.fma(gate, s, y)


@triton.jit
def _gated_add_kernel(y_ptr, sh_ptr, x_ptr, w_ptr, out_ptr, stride_y, stride_sh, stride_x,
                      stride_o, H: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    gate = sigmoid_dot(x_ptr + t * stride_x, w_ptr, H, BLOCK)
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        ok = h < H
        y = tl.load(y_ptr + t * stride_y + h, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sh_ptr + t * stride_sh + h, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + h, gated_sum(y, gate, s).to(out_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit
def _gated_add_norm_kernel(y_ptr, sh_ptr, x_ptr, w_ptr, out_ptr, res_ptr, nw_ptr, ny_ptr,
                           ns_ptr, nq_ptr, stride_y, stride_sh, stride_x, stride_o, stride_r,
                           stride_ny, stride_ns, stride_nq, eps, H: tl.constexpr,
                           GBLOCK: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr):
    """Program t: token t's row of `_gated_add_kernel` (its gate in chunks of GBLOCK), then the
    residual step that takes it next with the RMSNorm kernel's arithmetic (`norm.norm_row`).
    Launched with GATE_WARPS warps (`gate_folds`) and without FP fusion (the codes')."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    gate = sigmoid_dot(x_ptr + t * stride_x, w_ptr, H, GBLOCK)
    y = tl.load(y_ptr + t * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sh_ptr + t * stride_sh + cols, mask=ok, other=0.0).to(tl.float32)
    o = gated_sum(y, gate, s).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + cols, o, mask=ok)
    norm_row(o, res_ptr + t * stride_r, nw_ptr, ny_ptr + t * stride_ny, ns_ptr + t * stride_ns,
             nq_ptr + t * stride_nq, cols, ok, H, eps, True, QUANT, BLOCK)


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
                     w: torch.Tensor, fold=None) -> torch.Tensor:
    """y, sh, x [T, H] (unit stride in H), w [H] -> y + sigmoid(x . w) * sh in y's dtype.
    fold (`kernels/norm.py` NormFold, for rows `gate_folds` takes, else ignored): the
    residual step that takes the sum next, computed in the same launch (the output carries
    it: `norm.fold_done`)."""
    T, H = y.shape
    out = torch.empty_like(y)
    if T and fold is not None and gate_folds(H):
        from freetoken.kernels.norm import fold_buffers, fold_done

        ny, ns, nq = fold_buffers(fold)
        r = fold.residual
        nq_ = nq if nq is not None else ny
        _gated_add_norm_kernel[(T,)](
            y, sh, x, w, out, r, fold.weight, ny, ns, nq_, y.stride(0), sh.stride(0),
            x.stride(0), out.stride(0), r.stride(0), ny.stride(0), ns.stride(0), nq_.stride(0),
            fold.eps, H=H, GBLOCK=gate_block(H), QUANT=nq is not None,
            BLOCK=triton.next_power_of_2(H), num_warps=GATE_WARPS,
            enable_fp_fusion=False)  # the codes as the RMSNorm kernel's
        return fold_done(out, fold, ny, ns, nq)
    if T:
        _gated_add_kernel[(T,)](y, sh, x, w, out, y.stride(0), sh.stride(0), x.stride(0),
                                out.stride(0), H=H, BLOCK=gate_block(H), num_warps=GATE_WARPS)
    return out


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, y_ptr, q_ptr, stride_ot, stride_oh, stride_gt,
                         stride_gh, stride_q, H: tl.constexpr, D: tl.constexpr,
                         QUANT: tl.constexpr):
    """Program (t, h): head h of token t, y = o * bf16(sigmoid(g)) into y [T, H D], and with
    QUANT its D / 32 blocks of the row's int8 codes."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + d).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + d).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    y = (o * tl.sigmoid(g).to(dt).to(tl.float32)).to(dt)
    tl.store(y_ptr + t * (H * D) + h * D + d, y)
    if QUANT:
        quant_store(tl.reshape(y.to(tl.float32), (1, D)), q_ptr + t * stride_q, h * D,
                    tl.arange(0, 1) < 1, H * D)


def sigmoid_gate_triton(o: torch.Tensor, gate: torch.Tensor, quantize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o, gate [T, H, D] (unit stride in D, D a power of two) -> (o * sigmoid(gate) as
    [T, H D] in o's dtype, its int8 codes [T, xq_len(H D)] with `quantize` (D a multiple of
    32), else None). Checked by `freetoken.kernels.attention.sigmoid_gate`."""
    t, h, d = o.shape
    y = torch.empty(t, h * d, dtype=o.dtype, device=o.device)
    q = torch.empty(t, xq_len(h * d), dtype=torch.int32, device=o.device) if quantize else None
    if t:
        q_ = q if q is not None else y
        _sigmoid_gate_kernel[(t, h)](o, gate, y, q_, o.stride(0), o.stride(1), gate.stride(0),
                                     gate.stride(1), q_.stride(0), H=h, D=d, QUANT=quantize,
                                     num_warps=1 if d <= 256 else 4,
                                     enable_fp_fusion=False)  # the quantizer's arithmetic
    return y, q
