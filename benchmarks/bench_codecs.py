"""Speed of the torch GGUF codecs (`dequantize_gguf`) next to a memory-copy ceiling.

For each type the three packaged models use (plus F16/BF16, MXFP4, NVFP4) and one matrix
(2048x2048 by default): ms per dequantize (best of `--reps`, the box is shared), GB/s of fp32
output written, and that speed as a fraction of the ceiling: a plain `out.copy_(src)` of fp32
tensors of the same size, measured in the same run (reads and writes as many output bytes as
the codec writes, plus its own read of the same size).

Blocks are random bytes whose scale fields are overwritten with sane values (normal f16 /
E8M0 near 1), so no NaN / inf / subnormal arithmetic skews the timing.

    python benchmarks/bench_codecs.py [--rows 2048] [--cols 2048] [--reps 20] [--threads 1]
                                      [--types Q4_0,Q8_0]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken.formats.codecs import dequantize_gguf

T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
         T.F16, T.BF16, T.MXFP4, T.NVFP4]
# Byte ranges of each block holding f16 scales (d, and dmin where there is one).
F16_SCALES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q8_0: [0], T.Q4_K: [0, 2],
              T.Q5_K: [0, 2], T.Q6_K: [208]}


def make_blocks(qtype: GGMLQuantizationType, numel: int, seed: int = 0) -> torch.Tensor:
    """uint8 [nblocks * type_size] of random blocks with well-behaved scales."""
    g = torch.Generator().manual_seed(seed)
    if qtype in (T.F16, T.BF16):
        dt = torch.float16 if qtype == T.F16 else torch.bfloat16
        return torch.randn(numel, generator=g).to(dt).view(torch.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    b = torch.randint(0, 256, (numel // block, size), dtype=torch.uint8, generator=g)
    for off in F16_SCALES.get(qtype, []):
        d = (torch.rand(b.shape[0], generator=g) * 0.01 + 0.001).half()
        b[:, off : off + 2] = d.view(torch.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # E8M0 exponent byte: 2**(e - 127), near 1
        b[:, 0] = torch.randint(120, 130, (b.shape[0],), dtype=torch.uint8, generator=g)
    if qtype == T.NVFP4:  # four UE4M3 sub-block scales: keep them below 0x7F (NaN-free)
        b[:, :4] &= 0x7E
    return b.reshape(-1)


def best_ms(fn, reps: int) -> float:
    fn()  # warm-up: first-touch allocation, caches
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def ceiling_ms(numel: int, reps: int) -> float:
    """A fresh fp32 output filled from an fp32 source: what any codec must at least pay."""
    src = torch.randn(numel)
    return best_ms(lambda: torch.empty(numel).copy_(src), reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--types", default=",".join(t.name for t in TYPES))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = (args.rows, args.cols)
    numel = args.rows * args.cols
    gb = numel * 4 / 1e9  # fp32 bytes written
    ceil = ceiling_ms(numel, args.reps)
    print(f"{args.rows}x{args.cols}, {args.threads} thread(s), best of {args.reps}")
    print(f"{'ceiling copy_':10s} {ceil:8.2f} ms {gb / ceil * 1e3:7.2f} GB/s")
    print(f"{'type':10s} {'ms':>8s}    {'GB/s':>7s}      {'x ceiling':>9s}")
    for name in args.types.split(","):
        qtype = T[name.strip()]
        raw = make_blocks(qtype, numel)
        ms = best_ms(lambda r=raw, q=int(qtype): dequantize_gguf(r, q, shape), args.reps)
        print(f"{qtype.name:10s} {ms:8.2f} ms {gb / ms * 1e3:7.2f} GB/s {ms / ceil:8.1f}x")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
