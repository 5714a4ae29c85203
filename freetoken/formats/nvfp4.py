"""NVFP4: the one in-memory layout (ModelOpt's) and the repack of GGUF NVFP4 bytes into it.

ModelOpt layout (DESIGN.md, qweight.py): codes uint8 `[..., N, K/2]`, byte i of a row holds value
2i in its low nibble and 2i+1 in its high nibble; block scales float8_e4m3fn `[..., N, K/16]`, one
per 16 values; value = E2M1(code) * E4M3(scale). The second-level scale is not applied here.

GGUF NVFP4 (gguf-py, ggml): 64-value super-blocks of 36 bytes = 4 UE4M3 scale bytes + 32 code
bytes; sub-block s (16 values) uses code bytes 8s..8s+7, byte j's low nibble = value j and high
nibble = value j+8. ggml stores E2M1 doubled ({0, 1, 2, 3, 4, 6, 8, 12} and negatives) and halves
the decoded scale, so value = 2*E2M1(code) * UE4M3(byte)/2: the same number as ModelOpt's.
llama.cpp's converter copies ModelOpt's E4M3 scale bits with the sign bit cleared, and ggml
ignores bit 7 and decodes 0x7F (E4M3's NaN) as 0.

The repack therefore keeps the scale bits (bit 7 cleared, 0x7F -> 0x00) and moves nibbles.
NOTE: byte 0xFF decodes in ggml to UE4M3 0x7F's pattern, 480, which E4M3 cannot hold (max 448);
the converter never writes it, and the repack refuses it rather than change a value.
Every product E2M1 x E4M3 is exact in fp32 (at most 2 + 4 significant bits), so `dequant_nvfp4`
of the repacked bytes equals `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

import torch

from freetoken.formats.errors import FormatError

# E2M1 code -> value. Code 8 is E2M1's -0; it decodes as +0.0, as in ggml's table (whose
# doubled value 0 has no sign), so both paths give identical bits, zeros included.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

GGUF_BLOCK = 64  # values per GGUF super-block
GGUF_BLOCK_BYTES = 36  # 4 scale bytes + 32 code bytes
SUB = 16  # values per scale


def _scales_f32(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    if scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"NVFP4 block scales must be float8_e4m3fn or uint8, got {scales.dtype}")
    return scales.to(torch.float32)


def dequant_nvfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize ModelOpt NVFP4: codes uint8 [..., N, K/2], scales E4M3 [..., N, K/16] -> fp32
    [..., N, K]. No second-level scale (multiply results by `weight_scale_2` / `.scale`)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"NVFP4 codes must be uint8, got {codes.dtype}")
    half_k = codes.shape[-1]
    if scales.shape[:-1] != codes.shape[:-1] or scales.shape[-1] * 8 != half_k:
        raise ValueError(
            f"NVFP4 shapes disagree: codes {tuple(codes.shape)} need scales "
            f"{(*codes.shape[:-1], half_k // 8)}, got {tuple(scales.shape)}"
        )
    lo = (codes & 0x0F).long()
    hi = (codes >> 4).long()
    idx = torch.stack([lo, hi], dim=-1).reshape(*codes.shape[:-1], half_k * 2)  # [..., N, K]
    lut = E2M1_VALUES.to(codes.device)
    vals = lut[idx].reshape(*codes.shape[:-1], -1, SUB)  # [..., N, K/16, 16]
    out = vals * _scales_f32(scales).unsqueeze(-1)
    return out.reshape(*codes.shape[:-1], half_k * 2)


def gguf_scale_bytes_to_e4m3(raw_scales: torch.Tensor, *, name: str = "") -> torch.Tensor:
    """GGUF UE4M3 scale bytes (uint8) -> E4M3 bytes with the same decoded value (see module doc).

    Raises FormatError (naming `name`) on byte 0xFF, whose value E4M3 cannot represent."""
    if bool((raw_scales == 0xFF).any()):
        raise FormatError(
            "NVFP4 block scale byte 0xFF (UE4M3 480) is outside E4M3's range (max 448); "
            "llama.cpp's converter never writes it",
            tensor=name or None,
        )
    s = raw_scales & 0x7F
    s = torch.where(s == 0x7F, torch.zeros_like(s), s)  # ggml decodes 0x7F (NaN) as 0
    return s.view(torch.float8_e4m3fn)


def gguf_nvfp4_to_modelopt(
    raw: torch.Tensor, *, name: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """Repack GGUF NVFP4 rows uint8 [..., N, K/64*36] into ModelOpt (codes uint8 [..., N, K/2],
    scales float8_e4m3fn [..., N, K/16]). Copies; the input may be a read-only file view."""
    if raw.dtype != torch.uint8:
        raise ValueError(f"GGUF NVFP4 data must be uint8, got {raw.dtype}")
    row_bytes = raw.shape[-1]
    if row_bytes % GGUF_BLOCK_BYTES:
        raise FormatError(
            f"NVFP4 row of {row_bytes} bytes is not a multiple of {GGUF_BLOCK_BYTES}",
            tensor=name or None,
        )
    lead = raw.shape[:-1]
    nb = row_bytes // GGUF_BLOCK_BYTES
    blocks = raw.reshape(*lead, nb, GGUF_BLOCK_BYTES)
    scales = gguf_scale_bytes_to_e4m3(blocks[..., :4].reshape(*lead, nb * 4), name=name)
    qs = blocks[..., 4:].reshape(*lead, nb * 4, 8)  # [..., N, K/16, 8]: one sub-block per row
    vals = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [..., N, K/16, 16] in value order
    codes = vals[..., 0::2] | (vals[..., 1::2] << 4)  # [..., N, K/16, 8] ModelOpt pairs
    return codes.reshape(*lead, nb * 32).contiguous(), scales.contiguous()


def modelopt_to_gguf_nvfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The inverse repack (ModelOpt -> GGUF rows), as llama.cpp's converter writes it: scale
    sign bits cleared. K must be a multiple of 64. Used by tests and tools."""
    lead = codes.shape[:-1]
    nsub = scales.shape[-1]
    if nsub % 4:
        raise ValueError(f"GGUF NVFP4 needs K a multiple of 64, got K = {nsub * SUB}")
    c = codes.reshape(*lead, nsub, 8)
    vals = torch.stack([c & 0x0F, c >> 4], dim=-1).reshape(*lead, nsub, 16)
    qs = vals[..., :8] | (vals[..., 8:] << 4)  # [..., N, K/16, 8]
    d = scales.contiguous().view(torch.uint8).reshape(*lead, nsub // 4, 4) & 0x7F
    qs = qs.reshape(*lead, nsub // 4, 32)
    return torch.cat([d, qs], dim=-1).reshape(*lead, nsub // 4 * GGUF_BLOCK_BYTES)
