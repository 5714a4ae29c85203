"""One dequantization entry point over every weight format (the torch reference path).

`dequantize(qw)` returns fp32 of the weight's logical shape. The second-level scale multiplies
*results* (DESIGN.md), so it is left out unless `apply_scale2=True`, which folds it into the
weight for references and tests: per matrix `[]`, per expert `[E]`, or per output row `[out]`.
"""

from __future__ import annotations

import torch

from freetoken.formats.qweight import QuantWeight


def _apply_scale2(w: torch.Tensor, s: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    s = s.to(torch.float32)
    if s.dim() == 0:
        return w * s
    if w.dim() == 3 and s.shape == (w.shape[0],):  # one value per expert
        return w * s.reshape(-1, 1, 1)
    if s.shape == (w.shape[-2],):  # one value per output row
        return w * s.reshape(-1, 1)
    raise ValueError(f"{qw.source or 'weight'}: scale2 of shape {tuple(s.shape)} fits neither "
                     f"a scalar, [E] nor [out] of weight shape {tuple(w.shape)}")


def _dequant_raw(qw: QuantWeight) -> torch.Tensor:
    if qw.is_float:
        return qw.data.to(torch.float32).reshape(qw.shape)
    if qw.fmt == "gguf":
        from freetoken.formats.codecs import dequantize_gguf

        assert qw.ggml_type is not None
        return dequantize_gguf(qw.data, qw.ggml_type, qw.shape)
    if qw.scales is None:
        raise ValueError(f"{qw.source or 'weight'}: {qw.fmt} weight has no block scales")
    if qw.fmt == "nvfp4":
        from freetoken.formats.nvfp4 import dequant_nvfp4

        return dequant_nvfp4(qw.data, qw.scales).reshape(qw.shape)
    # H2's HF references, imported lazily so GGUF-only use never needs them.
    from freetoken.formats import hf_quant

    if qw.fmt == "fp8_block":
        return hf_quant.dequant_fp8_block(qw.data, qw.scales).reshape(qw.shape)
    if qw.fmt == "mxfp4":
        return hf_quant.dequant_mxfp4(qw.data, qw.scales).reshape(qw.shape)
    raise ValueError(f"{qw.source or 'weight'}: no dequantization for format {qw.fmt!r}")


def dequantize(qw: QuantWeight, *, apply_scale2: bool = False) -> torch.Tensor:
    """fp32 tensor of `qw.shape`; with `apply_scale2`, the second-level scale folded in."""
    w = _dequant_raw(qw)
    if apply_scale2 and qw.scale2 is not None:
        w = _apply_scale2(w, qw.scale2, qw)
    return w
