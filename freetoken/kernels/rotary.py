"""Rotary embedding of q and k (with the optional per-head q/k RMSNorm before it): the torch
reference (CPU, and the oracle of the kernel tests) and, on CUDA, one Triton launch for both
tensors (`freetoken.kernels.triton.rotary`).
"""

from __future__ import annotations

import torch

from freetoken.kernels.norm import rms_norm


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] rotated in fp32 (rotate_half convention), returned in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


_signed_sin: list = [None, None]  # (sin, [-sin1, sin2]): the last step's table, shared by layers


def _rotary_cpu_f32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary_reference for fp32 CPU tensors in four ops, bit for bit (a decode step runs two a
    layer, and each op costs a dispatch): x * cos + [x2, x1] * [-sin1, sin2]."""
    h = x.shape[-1] // 2
    if _signed_sin[0] is not sin:  # every layer of a step passes the same table
        _signed_sin[:] = [sin, torch.cat([-sin[:, :h], sin[:, h:]], dim=-1)[:, None, :]]
    swapped = torch.cat([x[..., h:], x[..., :h]], dim=-1)
    return swapped.mul_(_signed_sin[1]).add_(x * cos[:, None, :])


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"qk_rope: q must be [T, Hq, d] and k [T, Hkv, d], got "
                         f"{list(q.shape)} and {list(k.shape)}")
    t, _, d = q.shape
    if cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"qk_rope: cos/sin must be [T={t}, d={d}], got {list(cos.shape)} "
                         f"and {list(sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_rope: pass both q and k norm weights or neither")
    if q_weight is not None and (q_weight.shape != (d,) or k_weight.shape != (d,)):
        raise ValueError(f"qk_rope: norm weights must be [{d}], got {list(q_weight.shape)} "
                         f"and {list(k_weight.shape)}")


def _on_gpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            weights: tuple) -> bool:
    d = q.shape[-1]
    fp32 = (cos, sin) + tuple(w for w in weights if w is not None)
    return (q.is_cuda and q.dtype == k.dtype and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1
            and all(t.is_cuda and t.dtype == torch.float32 and t.stride(-1) == 1 for t in fp32)
            and cos.stride(0) == sin.stride(0))


def qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
            eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hkv, d]; cos/sin fp32 [T, d]; optional fp32 [d] RMSNorm weights
    applied to each head first -> rotated (q, k) in their dtype."""
    _check(q, k, cos, sin, q_weight, k_weight)
    if _on_gpu(q, k, cos, sin, (q_weight, k_weight)):
        from freetoken.kernels.triton.rotary import qk_rope_triton  # lazy: needs triton

        return qk_rope_triton(q, k, cos, sin, q_weight, k_weight, eps)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    if not q.is_cuda and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32:
        return _rotary_cpu_f32(q, cos, sin), _rotary_cpu_f32(k, cos, sin)
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
