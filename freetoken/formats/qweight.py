"""The quantized-weight dataclass that every loader produces and every linear consumes.

A weight is raw storage plus its format; nothing outside `freetoken/formats` and the kernel
entry points looks at the bytes. Logical shape is `[out, in]` for a matrix and `[E, out, in]`
for an expert bank.

Formats and their storage (`data`, `scales`):

- ``"f32" | "f16" | "bf16"``: `data` is the float tensor of the logical shape, `scales` None.
- ``"nvfp4"``: ModelOpt layout. `data` uint8 `[..., out, in/2]`, two E2M1 codes per byte, low
  nibble = even k, high nibble = odd k. `scales` float8_e4m3fn `[..., out, in/16]`.
  GGUF NVFP4 is repacked into this layout at load time (DESIGN.md).
- ``"fp8_block"``: `data` float8_e4m3fn `[..., out, in]`; `scales` fp32
  `[..., ceil(out/128), ceil(in/128)]` (`weight_scale_inv`, multiplied in).
- ``"mxfp4"``: `data` uint8 `[..., out, in/2]` (low nibble first, E2M1); `scales` uint8 E8M0
  `[..., out, in/32]`.
- ``"gguf"``: llama.cpp blocks as stored. `data` uint8 `[..., out, row_bytes]`; `ggml_type` holds
  the `gguf.GGMLQuantizationType` value. `scales` None (they are inside the blocks).

`scale2` is the second-level scale that multiplies *results*, never weights:
`y = (x @ W^T) * scale2`. It is fp32 and either a scalar-per-matrix `[]`, one value per expert
`[E]`, or one value per output row `[out]` for fused modules (qkv, gate_up). None means 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FLOAT_FORMATS = ("f32", "f16", "bf16")
QUANT_FORMATS = ("nvfp4", "fp8_block", "mxfp4", "gguf")


@dataclass(eq=False)
class QuantWeight:
    data: torch.Tensor
    fmt: str
    shape: tuple[int, ...]
    scales: torch.Tensor | None = None
    scale2: torch.Tensor | None = None
    ggml_type: int | None = None
    # Free-form provenance for messages (file and tensor name).
    source: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.fmt not in FLOAT_FORMATS + QUANT_FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r} for {self.source or 'weight'}")
        if self.fmt == "gguf" and self.ggml_type is None:
            raise ValueError(f"gguf weight {self.source or ''} needs ggml_type")

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def is_float(self) -> bool:
        return self.fmt in FLOAT_FORMATS

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n
