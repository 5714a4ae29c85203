"""The CPU executor on dense GGUF linears: T = 1 dot and row decode speed per format.

    python benchmarks/bench_cpu_dense_formats.py [--threads 2] [--isa avx512_vnni] [--reps 7]

Per format, on random valid blocks (fp16 scales of 0.001-0.02, MXFP4 exponents near 2^-5 to
2^5: denormal products would time the microcode, not the kernel), two weights of
qwen2.5-coder-0.5b's shapes: gate_up [4864, 896] (2-4 MB, in cache between calls on a large L2
/ L3) and lm_head [151936, 896] (from DRAM); K = 1024 for the K-quants (896 is not a multiple
of 256). Printed: the median over `reps` rounds of
  dot  GB/s of weight bytes of Executor::dot at T = 1 (the C++ timing loop, activation quant
       included) and of `CpuMoeExecutor.expert_matmul` (each call from Python);
  deq  GB/s of fp32 output of `dequant_rows` over an 8192-row tile (the prefill path's decode)
       into a reused buffer, and into a new tensor each call (its page faults included).
The streaming-read ceiling of the same threads is printed first: compare shares of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.moe.cpu_executor import CpuMoeExecutor, make_bank

Q = gguf.GGMLQuantizationType
FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "Q4_K", "Q5_K", "Q6_K"]
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "MXFP4": []}


def weight(name: str, N: int, K: int, rng: np.random.Generator) -> QuantWeight:
    qt = Q[name]
    bs, bb = gguf.GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (N, K // bs, bb), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        d = (rng.random((N, K // bs)) * 0.02 + 1e-3).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(N, K // bs, 2)
    if name == "MXFP4":
        raw[..., 0] = rng.integers(122, 134, (N, K // bs))
    return QuantWeight(torch.from_numpy(raw.reshape(1, N, -1)), "gguf", (1, N, K),
                       ggml_type=int(qt))


def median_rate(fn, nbytes: int, iters: int, reps: int) -> float:
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rates.append(nbytes * iters / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


def bench_one(ex: CpuMoeExecutor, w: QuantWeight, threads: int, reps: int) -> str:
    _, N, K = w.shape
    bank, nbytes = make_bank(w, "w"), w.data.numel()
    x = torch.randn(1, K)
    iters = max(3, int(3e8 // nbytes))
    ex._ex.time_dot(bank, 0, x.data_ptr(), 2, threads)
    cpp = statistics.median(
        nbytes * iters / ex._ex.time_dot(bank, 0, x.data_ptr(), iters, threads) / 1e9
        for _ in range(reps))
    py = median_rate(lambda: ex.expert_matmul(w, 0, x, threads=threads), nbytes, iters, reps)
    rows = min(N, 8192)
    out = torch.empty(rows, K).zero_()
    deq = median_rate(lambda: ex.dequant_rows(w, 0, 0, rows, out=out), rows * K * 4, 5, reps)
    new = median_rate(lambda: ex.dequant_rows(w, 0, 0, rows), rows * K * 4, 5, reps)
    name = gguf.GGMLQuantizationType(w.ggml_type).name
    return (f"{name:6s} [{N:6d}, {K:4d}] {nbytes / 1e6:6.1f} MB   dot {cpp:5.1f} GB/s "
            f"(expert_matmul {py:5.1f})   deq {deq:5.1f} GB/s out (new tensor {new:5.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default=None, help="a tier name (default: the best this CPU has)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    ex = CpuMoeExecutor(args.threads, isa=args.isa)
    rng = np.random.default_rng(0)
    buf = torch.empty(1 << 28, dtype=torch.uint8).fill_(1)
    secs, n = ex._ex.time_stream(buf.data_ptr(), buf.numel(), 4, args.threads, 4096, 16384)
    print(f"{ex.isa}, {args.threads} threads: streaming read {n / secs / 1e9:.1f} GB/s")
    del buf
    for name in args.formats.split(","):
        K = 1024 if gguf.GGML_QUANT_SIZES[Q[name]][0] == 256 else 896
        for N in (4864, 151936):
            print(bench_one(ex, weight(name, N, K, rng), args.threads, args.reps), flush=True)

if __name__ == "__main__":
    main()
