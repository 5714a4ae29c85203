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


# (sin, [-sin1, sin2], cos, cos) as [T, 1, d]: the last step's tables, shared by its layers
_signed_sin: list = [None, None, None, None]


def _rotary_cpu_f32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary_reference for fp32 CPU tensors in four ops, bit for bit (a decode step runs two a
    layer, and each op costs a dispatch): x * cos + [x2, x1] * [-sin1, sin2]."""
    h = x.shape[-1] // 2
    if _signed_sin[0] is not sin or _signed_sin[2] is not cos:  # the same tables every layer
        _signed_sin[:] = [sin, torch.cat([-sin[:, :h], sin[:, h:]], dim=-1)[:, None, :], cos,
                          cos[:, None, :]]
    swapped = x.roll(h, dims=-1)  # [x2, x1]
    return swapped.mul_(_signed_sin[1]).add_(x * _signed_sin[3])


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"qk_rope: q must be [T, Hq, d] and k [T, Hkv, d], got "
                         f"{list(q.shape)} and {list(k.shape)}")
    t, _, d = q.shape
    r = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.shape != (t, r) or sin.shape != (t, r) or not 0 < r <= d or r % 2:
        raise ValueError(f"qk_rope: cos/sin must be [T={t}, r] with r = d = {d} or an even "
                         f"r < d (partial rotary), got {list(cos.shape)} and "
                         f"{list(sin.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_rope: pass both q and k norm weights or neither")
    if q_weight is not None and (q_weight.shape != (d,) or k_weight.shape != (d,)):
        raise ValueError(f"qk_rope: norm weights must be [{d}], got {list(q_weight.shape)} "
                         f"and {list(k_weight.shape)}")


def _on_gpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            weights: tuple) -> bool:
    return (q.is_cuda and all(t.is_cuda for t in (cos, sin, *weights) if t is not None)
            and triton_layout(q, k, cos, sin, weights))


def triton_layout(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  weights: tuple) -> bool:
    """Whether `qk_rope_triton` takes these tensors, their device aside: one dtype for q and
    k, d / 2 a power of two, unit stride in d, fp32 tables (with one row stride) and
    weights."""
    d = q.shape[-1]
    fp32 = (cos, sin) + tuple(w for w in weights if w is not None)
    return (q.dtype == k.dtype and d % 2 == 0 and (d // 2) & (d // 2 - 1) == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1
            and all(t.dtype == torch.float32 and t.stride(-1) == 1 for t in fp32)
            and cos.stride(0) == sin.stride(0))


def store_layout(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether `qk_rope_triton` can store k' and v into `cache` (device aside)."""
    return (v.stride(-1) == 1 and v.shape == k.shape and cache.is_contiguous()
            and cache.shape[-2:] == k.shape[-2:])


def qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
            eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hkv, d]; cos/sin fp32 [T, r] (r = d, or r < d: only each head's
    first r values rotate, the rest pass); optional fp32 [d] RMSNorm weights applied to each
    whole head first -> rotated (q, k) in their dtype."""
    _check(q, k, cos, sin, q_weight, k_weight)
    if _on_gpu(q, k, cos, sin, (q_weight, k_weight)):
        from freetoken.kernels.triton.rotary import qk_rope_triton  # lazy: needs triton

        return qk_rope_triton(q, k, cos, sin, q_weight, k_weight, eps)
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    r = cos.shape[-1]
    if r < q.shape[-1]:  # partial: the first r values rotated, the rest as they are
        qr, kr = qk_rope(q[..., :r], k[..., :r], cos, sin)
        return torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1)
    if not q.is_cuda and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32:
        hq, d = q.shape[1], q.shape[2]
        if ((q.shape[0] == 1 or q.stride(0) == k.stride(0)) and q.stride()[1:] == (d, 1)
                and k.stride()[1:] == (d, 1)
                and k.data_ptr() == q.data_ptr() + hq * d * 4):  # k's heads follow q's (qkv)
            qk = _rotary_cpu_f32(q.as_strided((q.shape[0], hq + k.shape[1], d), q.stride()),
                                 cos, sin)
            return qk[:, :hq], qk[:, hq:]
        return _rotary_cpu_f32(q, cos, sin), _rotary_cpu_f32(k, cos, sin)
    return rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)


def qk_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, cache: torch.Tensor,
                  slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`qk_rope`, and on the GPU the rotated k and v written into the KV cache (`cache`
    [2, pages, page_size, Hkv, d], flat `slots` [T], negative = padding) in the same launch:
    (q', k', stored). `stored` False: the cache is untouched (the caller's paged_attention
    stores k' and v, as it always did)."""
    _check(q, k, cos, sin, q_weight, k_weight)
    if (_on_gpu(q, k, cos, sin, (q_weight, k_weight)) and v.is_cuda and cache.is_cuda
            and slots.is_cuda and store_layout(k, v, cache)):
        from freetoken.kernels.triton.rotary import qk_rope_triton  # lazy: needs triton

        q, k = qk_rope_triton(q, k, cos, sin, q_weight, k_weight, eps, (v, cache, slots))
        return q, k, True
    q, k = qk_rope(q, k, cos, sin, q_weight, k_weight, eps)
    return q, k, False
