"""Activations quantized once, by the kernel that produces them, for the int8 decode GEMVs.

An int8 GEMV (`kernels/triton/gemv_i8.py`) quantizes its activation per 32 values. Launched as
hundreds of programs (the MoE's gate/up: one per route and row block), each program would
quantize the same row again. The RMSNorm kernel can quantize its output once instead
(`gemv_i8.quant_store`, the same arithmetic bit for bit) and hand the codes to every GEMV that
reads that output: they travel as an attribute of the output tensor (`attach`), checked
against the tensor's storage and shape when read (`attached`), so a consumer that receives
another tensor (a copy, a view, a slice) simply quantizes for itself.

Who asks: the decoder layers whose normalised activation goes straight into a linear and the
MoE (`RMSNorm(..., quantize=True)`); nobody else pays for it.
"""

from __future__ import annotations

import torch

from freetoken import env

MAX_ROWS = 16  # the int8 GEMVs run at decode sizes only (linear: up to 4 tokens, MoE: 16)
_ATTR = "_freetoken_xq"


def int8_dots(dtype: torch.dtype) -> bool:
    """Whether the GPU's decode GEMVs multiply activations of this dtype in int8: 16-bit ones
    (fp32 runs stay exact), FREETOKEN_GPU_INT8_DOT not 0, and not ROCm (the dots are PTX)."""
    return (dtype in (torch.bfloat16, torch.float16) and torch.version.hip is None
            and env.gpu_int8_dot())


def wanted(x: torch.Tensor) -> bool:
    """Whether quantizing x's rows ahead can serve an int8 GEMV: a CUDA activation of few rows
    that the int8 dots take (`int8_dots`), a width in whole 32-value blocks."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.is_cuda and rows <= MAX_ROWS and x.shape[-1] % 32 == 0
            and int8_dots(x.dtype))


def tag(y: torch.Tensor, attr: str, value) -> torch.Tensor:
    """y, carrying `value` under `attr` for `tagged`: something its producer computed from it
    for a consumer that would otherwise compute it again (its int8 codes here, its MoE routes
    in `kernels.route`)."""
    setattr(y, attr, (value, y.data_ptr(), tuple(y.shape)))
    return y


def tagged(x: torch.Tensor, attr: str):
    """The value `tag` gave this very tensor (same storage and shape), else None."""
    entry = getattr(x, attr, None)
    if entry is None:
        return None
    value, ptr, shape = entry
    return value if ptr == x.data_ptr() and shape == tuple(x.shape) else None


def attach(y: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """y, carrying its quantized rows q (int32 [rows, xq_len(K)]) for `attached`."""
    return tag(y, _ATTR, q) if q is not None else y


def attached(x: torch.Tensor) -> torch.Tensor | None:
    """The quantized rows `attach` gave this very tensor (same storage and shape), else None."""
    return tagged(x, _ATTR)


def view(x: torch.Tensor, *shape: int) -> torch.Tensor:
    """x.view(*shape), carrying x's quantized rows (the same bytes, seen as rows of the last
    dimension: attention's [T, heads, d] output as the output projection's [T, heads d])."""
    return attach(x.view(*shape), attached(x))
