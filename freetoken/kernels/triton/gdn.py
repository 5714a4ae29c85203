"""A gated delta-net decode step (layers/gdn.py) on the GPU in three kernels.

Torch runs a GDN layer's decode step as some sixty small kernels (state gathers and
scatters, the conv window, the L2 norms, the gates, the delta rule, the gated norm); on a
Qwen3.6-35B-A3B shape those were most of a batch-1 step's launches (30 of its 40 layers are
GDN). Here, one token for each of B sequences, in place on the layer's state pools:
1. `_conv_kernel` (B x channel blocks): the depthwise causal conv over the slot's last K-1
   inputs and the new one, SiLU; the slot's conv state shifts by one;
2. `_step_kernel` (B x value heads x value blocks of BV): q and k L2-normalised (q scaled by
   dk^-0.5), g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) from the projection,
   then on the slot's state tile S [dk, BV] (fp32, read and written once):
   S = exp(g) S;  S += k ((v - S^T k) beta)^T;  o = S^T q;
3. `_gated_norm_kernel` (B x value heads): RMSNorm(o) w * silu(z), in the layer's dtype, and
   (decode sizes on a GPU) its int8 codes for out_proj's GEMV (`kernels.xq`).
A sequence at position 0 starts from zero states (`positions`), decided on the device, so the
step has no host sync and sits in a CUDA graph. Rounding follows the torch path (fp32 states;
o rounded to the layer's dtype before the norm, the norm's output rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken.kernels import xq
from freetoken.kernels.triton.gemv_i8 import quant_store, xq_len


@triton.jit
def _conv_kernel(x_ptr, w_ptr, conv_ptr, slots_ptr, pos_ptr, c_ptr, C, stride_x, stride_cs,
                 HAS_POS: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = ch < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    keep = 1.0
    if HAS_POS:
        keep = (tl.load(pos_ptr + b) > 0).to(tl.float32)
    j = tl.arange(0, KP)[None, :]
    st = conv_ptr + slot * stride_cs + ch[:, None] * (KW - 1)  # [C, KW-1] per slot
    prev = tl.load(st + j, mask=ok[:, None] & (j < KW - 1), other=0.0) * keep
    nxt = tl.load(st + j + 1, mask=ok[:, None] & (j + 1 < KW - 1), other=0.0) * keep
    x = tl.load(x_ptr + b * stride_x + ch, mask=ok, other=0.0).to(tl.float32)[:, None]
    win = tl.where(j == KW - 1, x, prev)  # [BC, KP]: the window's KW columns, oldest first
    w = tl.load(w_ptr + ch[:, None] * KW + j, mask=ok[:, None] & (j < KW), other=0.0)
    s = tl.sum(win * w, axis=1)
    tl.store(c_ptr + b * C + ch, s * tl.sigmoid(s), mask=ok)
    tl.debug_barrier()  # every thread's reads of the state before any write
    tl.store(st + j, tl.where(j == KW - 2, x, nxt), mask=ok[:, None] & (j < KW - 1))


@triton.jit
def _step_kernel(c_ptr, p_ptr, nega_ptr, dtb_ptr, ssm_ptr, slots_ptr, pos_ptr, o_ptr,
                 C, stride_p, off_b, off_a, stride_ss, KEY_DIM, NK, R, scale,
                 HAS_POS: tl.constexpr, TILED: tl.constexpr, NV: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kh = h % NK if TILED else h // R  # the value head's key head
    d = tl.arange(0, DK)
    row = c_ptr + b * C
    q = tl.load(row + kh * DK + d)
    k = tl.load(row + KEY_DIM + kh * DK + d)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(row + 2 * KEY_DIM + h * DV + vv)
    pr = p_ptr + b * stride_p
    a = tl.load(pr + off_a + h).to(tl.float32) + tl.load(dtb_ptr + h)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold
    g = tl.load(nega_ptr + h) * softplus
    beta = tl.sigmoid(tl.load(pr + off_b + h).to(tl.float32))
    decay = tl.exp(g)
    if HAS_POS:
        decay = decay * (tl.load(pos_ptr + b) > 0).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    sp = ssm_ptr + slot * stride_ss + h * (DK * DV) + d[:, None] * DV + vv[None, :]
    s = tl.load(sp) * decay  # [DK, BV]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    tl.store(sp, s)
    tl.store(o_ptr + (b * NV + h) * DV + vv, tl.sum(s * q[:, None], axis=0))


@triton.jit
def _gated_norm_kernel(o_ptr, p_ptr, w_ptr, y_ptr, q_ptr, stride_p, stride_q, off_z, eps,
                       NV: tl.constexpr, DV: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0)
    b = r // NV
    h = r % NV
    d = tl.arange(0, DV)
    o = tl.load(o_ptr + r * DV + d).to(y_ptr.dtype.element_ty).to(tl.float32)
    n = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * tl.load(w_ptr + d)
    n = n.to(y_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(p_ptr + b * stride_p + off_z + h * DV + d).to(tl.float32)
    y = (n * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * DV + d, y)
    if QUANT:  # head h's DV / 32 blocks of row b's codes (gemv_i8.quant_store)
        quant_store(tl.reshape(y.to(tl.float32), (1, DV)), q_ptr + b * stride_q, h * DV,
                    tl.arange(0, 1) < 1, NV * DV)


def supported(spec) -> bool:
    """Head sizes the kernels take (powers of two, whole value blocks)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (spec.head_k_dim, spec.head_v_dim))


