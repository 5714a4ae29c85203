"""A gated delta-net decode step (layers/gdn.py) on the GPU in one kernel (or three).

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
`_fused_kernel` does all three in one launch on the step kernel's grid (the default; at batch 1
the three took 2.0 + 3.9 + 1.4 us and two launch gaps of about 1.5 us on the H200): each
program convolves the channels it reads itself (its key head's q and k, its own v block),
the last program of a key head to arrive shifts that head's q/k conv state, the last of a
value head's blocks its norm (`arrive.py`). The three kernels stay as the fallback (batches
beyond the arrival counters, `FREETOKEN_GPU_GDN_FUSED=0`) and the reference: both run the
same helpers in the same order, bit for bit the same under Triton's interpreter.
A sequence at position 0 starts from zero states (`positions`), decided on the device, so the
step has no host sync and sits in a CUDA graph. Rounding follows the torch path (fp32 states;
o rounded to the layer's dtype before the norm, the norm's output rounded once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken import env
from freetoken.kernels import xq
from freetoken.kernels.triton.arrive import counters, last_to_arrive
from freetoken.kernels.triton.gemv_i8 import quant_store, xq_len


@triton.jit
def _keep(pos_ptr, b, HAS_POS: tl.constexpr):
    """1.0, or 0.0 where sequence b starts at position 0 (its states read as zeros)."""
    keep = 1.0
    if HAS_POS:
        keep = (tl.load(pos_ptr + b) > 0).to(tl.float32)
    return keep


@triton.jit
def _conv(x_row, w_ptr, st, ch, ok, keep, KW: tl.constexpr, KP: tl.constexpr):
    """Channels ch [N] (where ok) of the conv over a slot's state st ([C, KW-1]) and the new
    inputs x_row [C]: (SiLU(conv) [N] fp32, the channels' next state [N, KP] for `_shift`)."""
    j = tl.arange(0, KP)[None, :]
    st = st + ch[:, None] * (KW - 1)
    prev = tl.load(st + j, mask=ok[:, None] & (j < KW - 1), other=0.0) * keep
    nxt = tl.load(st + j + 1, mask=ok[:, None] & (j + 1 < KW - 1), other=0.0) * keep
    x = tl.load(x_row + ch, mask=ok, other=0.0).to(tl.float32)[:, None]
    win = tl.where(j == KW - 1, x, prev)  # [N, KP]: the window's KW columns, oldest first
    w = tl.load(w_ptr + ch[:, None] * KW + j, mask=ok[:, None] & (j < KW), other=0.0)
    s = tl.sum(win * w, axis=1)
    return s * tl.sigmoid(s), tl.where(j == KW - 2, x, nxt)


@triton.jit
def _shift(st, ch, ok, nxt, KW: tl.constexpr, KP: tl.constexpr):
    """Store `_conv`'s next state of channels ch. NOTE: only after every read of them."""
    j = tl.arange(0, KP)[None, :]
    tl.store(st + ch[:, None] * (KW - 1) + j, nxt, mask=ok[:, None] & (j < KW - 1))


@triton.jit
def _gates(p_row, nega_ptr, dtb_ptr, h, off_b, off_a, keep):
    """Value head h's (decay exp(g), 0 where the sequence starts over; beta)."""
    a = tl.load(p_row + off_a + h).to(tl.float32) + tl.load(dtb_ptr + h)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold
    g = tl.load(nega_ptr + h) * softplus
    return tl.exp(g) * keep, tl.sigmoid(tl.load(p_row + off_b + h).to(tl.float32))


@triton.jit
def _delta_rule(q, k, v, s, decay, beta, scale):
    """The step on a state tile s [DK, BV] (q, k [DK], v [BV] out of the conv) -> (the new
    tile, o [BV])."""
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    s = s * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s += k[:, None] * delta[None, :]
    return s, tl.sum(s * q[:, None], axis=0)


@triton.jit
def _gated_norm(o, z_row, w_ptr, y_row, q_row, h, eps, NV: tl.constexpr, DV: tl.constexpr,
                QUANT: tl.constexpr):
    """Value head h's RMSNorm(o) w * silu(z) (o fp32 [DV]) into its place of the row y_row,
    with QUANT its DV / 32 blocks of the row's codes q_row (gemv_i8.quant_store)."""
    d = tl.arange(0, DV)
    o = o.to(y_row.dtype.element_ty).to(tl.float32)
    n = o / tl.sqrt(tl.sum(o * o, axis=0) / DV + eps) * tl.load(w_ptr + d)
    n = n.to(y_row.dtype.element_ty).to(tl.float32)
    z = tl.load(z_row + h * DV + d).to(tl.float32)
    y = (n * z * tl.sigmoid(z)).to(y_row.dtype.element_ty)
    tl.store(y_row + h * DV + d, y)
    if QUANT:
        quant_store(tl.reshape(y.to(tl.float32), (1, DV)), q_row, h * DV,
                    tl.arange(0, 1) < 1, NV * DV)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, conv_ptr, slots_ptr, pos_ptr, c_ptr, C, stride_x, stride_cs,
                 HAS_POS: tl.constexpr, KW: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    ok = ch < C
    st = conv_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_cs
    c, nxt = _conv(x_ptr + b * stride_x, w_ptr, st, ch, ok, _keep(pos_ptr, b, HAS_POS), KW, KP)
    tl.store(c_ptr + b * C + ch, c, mask=ok)
    tl.debug_barrier()  # every thread's reads of the state before any write
    _shift(st, ch, ok, nxt, KW, KP)


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
    slot = tl.load(slots_ptr + b).to(tl.int64)
    sp = ssm_ptr + slot * stride_ss + h * (DK * DV) + d[:, None] * DV + vv[None, :]
    decay, beta = _gates(p_ptr + b * stride_p, nega_ptr, dtb_ptr, h, off_b, off_a,
                         _keep(pos_ptr, b, HAS_POS))
    s, o = _delta_rule(tl.load(row + kh * DK + d), tl.load(row + KEY_DIM + kh * DK + d),
                       tl.load(row + 2 * KEY_DIM + h * DV + vv), tl.load(sp), decay, beta, scale)
    tl.store(sp, s)
    tl.store(o_ptr + (b * NV + h) * DV + vv, o)


@triton.jit
def _gated_norm_kernel(o_ptr, p_ptr, w_ptr, y_ptr, q_ptr, stride_p, stride_q, off_z, eps,
                       NV: tl.constexpr, DV: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0)
    b = r // NV
    _gated_norm(tl.load(o_ptr + r * DV + tl.arange(0, DV)), p_ptr + b * stride_p + off_z, w_ptr,
                y_ptr + b * (NV * DV), q_ptr + b * stride_q, r % NV, eps, NV, DV, QUANT)


@triton.jit
def _fused_kernel(p_ptr, cw_ptr, conv_ptr, nega_ptr, dtb_ptr, ssm_ptr, slots_ptr, pos_ptr,
                  o_ptr, nw_ptr, y_ptr, q_ptr, qk_count_ptr, norm_count_ptr, stride_p,
                  stride_cs, stride_ss, stride_q, off_z, off_b, off_a, KEY_DIM, NK, R, scale,
                  eps, HAS_POS: tl.constexpr, TILED: tl.constexpr, QUANT: tl.constexpr,
                  NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  KW: tl.constexpr, KP: tl.constexpr):
    """The three kernels' work on `_step_kernel`'s grid. The q/k conv state of key head kh
    is read by its R x DV / BV programs, so the last of them to arrive (a counter per (b, kh))
    shifts it; each program shifts its own v channels; the last of a value head's DV / BV
    programs (a counter per (b, h)) norms the head from every block's o in `o_ptr`."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kh = h % NK if TILED else h // R  # the value head's key head
    d = tl.arange(0, DK)
    keep = _keep(pos_ptr, b, HAS_POS)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p_row = p_ptr + b * stride_p
    st = conv_ptr + slot * stride_cs
    # the state tile and the gates first: their loads need not wait for the arrival below
    sp = ssm_ptr + slot * stride_ss + h * (DK * DV) + d[:, None] * DV + vv[None, :]
    s = tl.load(sp)
    decay, beta = _gates(p_row, nega_ptr, dtb_ptr, h, off_b, off_a, keep)
    all_d, all_v = d < DK, vv < DV
    q, q_nxt = _conv(p_row, cw_ptr, st, kh * DK + d, all_d, keep, KW, KP)
    k, k_nxt = _conv(p_row, cw_ptr, st, KEY_DIM + kh * DK + d, all_d, keep, KW, KP)
    v, v_nxt = _conv(p_row, cw_ptr, st, 2 * KEY_DIM + h * DV + vv, all_v, keep, KW, KP)
    if last_to_arrive(qk_count_ptr + b * NK + kh, R * (DV // BV)):
        _shift(st, kh * DK + d, all_d, q_nxt, KW, KP)
        _shift(st, KEY_DIM + kh * DK + d, all_d, k_nxt, KW, KP)
    _shift(st, 2 * KEY_DIM + h * DV + vv, all_v, v_nxt, KW, KP)  # after the arrival's barrier
    s, o = _delta_rule(q, k, v, s, decay, beta, scale)
    tl.store(sp, s)
    head = o_ptr + (b * NV + h) * DV
    tl.store(head + vv, o)
    if last_to_arrive(norm_count_ptr + b * NV + h, DV // BV):
        o_head = tl.load(head + tl.arange(0, DV), cache_modifier=".cg")  # other SMs' blocks
        _gated_norm(o_head, p_row + off_z, nw_ptr, y_ptr + b * (NV * DV), q_ptr + b * stride_q, h,
                    eps, NV, DV, QUANT)


# Arrival counters of `_fused_kernel`, one set per (sequence, key head) and one per (sequence,
# value head): 16384 words (64 KiB a device each) serve 512 sequences of 32 value heads (the
# Qwen3.6-35B-A3B shape); larger batches take the three kernels.
FUSED_COUNTERS = 16384


def supported(spec) -> bool:
    """Head sizes the kernels take (powers of two, whole value blocks)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (spec.head_k_dim, spec.head_v_dim))


