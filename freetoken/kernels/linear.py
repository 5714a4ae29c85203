"""Reference (torch, CPU) entry points for linear layers and embedding lookups.

Quantized weights stay quantized in memory: each call dequantizes what it needs, tile by tile
(rows of the weight), multiplies in fp32 and applies the second-level scale to the result
(`y = (x @ W^T) * scale2`, DESIGN.md). On CUDA tensors the Triton kernels of
`freetoken.kernels.triton.linear` take over (weights decoded in registers, read once per call);
this torch path stays the CPU path and the oracle of their tests.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from freetoken.formats.qweight import QuantWeight
from freetoken.kernels.cpu_kernels import cpu_embedding, cpu_linear

log = logging.getLogger(__name__)
_FLOAT_FMT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# Dequantize at most this many weight elements at once (4 MiB of fp32): a tile is still in
# L2/L3 when the matmul reads it back, where a 64 MiB tile went to DRAM and back.
TILE_ELEMS = 1 << 20
# fp8_block scales cover 128 rows each; tiles start on multiples of this.
ROW_ALIGN = 128


def _dequantize(qw: QuantWeight) -> torch.Tensor:
    from freetoken.formats.dequant import dequantize  # lazy: formats is a sibling package

    return dequantize(qw, apply_scale2=False)


def slice_rows(qw: QuantWeight, start: int, stop: int) -> QuantWeight:
    """Rows [start, stop) of a 2-D weight, in its own format (views, no copy)."""
    if qw.is_float:
        return QuantWeight(qw.data[start:stop], qw.fmt, (stop - start, qw.in_features))
    scales = qw.scales
    if scales is not None:
        if qw.fmt == "fp8_block":
            assert start % ROW_ALIGN == 0, "fp8_block tiles start on a 128-row boundary"
            scales = scales[start // ROW_ALIGN : -(-stop // ROW_ALIGN)]
        else:
            scales = scales[start:stop]
    return QuantWeight(
        qw.data[start:stop], qw.fmt, (stop - start, qw.in_features), scales=scales,
        ggml_type=qw.ggml_type, source=qw.source,
    )


def _tile_rows(qw: QuantWeight) -> int:
    rows = max(1, TILE_ELEMS // max(1, qw.in_features))
    return max(ROW_ALIGN, rows - rows % ROW_ALIGN)


def apply_scale2(y: torch.Tensor, scale2: torch.Tensor | None) -> torch.Tensor:
    """Multiply results by the second-level scale: scalar `[]` or per output row `[out]`."""
    if scale2 is None:
        return y
    return y * scale2.to(device=y.device, dtype=torch.float32)


def linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., out] = (x[..., in] @ W^T) * scale2 + bias, for any weight format.

    Float weights use `F.linear` in the activation dtype. Quantized weights are dequantized
    per call in row tiles and multiplied in fp32 (the scale2 of NVFP4 is ~1e-4: the product
    is accumulated in fp32 before scaling), then cast back to x's dtype.
    """
    if len(qw.shape) != 2 or x.shape[-1] != qw.in_features:
        raise ValueError(
            f"linear: input [..., {x.shape[-1]}] does not fit weight {qw.source or ''} "
            f"of shape {list(qw.shape)}"
        )
    if qw.is_float:
        y = F.linear(x, qw.data.to(x.dtype))
        if qw.scale2 is not None:
            y = apply_scale2(y.float(), qw.scale2).to(x.dtype)
    elif _on_gpu(x, qw):
        from freetoken.kernels.triton.linear import triton_linear  # lazy: needs triton

        y = triton_linear(x, qw)
    else:
        y = _cpu_quant_linear(x, qw)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def _on_gpu(x: torch.Tensor, qw: QuantWeight) -> bool:
    """CUDA tensors of a format the Triton kernels decode (the rest take the torch path)."""
    if not (x.is_cuda and qw.data.is_cuda):
        return False
    from freetoken.kernels.triton.formats import format_id  # no triton import

    return format_id(qw) is not None


