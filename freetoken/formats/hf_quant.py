"""HF quantized weights: which tensors make a weight, their checks, and torch dequantization.

Tensor names per format (`P` is the module prefix, e.g. "model.layers.0.mlp.down_proj"):

- float: `P.weight` F32 / BF16 / F16 -> fmt f32 / bf16 / f16.
- ModelOpt NVFP4: `P.weight` U8 [N, K/2], `P.weight_scale` F8_E4M3 [N, K/16],
  `P.weight_scale_2` F32 [], `P.input_scale` F32 [] (read, unused) -> nvfp4,
  scale2 = weight_scale_2.
- compressed-tensors NVFP4: `P.weight_packed` U8 [N, K/2], `P.weight_scale` F8_E4M3 [N, K/16],
  `P.weight_global_scale` F32 [1], `P.input_global_scale` (unused) -> nvfp4,
  scale2 = 1 / weight_global_scale.
- FP8 block: `P.weight` F8_E4M3 [N, K], `P.weight_scale_inv` F32 [ceil(N/128), ceil(K/128)]
  -> fp8_block.
- gpt-oss MXFP4: `P_blocks` U8 [..., N, K/32, 16], `P_scales` U8 (E8M0) [..., N, K/32] -> mxfp4.

compressed-tensors stores the *global* scale as the reciprocal of ModelOpt's weight_scale_2
(w = code * scale / global_scale); llama.cpp's converter takes 1 / global_scale in fp32 too.
Leading dimensions (stacked experts `[E, ...]`) are allowed; scale2 is then `[]` or `[E]`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

import torch

from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight

if TYPE_CHECKING:
    from freetoken.formats.safetensors import HFCheckpoint

FLOAT_DTYPES = {"F32": "f32", "BF16": "bf16", "F16": "f16"}
# Suffixes of auxiliary tensors that belong to a weight (never weights themselves).
AUX_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".weight_scale_inv",
                ".weight_global_scale", ".input_global_scale", "_scales", ".k_scale",
                ".v_scale")
METHOD_OF_FORMAT = {"nvfp4": ("modelopt_nvfp4", "compressed_tensors_nvfp4"),
                    "fp8_block": ("fp8_block",), "mxfp4": ("mxfp4",)}

# -- dequantization references ------------------------------------------------------------------


def _e8m0_table() -> torch.Tensor:
    """2**(e - 127) for e in 0..255 built from bit patterns (exact); 255 is NaN (OCP MX spec)."""
    e = torch.arange(256, dtype=torch.int32)
    bits = torch.where(e == 0, torch.tensor(1 << 22, dtype=torch.int32), e << 23)
    bits[255] = 0x7FC00000
    return bits.view(torch.float32)


def dequant_mxfp4(blocks_u8: torch.Tensor, scales_e8m0_u8: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> fp32. blocks [..., N, K/2] (low nibble = even k), scales E8M0 [..., N, K/32].

    Also accepts gpt-oss's 4-D blocks [..., N, K/32, 16]. Returns [..., N, K].
    """
    from freetoken.formats.nvfp4 import E2M1_VALUES

    if blocks_u8.dtype != torch.uint8 or scales_e8m0_u8.dtype != torch.uint8:
        raise ValueError("dequant_mxfp4 expects uint8 blocks and uint8 E8M0 scales")
    if blocks_u8.dim() == scales_e8m0_u8.dim() + 1:
        blocks_u8 = blocks_u8.flatten(-2)
    k = blocks_u8.shape[-1] * 2
    if k % 32 or tuple(scales_e8m0_u8.shape) != (*blocks_u8.shape[:-1], k // 32):
        raise ValueError(f"MXFP4 scales {tuple(scales_e8m0_u8.shape)} do not fit blocks "
                         f"{tuple(blocks_u8.shape)} (expected [..., N, K/32] with K={k})")
    lut = E2M1_VALUES.to(blocks_u8.device)
    b = blocks_u8.long()
    # [..., N, K/2, 2] -> [..., N, K]: even k from the low nibble, odd k from the high one.
    vals = torch.stack([lut[b & 0xF], lut[b >> 4]], dim=-1).flatten(-2)
    scale = _e8m0_table().to(blocks_u8.device)[scales_e8m0_u8.long()]  # [..., N, K/32]
    return (vals.unflatten(-1, (k // 32, 32)) * scale.unsqueeze(-1)).flatten(-2)


def dequant_fp8_block(data_f8: torch.Tensor, scale_inv_f32: torch.Tensor,
                      block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """FP8 E4M3 with one fp32 multiplier per `block` tile -> fp32 [..., N, K].

    scale_inv [..., ceil(N/128), ceil(K/128)] multiplies (DeepSeek's `weight_scale_inv`).
    """
    n, k = data_f8.shape[-2:]
    want = (*data_f8.shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv_f32.shape) != want:
        raise ValueError(f"FP8 block scales {tuple(scale_inv_f32.shape)} do not fit data "
                         f"{tuple(data_f8.shape)} (expected {want})")
    s = scale_inv_f32.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return data_f8.float() * s[..., :n, :k]


# -- assembling a weight from its tensors -------------------------------------------------------


def weight_prefix(name: str) -> str | None:
    """The module prefix a *primary* weight tensor belongs to, else None."""
    for suf in (".weight", ".weight_packed", "_blocks"):
        if name.endswith(suf):
            return name[: -len(suf)]
    return None


def weight_names(ck: HFCheckpoint, prefix: str) -> list[str]:
    """The tensors `assemble_weight` consumes for `prefix` (for strict loaders)."""
    return assemble_weight(ck, prefix)[1]


def assemble_weight(ck: HFCheckpoint, prefix: str) -> tuple[QuantWeight, list[str]]:
    """Build the QuantWeight of module `prefix` and list the tensors it used."""
    if ck.has(prefix + "_blocks"):
        return _mxfp4(ck, prefix)
    if ck.has(prefix + ".weight_packed"):
        return _nvfp4(ck, prefix, prefix + ".weight_packed", compressed=True)
    w = prefix + ".weight"
    if not ck.has(w):
        raise FormatError("no weight (.weight, .weight_packed or _blocks) for this module",
                          path=ck.path, tensor=prefix)
    dt = ck.dtype_of(w)
    if dt == "U8":
        return _nvfp4(ck, prefix, w, compressed=False)
    if dt == "F8_E4M3":
        return _fp8_block(ck, prefix)
    if dt not in FLOAT_DTYPES:
        raise FormatError(f"unsupported weight dtype {dt}", path=ck.path, tensor=w)
    stray = [n for s in ("_scale", "_scale_2", "_scale_inv") if ck.has(n := w + s)]
    if stray:
        raise FormatError(f"float weight with quantization scales {stray}", path=ck.path,
                          tensor=w)
    t = ck.tensor(w)
    return QuantWeight(t, FLOAT_DTYPES[dt], tuple(t.shape), source=f"{ck.path}:{w}"), [w]


def _need(ck: HFCheckpoint, name: str, dtype: str, owner: str) -> torch.Tensor:
    if not ck.has(name):
        raise FormatError(f"quantized weight {owner} is missing this scale tensor",
                          path=ck.path, tensor=name)
    if ck.dtype_of(name) != dtype:
        raise FormatError(f"expected dtype {dtype}, got {ck.dtype_of(name)}", path=ck.path,
                          tensor=name)
    return ck.tensor(name)


def _check_method(ck: HFCheckpoint, fmt: str, name: str, want: tuple[str, ...]) -> None:
    got = ck.quant.method if ck.quant else None
    if got not in want:
        raise FormatError(f"{fmt} tensors but the quantization config says {got!r} "
                          f"(expected {' or '.join(want)})", path=ck.path, tensor=name)


def _check_shape(ck: HFCheckpoint, name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise FormatError(f"shape {list(got)} does not fit its weight (expected {list(want)})",
                          path=ck.path, tensor=name)


def _scale2(ck: HFCheckpoint, name: str, s: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """A second-level scale as fp32 [] (one per matrix) or [E] (one per stacked expert)."""
    if s.numel() == 1:
        return s.float().reshape(())
    if len(lead) == 1 and tuple(s.shape) in ((lead[0],), (lead[0], 1)):
        return s.float().reshape(lead)
    raise FormatError(f"shape {list(s.shape)}: expected one value, or one per expert "
                      f"{list(lead)}", path=ck.path, tensor=name)


def _nvfp4(ck: HFCheckpoint, p: str, wname: str, compressed: bool) -> tuple[QuantWeight, list]:
    _check_method(ck, "NVFP4", wname,
                  ("compressed_tensors_nvfp4",) if compressed else ("modelopt_nvfp4",))
    w = ck.tensor(wname)
    if w.dim() < 2:
        raise FormatError(f"NVFP4 weight must be at least 2-D, got {list(w.shape)}",
                          path=ck.path, tensor=wname)
    *lead, n, half = w.shape
    k = 2 * half
    if k % 16:
        raise FormatError(f"NVFP4 input size {k} is not a multiple of 16", path=ck.path,
                          tensor=wname)
    sname = p + ".weight_scale"
    scales = _need(ck, sname, "F8_E4M3", wname)
    _check_shape(ck, sname, scales.shape, (*lead, n, k // 16))
    names = [wname, sname]
    if compressed:
        g = p + ".weight_global_scale"
        gs = _scale2(ck, g, _need(ck, g, "F32", wname), tuple(lead))
        scale2 = 1.0 / gs  # fp32 reciprocal, as llama.cpp's converter computes it
        names.append(g)
        extra = p + ".input_global_scale"
    else:
        s2 = p + ".weight_scale_2"
        scale2 = _scale2(ck, s2, _need(ck, s2, "F32", wname), tuple(lead))
        names.append(s2)
        extra = p + ".input_scale"
    if ck.has(extra):  # activation scale: read for completeness, unused by weight-only math
        names.append(extra)
    qw = QuantWeight(w, "nvfp4", (*lead, n, k), scales, scale2, source=f"{ck.path}:{wname}")
    return qw, names


def _fp8_block(ck: HFCheckpoint, p: str) -> tuple[QuantWeight, list]:
    wname, sname = p + ".weight", p + ".weight_scale_inv"
    _check_method(ck, "FP8", wname, ("fp8_block",))
    w = ck.tensor(wname)
    if not ck.has(sname):
        raise FormatError(f"FP8 weight {wname} is missing this block-scale tensor",
                          path=ck.path, tensor=sname)
    if ck.dtype_of(sname) not in ("F32", "BF16"):
        raise FormatError(f"expected dtype F32, got {ck.dtype_of(sname)}", path=ck.path,
                          tensor=sname)
    s = ck.tensor(sname).float()
    if w.dim() < 2:
        raise FormatError("FP8 weight must be at least 2-D", path=ck.path, tensor=wname)
    b0, b1 = ck.quant.block_size or (128, 128)
    if (b0, b1) != (128, 128):  # QuantWeight's fp8_block layout fixes 128x128 tiles
        raise FormatError(f"FP8 weight_block_size {[b0, b1]} is not supported (only "
                          "[128, 128])", path=ck.quant.source, key="weight_block_size")
    *lead, n, k = w.shape
    _check_shape(ck, sname, s.shape, (*lead, -(-n // b0), -(-k // b1)))
    qw = QuantWeight(w, "fp8_block", tuple(w.shape), s, source=f"{ck.path}:{wname}")
    return qw, [wname, sname]


def _mxfp4(ck: HFCheckpoint, p: str) -> tuple[QuantWeight, list]:
    bname, sname = p + "_blocks", p + "_scales"
    _check_method(ck, "MXFP4", bname, ("mxfp4",))
    if ck.dtype_of(bname) != "U8":
        raise FormatError(f"expected dtype U8, got {ck.dtype_of(bname)}", path=ck.path,
                          tensor=bname)
    b = ck.tensor(bname)
    if b.dim() < 3 or b.shape[-1] != 16:
        raise FormatError(f"MXFP4 blocks must be [..., N, K/32, 16], got {list(b.shape)}",
                          path=ck.path, tensor=bname)
    s = _need(ck, sname, "U8", bname)
    _check_shape(ck, sname, s.shape, tuple(b.shape[:-1]))
    data = b.flatten(-2)  # [..., N, K/2], low nibble first as in MXFP4's QuantWeight layout
    shape = (*b.shape[:-2], b.shape[-2] * 32)
    return QuantWeight(data, "mxfp4", shape, s, source=f"{ck.path}:{bname}"), [bname, sname]


# -- summary for `ft inspect` -------------------------------------------------------------------


def summarize(ck: HFCheckpoint) -> dict:
    """Architecture, parameter count, dtype histogram, quantization and scale presence."""
    params, nbytes, dtypes = 0, 0, Counter()
    for name in ck.tensor_names():
        _, e = ck._entry(name)
        dtypes[e.dtype] += 1
        nbytes += e.end - e.begin
        if name.endswith(AUX_SUFFIXES):
            continue
        packed = e.dtype == "U8" and weight_prefix(name) is not None
        params += math.prod(e.shape) * (2 if packed else 1)
    cfg = ck.config
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return {
        "format": "safetensors",
        "architecture": ck.architecture,
        "model_type": ck.model_type,
        "tensors": len(ck.tensor_names()),
        "parameters": params,
        "bytes": nbytes,
        "dtypes": dict(sorted(dtypes.items())),
        "quantization": ck.quant.method if ck.quant else None,
        "exclude_modules": list(ck.quant.exclude) if ck.quant else [],
        "second_level_scales": sorted(n.rsplit(".", 1)[0] for n in ck.tensor_names()
                                      if n.endswith((".weight_scale_2", ".weight_global_scale"))),
        "context_length": cfg.get("max_position_embeddings", text.get("max_position_embeddings")),
        "vocab_size": cfg.get("vocab_size", text.get("vocab_size")),
        "chat_template": _has_chat_template(ck),
    }


def _has_chat_template(ck: HFCheckpoint) -> bool:
    if (ck.path / "chat_template.jinja").is_file() or (ck.path / "chat_template.json").is_file():
        return True
    tc = ck.path / "tokenizer_config.json"
    try:
        import json

        return bool(json.loads(tc.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False