def gdn_decode(proj: torch.Tensor, spec, conv_w: torch.Tensor, neg_a: torch.Tensor,
               dt_bias: torch.Tensor, norm_w: torch.Tensor, conv: torch.Tensor,
               ssm: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor | None,
               quantize: bool | None = None, fused: bool | None = None) -> torch.Tensor:
    """One token for each of B sequences. proj [B, conv_dim + value_dim + 2 nv] (in_proj's
    output: qkv, z, b, a), conv_w fp32 [C, K], neg_a / dt_bias fp32 [nv], norm_w fp32 [dv],
    conv fp32 [slots, C, K-1] and ssm fp32 [slots, nv, dk, dv] (updated in place at `slots`
    [B], distinct), positions [B] or None -> y [B, value_dim] in proj's dtype (out_proj's
    input), with its int8 codes attached (`kernels.xq`) where `quantize` (None: where an int8
    GEMV takes y, `xq.wanted`; dv a multiple of 32). `fused`: one launch (`_fused_kernel`)
    or three (False); None: one unless `FREETOKEN_GPU_GDN_FUSED=0`. Batches with more than
    FUSED_COUNTERS (sequence, value head) pairs always take three."""
    s = spec
    B = proj.shape[0]
    C, K, nv, dk, dv = s.conv_dim, s.conv_kernel, s.num_v_heads, s.head_k_dim, s.head_v_dim
    assert proj.stride(1) == 1 and conv.is_contiguous() and ssm.is_contiguous()
    dev = proj.device
    o = torch.empty(B, nv, dv, dtype=torch.float32, device=dev)
    y = torch.empty(B, s.value_dim, dtype=proj.dtype, device=dev)
    if B == 0:
        return y
    if quantize is None:
        quantize = xq.wanted(y)
    quantize = quantize and dv % 32 == 0
    q = torch.empty(B, xq_len(s.value_dim), dtype=torch.int32, device=dev) if quantize else y
    pos = positions if positions is not None else slots
    fused = (env.gpu_gdn_fused() if fused is None else fused) and B * nv <= FUSED_COUNTERS
    bv = min(32, dv)
    off_b = C + s.value_dim
    grid = (B, nv, dv // bv)
    if fused:  # NOTE: one setting for the whole kernel: the quantizer's arithmetic (below)
        _fused_kernel[grid](
            proj, conv_w, conv, neg_a, dt_bias, ssm, slots, pos, o, norm_w, y, q,
            counters("gdn_qk", FUSED_COUNTERS, dev), counters("gdn_norm", FUSED_COUNTERS, dev),
            proj.stride(0), conv.stride(0), ssm.stride(0), q.stride(0), C, off_b, off_b + nv,
            s.key_dim, s.num_k_heads, nv // s.num_k_heads, dk ** -0.5, float(s.norm_eps),
            HAS_POS=positions is not None, TILED=s.v_tiled, QUANT=quantize, NV=nv, DK=dk,
            DV=dv, BV=bv, KW=K, KP=triton.next_power_of_2(K), num_warps=4,
            enable_fp_fusion=False)
        return xq.attach(y, q) if quantize else y
    c = torch.empty(B, C, dtype=torch.float32, device=dev)
    bc = 256
    _conv_kernel[(B, triton.cdiv(C, bc))](
        proj, conv_w, conv, slots, pos, c, C, proj.stride(0), conv.stride(0),
        HAS_POS=positions is not None, KW=K, KP=triton.next_power_of_2(K), BC=bc, num_warps=4)
    _step_kernel[grid](
        c, proj, neg_a, dt_bias, ssm, slots, pos, o, C, proj.stride(0), off_b, off_b + nv,
        ssm.stride(0), s.key_dim, s.num_k_heads, nv // s.num_k_heads, dk ** -0.5,
        HAS_POS=positions is not None, TILED=s.v_tiled, NV=nv, DK=dk, DV=dv, BV=bv,
        num_warps=4)
    _gated_norm_kernel[(B * nv,)](o, proj, norm_w, y, q, proj.stride(0), q.stride(0), C,
                                  float(s.norm_eps), NV=nv, DV=dv, QUANT=quantize,
                                  num_warps=1 if dv <= 256 else 4,
                                  enable_fp_fusion=False)  # the quantizer's arithmetic
    return xq.attach(y, q) if quantize else y
