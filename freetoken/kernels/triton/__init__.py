"""Triton GPU kernels behind the entry points of `freetoken.kernels` (chosen when x.is_cuda).

- `quant.py`: one @triton.jit decode per weight format, returning an fp32 [BLOCK_N, BLOCK_K]
  tile whose values equal the `freetoken.formats` codecs bit for bit;
- `linear.py`: quantized linear (GEMV for decode, tl.dot tiles for prefill) and embedding;
- `moe.py`: fused MoE over a bank or a pool of slots (`expert_map`), two kernels per layer.

Importing this package needs triton; `freetoken.kernels` imports it lazily, on CUDA tensors only.
"""