def gdn_decode(proj: torch.Tensor, spec, conv_w: torch.Tensor, neg_a: torch.Tensor,
               dt_bias: torch.Tensor, norm_w: torch.Tensor, conv: torch.Tensor,
               ssm: torch.Tensor, slots: torch.Tensor,
               positions: torch.Tensor | None, quantize: bool | None = None) -> torch.Tensor:
    """One token for each of B sequences. proj [B, conv_dim + value_dim + 2 nv] (in_proj's
    output: qkv, z, b, a), conv_w fp32 [C, K], neg_a / dt_bias fp32 [nv], norm_w fp32 [dv],
    conv fp32 [slots, C, K-1] and ssm fp32 [slots, nv, dk, dv] (updated in place at `slots`
    [B]), positions [B] or None -> y [B, value_dim] in proj's dtype (out_proj's input), with
    its int8 codes attached (`kernels.xq`) where `quantize` (None: where an int8 GEMV takes
    y, `xq.wanted`; dv a multiple of 32)."""
    s = spec
    B = proj.shape[0]
    C, K, nv, dk, dv = s.conv_dim, s.conv_kernel, s.num_v_heads, s.head_k_dim, s.head_v_dim
    assert proj.stride(1) == 1 and conv.is_contiguous() and ssm.is_contiguous()
    dev = proj.device
    c = torch.empty(B, C, dtype=torch.float32, device=dev)
    o = torch.empty(B, nv, dv, dtype=torch.float32, device=dev)
    y = torch.empty(B, s.value_dim, dtype=proj.dtype, device=dev)
    if B == 0:
        return y
    pos = positions if positions is not None else slots
    bc = 256
    _conv_kernel[(B, triton.cdiv(C, bc))](
        proj, conv_w, conv, slots, pos, c, C, proj.stride(0), conv.stride(0),
        HAS_POS=positions is not None, KW=K, KP=triton.next_power_of_2(K), BC=bc, num_warps=4)
    bv = min(32, dv)
    off_b = C + s.value_dim
    _step_kernel[(B, nv, dv // bv)](
        c, proj, neg_a, dt_bias, ssm, slots, pos, o, C, proj.stride(0), off_b, off_b + nv,
        ssm.stride(0), s.key_dim, s.num_k_heads, nv // s.num_k_heads, dk ** -0.5,
        HAS_POS=positions is not None, TILED=s.v_tiled, NV=nv, DK=dk, DV=dv, BV=bv,
        num_warps=4)
    if quantize is None:
        quantize = xq.wanted(y)
    quantize = quantize and dv % 32 == 0
    q = torch.empty(B, xq_len(s.value_dim), dtype=torch.int32, device=dev) if quantize else y
    _gated_norm_kernel[(B * nv,)](o, proj, norm_w, y, q, proj.stride(0), q.stride(0), C,
                                  float(s.norm_eps), NV=nv, DV=dv, QUANT=quantize,
                                  num_warps=1 if dv <= 256 else 4,
                                  enable_fp_fusion=False)  # the quantizer's arithmetic
    return xq.attach(y, q) if quantize else y
