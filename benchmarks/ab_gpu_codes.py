"""A/B of the int8 decode GEMVs reading activation codes made by their producer
(`freetoken/kernels/xq.py`) against quantizing in every program, on the GPU.

    python benchmarks/ab_gpu_codes.py

Each timed call cycles over 16 weights (dense) or 16 expert sets (MoE) inside one CUDA graph,
so the weights come from HBM, not from the 50 MB L2 that one replayed weight would sit in.
Rows: the RMSNorm with and without writing codes; dense GEMVs (Qwen3-30B-A3B qkv / o_proj
shapes) at 1 and 4 tokens, own quantization against the norm's codes; one MoE layer (the
30B shape 128 x 2048 x 768 in Q4_K and NVFP4, the Qwen3.6-35B-A3B shape 256 x 2048 x 512
NVFP4, top-8) with own quantization, with the norm's codes, with gate/up writing the GLU output
as codes for down (`quant_a`), and with the down-and-sum kernel forced on or off.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_gpu_kernels import make_weight, random_bank  # noqa: E402
from freetoken import kernels  # noqa: E402
from freetoken.kernels import xq  # noqa: E402
from freetoken.kernels.triton.linear import triton_linear  # noqa: E402
from freetoken.kernels.triton.moe import fused_moe_triton  # noqa: E402

SETS = 16  # weights / expert sets cycled per replay


def graph_us(fns, reps: int = 5) -> float:
    """Median µs per call of `fns`, each called twice in turn inside one CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (2 * len(fns)))
    return statistics.median(times)


def normed(t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm output carrying its codes, a copy without them)."""
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    y = kernels.rms_norm(x, torch.rand(k, device="cuda") + 0.5, 1e-6, quantize=True)
    if xq.attached(y) is None:
        raise SystemExit("the norm wrote no codes (FREETOKEN_GPU_INT8_DOT=0?)")
    return y, y.clone()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ab_gpu_codes.py needs a CUDA GPU")
    w = torch.rand(2048, device="cuda") + 0.5
    print(f"{'case':<44} {'us':>8}")
    for t in (1, 4):
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        for q in (False, True):
            us = graph_us([lambda q=q, x=x: kernels.rms_norm(x, w, 1e-6, quantize=q)] * SETS)
            print(f"{f'rms_norm 2048, {t} tokens, codes={q}':<44} {us:8.2f}")
    for fmt in ("Q4_K", "nvfp4", "Q8_0s"):
        for name, n, k in (("qkv", 5120, 2048), ("o_proj", 2048, 4096)):
            ws = [make_weight(fmt, (n, k)) for _ in range(SETS)]
            for t in (1, 4) if fmt != "Q8_0s" else (1,):
                with_codes, plain = normed(t, k)
                for label, x in (("own", plain), ("codes", with_codes)):
                    us = graph_us([lambda qw=qw, x=x: triton_linear(x, qw) for qw in ws])
                    print(f"{f'{fmt} {name} {n}x{k}, {t} tokens, {label}':<44} {us:8.2f}")
    variants = (("own", False, False, None), ("codes", True, False, None),
                ("own + quant_a", False, True, None), ("codes + quant_a", True, True, None),
                ("codes + quant_a, down_sum", True, True, True),
                ("codes + quant_a, per-route down", True, True, False))
    for fmt, e, inter in (("Q4_K", 128, 768), ("nvfp4", 128, 768), ("nvfp4", 256, 512)):
        bank = random_bank(fmt, e, 2048, inter)
        for t in (1, 4, 16):
            ids = [torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(t)])
                   for _ in range(SETS)]
            rw = torch.softmax(torch.randn(t, 8, device="cuda"), -1)
            with_codes, plain = normed(t, 2048)
            for label, codes, qa, ds in variants:
                x = with_codes if codes else plain
                us = graph_us([lambda i=i, x=x, qa=qa, ds=ds, b=bank, r=rw: fused_moe_triton(
                    x, b, i, r, "silu", quant_a=qa, down_sum=ds) for i in ids])
                print(f"{f'MoE {fmt} {e}x2048x{inter}, {t} tok, {label}':<44} {us:8.2f}")


if __name__ == "__main__":
    main()
