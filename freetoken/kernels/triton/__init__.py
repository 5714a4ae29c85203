"""Triton GPU kernels behind the entry points of `freetoken.kernels` (chosen when x.is_cuda).

- `quant.py`: one @triton.jit decode per weight format, returning an fp32 [BLOCK_N, BLOCK_K]
  tile whose values equal the `freetoken.formats` codecs bit for bit;
- `linear.py`: quantized linear (GEMV for decode, tl.dot tiles for prefill) and embedding;
- `moe.py`: fused MoE over a bank or a pool of slots (`expert_map`), two kernels per layer.

Importing this package needs triton; `freetoken.kernels` imports it lazily, on CUDA tensors only.
"""

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1): no inline PTX,
    no Python loop over a device value."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true")