def linear_reference(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """`linear` (no bias) in torch's float math on the CPU: the weight dequantized in row
    tiles, an fp32 matmul. The oracle of the executor's tests and of the MoE reference."""
    if qw.is_float:
        y = F.linear(x, qw.data.to(x.dtype))
        return y if qw.scale2 is None else apply_scale2(y.float(), qw.scale2).to(x.dtype)
    return _quant_linear(x, qw)


def linear_float(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """`linear` (no bias) in float math on the CPU at any token count: the executor's row
    decoder (bit for bit the codecs) and torch's GEMM where it reads the format, else
    `linear_reference` (the MoE layers' prefill, and their oracle)."""
    if not x.is_cuda and not qw.is_float:
        y = cpu_linear(x, qw, gemm=True)
        if y is not None:
            return apply_scale2(y, qw.scale2).to(x.dtype)
    return linear_reference(x, qw)


def _cpu_quant_linear(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """CPU: the C++ executor's kernels where it reads the format
    (`freetoken.kernels.cpu_kernels.cpu_linear`), else this module's reference."""
    y = cpu_linear(x, qw) if not x.is_cuda else None
    if y is None:
        return _quant_linear(x, qw)
    if qw.scale2 is not None:
        y = apply_scale2(y, qw.scale2)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _quant_linear(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    xf = x.float().reshape(-1, qw.in_features)
    n, step = qw.out_features, _tile_rows(qw)
    # yt[out, tokens]: each tile's rows are a contiguous slice, written in place (no concat).
    yt = torch.empty(n, xf.shape[0], dtype=torch.float32, device=xf.device)
    for s in range(0, n, step):
        e = min(n, s + step)
        w = _dequantize(qw if e - s == n else slice_rows(qw, s, e)).to(xf.device)
        torch.mm(w, xf.T, out=yt[s:e])
    y = apply_scale2(yt.T, qw.scale2).reshape(*x.shape[:-1], n)
    return y.to(x.dtype).contiguous()


def embedding(ids: torch.Tensor, qw: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding table [vocab, hidden]: gather rows, then dequantize only them.

    A scale2 (NVFP4 `token_embd.scale`) multiplies the gathered rows.
    """
    flat = ids.reshape(-1)
    if qw.is_float:
        rows = qw.data.index_select(0, flat).to(dtype)
        if qw.scale2 is not None:
            rows = apply_scale2(rows.float(), qw.scale2).to(dtype)
        return rows.reshape(*ids.shape, qw.in_features)
    if _on_gpu(flat, qw) and (qw.scale2 is None or qw.scale2.numel() == 1):
        from freetoken.kernels.triton.linear import triton_embedding

        return triton_embedding(ids, qw, dtype)
    if flat.device.type == "cpu" and qw.data.device.type == "cpu":
        rows = cpu_embedding(flat, qw)
        if rows is not None:
            return apply_scale2(rows, qw.scale2).to(dtype).reshape(*ids.shape, qw.in_features)
    scales = qw.scales
    if scales is not None:
        if qw.fmt == "fp8_block":  # rare: dequantize whole 128-row blocks, then pick
            w = _dequantize(qw)
            return apply_scale2(w[flat], qw.scale2).to(dtype).reshape(*ids.shape, -1)
        scales = scales.index_select(0, flat)
    sub = QuantWeight(
        qw.data.index_select(0, flat), qw.fmt, (flat.numel(), qw.in_features), scales=scales,
        ggml_type=qw.ggml_type, source=qw.source,
    )
    rows = apply_scale2(_dequantize(sub), qw.scale2)
    return rows.to(dtype).reshape(*ids.shape, qw.in_features)


def dequantize_at_load(qw: QuantWeight, dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
    """For the loader: a weight whose format has no GPU kernel (a rare GGUF type: Q2_K, Q3_K,
    Q5_0, Q5_1, IQ*, TQ*) -> a float weight, decoded once by the reference codecs, with a log
    line saying so; scale2 stays beside it. Weights the Triton kernels read come back as they
    are. Needs no triton (the format table is plain Python)."""
    from freetoken.kernels.triton.formats import format_id

    if format_id(qw) is not None:
        return qw
    name = f"GGUF type {qw.ggml_type}" if qw.fmt == "gguf" else qw.fmt
    log.info("%s: no GPU kernel for %s; dequantized once at load to %s",
             qw.source or "weight", name, dtype)
    return QuantWeight(_dequantize(qw).to(dtype), _FLOAT_FMT[dtype], tuple(qw.shape),
                       scale2=qw.scale2, source=qw.source)
