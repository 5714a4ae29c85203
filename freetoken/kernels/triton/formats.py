"""Which weight formats the Triton kernels decode, as ids (no triton import: the loader and
the CPU path ask `format_id` too)."""

from __future__ import annotations

from freetoken.formats.qweight import QuantWeight

# Format ids. Float formats read `data` in its own dtype; the rest read bytes.
F_FLOAT = 0
F_NVFP4 = 1  # ModelOpt layout (GGUF NVFP4 is repacked into it at load)
F_MXFP4 = 2  # HF / gpt-oss: E2M1 codes + E8M0 scales [N, K/32]
F_FP8_BLOCK = 3  # E4M3 + fp32 scale per 128x128 block
F_Q4_0, F_Q4_1, F_Q8_0 = 10, 11, 12
F_Q4_K, F_Q5_K, F_Q6_K = 13, 14, 15
F_GGUF_MXFP4, F_GGUF_NVFP4 = 16, 17

# ggml type number -> (format id, block values, block bytes)
GGUF_FORMATS = {2: (F_Q4_0, 32, 18), 3: (F_Q4_1, 32, 20), 8: (F_Q8_0, 32, 34),
                12: (F_Q4_K, 256, 144), 13: (F_Q5_K, 256, 176), 14: (F_Q6_K, 256, 210),
                39: (F_GGUF_MXFP4, 32, 17), 40: (F_GGUF_NVFP4, 64, 36)}
PLAIN_FORMATS = {"nvfp4": F_NVFP4, "mxfp4": F_MXFP4, "fp8_block": F_FP8_BLOCK}


def format_id(qw: QuantWeight) -> int | None:
    """The kernels' id of a weight's format, or None when no kernel decodes it."""
    if qw.is_float:
        return F_FLOAT
    if qw.fmt == "gguf":
        entry = GGUF_FORMATS.get(int(qw.ggml_type))
        return None if entry is None else entry[0]
    return PLAIN_FORMATS.get(qw.fmt)
