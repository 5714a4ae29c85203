"""Linear layers over `QuantWeight`s, fused from checkpoint parts at load time.

A `Linear` names the checkpoint modules it is made of (`parts`): one part for a plain
projection, several for a fused one (qkv: q_proj, k_proj, v_proj; gate_up: gate_proj,
up_proj), concatenated along the output rows in that order. Parts in one format are fused into
a single weight (and a per-row fp32 `scale2` where any part carries a second-level scale: each
part's value, 1 where a part has none); parts in different formats (a Q4_K_M GGUF stores
attn_v in Q6_K next to a Q4_K attn_q) stay separate and their outputs are concatenated.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from freetoken import kernels
from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight
from freetoken.kernels.triton.formats import device_layout  # no triton import


def take_rows(qw: QuantWeight, index: torch.Tensor) -> QuantWeight:
    """The weight with its output rows reordered by `index` (format-agnostic: rows are whole)."""
    if qw.fmt == "fp8_block":
        raise FormatError("cannot permute rows of an fp8_block weight", tensor=qw.source)
    scales = None if qw.scales is None else qw.scales.index_select(-2, index)
    s2 = qw.scale2
    if s2 is not None and s2.dim() == 1 and s2.numel() == qw.out_features:
        s2 = s2.index_select(0, index)
    return QuantWeight(
        qw.data.index_select(-2, index), qw.fmt, qw.shape, scales=scales, scale2=s2,
        ggml_type=qw.ggml_type, source=qw.source,
    )


def _row_scale(qw: QuantWeight) -> torch.Tensor:
    """One fp32 scale2 value per output row of `qw` (1 where it has none)."""
    s = torch.ones(qw.out_features, dtype=torch.float32)
    if qw.scale2 is not None:
        s = s * qw.scale2.float().reshape(-1).to(s.device)  # scalar or [out] broadcast
    return s


def _same_kind(ws: list[QuantWeight]) -> bool:
    a = ws[0]
    return all(w.fmt == a.fmt and w.ggml_type == a.ggml_type for w in ws) and a.fmt != "fp8_block"


def fuse(ws: list[QuantWeight]) -> QuantWeight:
    """Concatenate same-format weights along the output rows; scale2 becomes per row."""
    if len(ws) == 1:
        return ws[0]
    a = ws[0]
    scales = None if a.scales is None else torch.cat([w.scales for w in ws], dim=-2)
    s2 = None
    if any(w.scale2 is not None for w in ws):
        s2 = torch.cat([_row_scale(w) for w in ws])
    out = sum(w.out_features for w in ws)
    return QuantWeight(
        torch.cat([w.data for w in ws], dim=-2), a.fmt, (out, a.in_features), scales=scales,
        scale2=s2, ggml_type=a.ggml_type, source="+".join(w.source for w in ws),
    )


def _to(qw: QuantWeight, dtype: torch.dtype, device) -> QuantWeight:
    """Float weights take the model dtype; quantized storage moves unchanged, except on CUDA
    (`device_layout`: Q8_0 split for the kernels, a format without kernel decoded once)."""
    data = qw.data.to(device=device, dtype=dtype) if qw.is_float else qw.data.to(device)
    fmt = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    return device_layout(QuantWeight(
        data, fmt if qw.is_float else qw.fmt, qw.shape,
        scales=None if qw.scales is None else qw.scales.to(device),
        scale2=None if qw.scale2 is None else qw.scale2.to(device=device, dtype=torch.float32),
        ggml_type=qw.ggml_type, source=qw.source,
    ), dtype)


class Linear(nn.Module):
    """y = x @ W^T (+ bias) with W the row-concatenation of `parts`.

    parts: checkpoint module names (siblings of this module) and their output sizes, e.g.
    {"q_proj": 2048, "k_proj": 512, "v_proj": 512}; {"": n} means this module's own name.
    """

    def __init__(self, in_features: int, parts: dict[str, int] | int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.parts = {"": parts} if isinstance(parts, int) else dict(parts)
        self.out_features = sum(self.parts.values())
        self.has_bias = bias
        self.weights: list[QuantWeight] = []
        self.bias: torch.Tensor | None = None
        self._loaded: dict[str, tuple[QuantWeight, torch.Tensor | None]] = {}

    def load(self, part: str, qw: QuantWeight, bias: torch.Tensor | None = None) -> None:
        """Take one part's weight (and bias); shapes are checked against the config."""
        want = (self.parts[part], self.in_features)
        if want[0] == 1 and tuple(qw.shape) == want[1:]:  # llama.cpp's quantizer writes a
            qw = replace(qw, data=qw.data.reshape(want) if qw.is_float else qw.data,
                         shape=want)  # [1, n] matrix 1-D (ffn_gate_inp_shexp), as it reads it
        if tuple(qw.shape) != want:
            raise FormatError(f"shape {list(qw.shape)}, expected {list(want)}", tensor=qw.source)
        if bias is not None and tuple(bias.shape) != (want[0],):
            raise FormatError(f"bias shape {list(bias.shape)}, expected [{want[0]}]",
                              tensor=qw.source)
        self._loaded[part] = (qw, bias)

    def missing(self) -> list[str]:
        return [p for p in self.parts if p not in self._loaded]

    def finalize(self, dtype: torch.dtype, device) -> None:
        """Fuse the loaded parts (all must be present: the loader checks) and place them."""
        ws = [_to(self._loaded[p][0], dtype, device) for p in self.parts]
        self.weights = [fuse(ws)] if _same_kind(ws) else ws
        if self.has_bias:
            self.bias = torch.cat([self._loaded[p][1] for p in self.parts]).to(device, dtype)
        self._loaded = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.weights) == 1:
            return kernels.linear(x, self.weights[0], self.bias)
        y = torch.cat([kernels.linear(x, w) for w in self.weights], dim=-1)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        fmts = ",".join(w.fmt for w in self.weights) or "unloaded"
        return f"in={self.in_features}, parts={self.parts}, bias={self.has_bias}, fmt={fmts}"
