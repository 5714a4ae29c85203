"""Which weight formats the Triton kernels decode, as ids, and the load-time repack of weights
placed on CUDA (no triton import: the loader and the CPU path ask `format_id` too)."""

from __future__ import annotations

import torch

from freetoken.formats.qweight import QuantWeight

# Format ids. Float formats read `data` in its own dtype; the rest read bytes.
F_FLOAT = 0
F_NVFP4 = 1  # ModelOpt layout (GGUF NVFP4 is repacked into it at load)
F_MXFP4 = 2  # HF / gpt-oss: E2M1 codes + E8M0 scales [N, K/32]
F_FP8_BLOCK = 3  # E4M3 + fp32 scale per 128x128 block
F_Q4_0, F_Q4_1, F_Q8_0 = 10, 11, 12
F_Q4_K, F_Q5_K, F_Q6_K = 13, 14, 15
F_GGUF_MXFP4, F_GGUF_NVFP4 = 16, 17
F_Q8_0_SPLIT = 18  # Q8_0 split at load on CUDA (`split_q8_0`)

# ggml type number -> (format id, block values, block bytes)
GGUF_FORMATS = {2: (F_Q4_0, 32, 18), 3: (F_Q4_1, 32, 20), 8: (F_Q8_0, 32, 34),
                12: (F_Q4_K, 256, 144), 13: (F_Q5_K, 256, 176), 14: (F_Q6_K, 256, 210),
                39: (F_GGUF_MXFP4, 32, 17), 40: (F_GGUF_NVFP4, 64, 36)}
PLAIN_FORMATS = {"nvfp4": F_NVFP4, "mxfp4": F_MXFP4, "fp8_block": F_FP8_BLOCK}
Q8_0 = 8  # ggml type number


def is_split_q8_0(qw: QuantWeight) -> bool:
    """A Q8_0 weight in the split layout (GGUF weights otherwise carry no `scales`)."""
    return qw.fmt == "gguf" and qw.ggml_type == Q8_0 and qw.scales is not None


def format_id(qw: QuantWeight) -> int | None:
    """The kernels' id of a weight's format, or None when no kernel decodes it."""
    if qw.is_float:
        return F_FLOAT
    if qw.fmt == "gguf":
        if is_split_q8_0(qw):
            return F_Q8_0_SPLIT
        entry = GGUF_FORMATS.get(int(qw.ggml_type))
        return None if entry is None else entry[0]
    return PLAIN_FORMATS.get(qw.fmt)


def split_q8_0(qw: QuantWeight) -> QuantWeight:
    """Q8_0 blocks (f16 d, then 32 int8 codes: 34 bytes) -> the split layout: `data` the int8
    codes [..., N, K], `scales` the f16 d [..., N, K/32]; the same bytes, moved. A 34-byte block
    is only 2-byte aligned, so a GEMV read it in short loads (1.1-1.6 TB/s on the H200); split,
    each row's codes are one aligned run for 16-byte vector loads. Values are unchanged: `q * d`
    from the same q and d (tests/kernels/test_triton_split_q8_0.py)."""
    if qw.fmt != "gguf" or qw.ggml_type != Q8_0 or qw.scales is not None:
        raise ValueError(f"{qw.source or 'weight'}: split_q8_0 takes Q8_0 blocks, got {qw.fmt} "
                         f"(ggml type {qw.ggml_type}, scales {qw.scales is not None})")
    *lead, n, k = qw.shape
    blocks = qw.data.reshape(*lead, n, k // 32, 34)
    codes = blocks[..., 2:].reshape(*lead, n, k).view(torch.int8)  # reshape copies
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(*lead, n, k // 32)
    return QuantWeight(codes, "gguf", tuple(qw.shape), scales=d, scale2=qw.scale2,
                       ggml_type=Q8_0, source=qw.source)


def device_layout(qw: QuantWeight, dtype: torch.dtype) -> QuantWeight:
    """A weight as the GPU kernels read it, for the loader to call where it places a weight:
    on CUDA, Q8_0 is split (`split_q8_0`) and a format no kernel decodes is dequantized once to
    `dtype` (`kernels.linear.dequantize_at_load`, logged; the torch codecs cannot run inside a
    CUDA graph); every other weight, and every CPU weight (the C++ executor reads GGUF blocks
    as stored), comes back as it is."""
    if not qw.data.is_cuda:
        return qw
    if qw.fmt == "gguf" and qw.ggml_type == Q8_0 and qw.scales is None:
        return split_q8_0(qw)
    if format_id(qw) is None:
        from freetoken.kernels.linear import dequantize_at_load  # lazy: a sibling module

        return dequantize_at_load(qw, dtype)
    return qw
