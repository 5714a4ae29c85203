"""GB/s of the Triton quantized kernels per format and shape, next to the HBM copy bandwidth.

    python benchmarks/bench_gpu_kernels.py [--formats nvfp4,Q4_K] [--moe-tokens 1,16,512]
        [--sweep nvfp4,Q4_K]   # first: GB/s per tile choice at 1, 16 and 512 tokens
    python benchmarks/bench_gpu_kernels.py --moe-grouped   # the MoE at 4-16 tokens: per-route
        # int8 GEMVs against the int8 grouped kernels (moe.GROUPED_TOKENS, GROUP_I8_TILES)
    python benchmarks/bench_gpu_kernels.py --moe-mma   # the Q4_K MoE at 2-16 tokens: per-route
        # int8 GEMVs against the int8 tensor-core kernels (moe_mma.py), weights from HBM
    python benchmarks/bench_gpu_kernels.py --moe-routes   # the per-route MoE: bound by its
        # routes or by the distinct experts' bytes
    python benchmarks/bench_gpu_kernels.py --moe-switch FREETOKEN_GPU_MOE_MAXNREG=0,128,96
        # the per-route MoE under each value of a switch (tiles, register caps), from HBM
    python benchmarks/bench_gpu_kernels.py --attention   # decode attention's split-K merge,
        # and the q/k norm, rotary and KV store in its launch against a launch of their own

`Q8_0s` is Q8_0 split as the loader places dense Q8_0 weights on CUDA (int8 codes and f16 block
scales apart: `freetoken.kernels.triton.formats.split_q8_0`); `Q8_0` the blocks as stored.
Shapes are Qwen3-30B-A3B's (FACTS.md): dense qkv 5120x2048, o_proj 2048x4096, lm_head
151936x2048; MoE 128 experts, hidden 2048, FFN 768, top-8. Bytes are the weight bytes a call
must read (MoE: the distinct experts the routes touch). Each call is timed eagerly and replayed
from a CUDA graph (the way decode runs), median of several runs; "% HBM" is the graph figure
over the copy bandwidth (read + write) measured at the start.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.kernels.linear import linear
from freetoken.kernels.moe import fused_moe
from freetoken.kernels.triton.formats import split_q8_0
from freetoken.moe.banks import ExpertBank

GGUF = {"Q4_0": (2, 32, 18, (0,)), "Q8_0": (8, 32, 34, (0,)), "Q8_0s": (8, 32, 34, (0,)),
        "Q4_K": (12, 256, 144, (0, 2)), "Q5_K": (13, 256, 176, (0, 2)),
        "Q6_K": (14, 256, 210, (208,)), "MXFP4": (39, 32, 17, ())}
DENSE = [("qkv", 5120, 2048), ("o_proj", 2048, 4096), ("lm_head", 151936, 2048)]


def _u8(shape, lo=0, hi=256) -> torch.Tensor:
    return torch.randint(lo, hi, shape, dtype=torch.uint8, device="cuda")


def make_weight(fmt: str, shape: tuple[int, ...]) -> QuantWeight:
    """Random weight with finite values, made on the device."""
    *lead, n, k = shape
    if fmt == "bf16":
        return QuantWeight(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02,
                           "bf16", shape)
    if fmt == "nvfp4":
        s = _u8((*lead, n, k // 16), 0x20, 0x40).view(torch.float8_e4m3fn)
        return QuantWeight(_u8((*lead, n, k // 2)), "nvfp4", shape, scales=s)
    if fmt == "mxfp4":
        return QuantWeight(_u8((*lead, n, k // 2)), "mxfp4", shape,
                           scales=_u8((*lead, n, k // 32), 118, 128))
    if fmt == "fp8_block":
        s = torch.rand(*lead, -(-n // 128), k // 128, device="cuda") * 0.01
        return QuantWeight(_u8(shape, 0, 0x70).view(torch.float8_e4m3fn), "fp8_block", shape,
                           scales=s)
    t, block, size, f16_at = GGUF[fmt]
    data = _u8((*lead, n, k // block, size))
    for at in f16_at:
        data[..., at + 1] = _u8((*lead, n, k // block), 0x20, 0x30)
    if fmt == "MXFP4":
        data[..., 0] = _u8((*lead, n, k // block), 120, 130)
    qw = QuantWeight(data.reshape(*lead, n, -1), "gguf", shape, ggml_type=t)
    return split_q8_0(qw) if fmt == "Q8_0s" else qw


def random_bank(fmt: str, e: int = 128, h: int = 2048, inter: int = 768) -> ExpertBank:
    """A random MoE bank (make_weight's gate/up [e, 2 inter, h] and down [e, h, inter], scales
    in [0.5, 1.5)), made on the device."""
    return ExpertBank(make_weight(fmt, (e, 2 * inter, h)), make_weight(fmt, (e, h, inter)),
                      torch.rand(e, 4, device="cuda") + 0.5)


def _median_ms(fn, reps: int = 5, calls: int = 20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(calls)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def time_call(fn) -> tuple[float, float | None]:
    """(eager ms, CUDA-graph ms) per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    eager = _median_ms(lambda c: [fn() for _ in range(c)])
    try:
        graph = graph_ms(fn)
    except Exception as e:  # noqa: BLE001 - reported, the eager figure still stands
        print(f"  (graph capture failed: {type(e).__name__}: {e})")
        graph = None
    return eager, graph


def graph_ms(fn, calls: int = 20) -> float:
    """ms per call of fn, `calls` of them captured in one CUDA graph, its replays timed."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g, stream=s):
            for _ in range(calls):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    return _median_ms(lambda c: [g.replay() for _ in range(c // calls)], calls=calls)


def hbm_copy_gbs(nbytes: int = 1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _median_ms(lambda c: [b.copy_(a) for _ in range(c)], calls=10)
    return 2 * nbytes / ms / 1e6


def _row(name, fmt, tokens, nbytes, flops, eager, graph, hbm) -> None:
    best = graph if graph is not None else eager
    gbs = nbytes / best / 1e6
    tf = flops / best / 1e9
    gtxt = f"{graph * 1e3:9.1f}" if graph is not None else "      n/a"
    print(f"{name:10s} {fmt:9s} {tokens:6d} {nbytes / 1e6:9.2f} {eager * 1e3:9.1f} {gtxt} "
          f"{gbs:8.0f} {100 * gbs / hbm:6.1f} {tf:7.1f}")


def bench_dense(fmt: str, tokens: list[int], hbm: float) -> None:
    for name, n, k in DENSE:
        qw = make_weight(fmt, (n, k))
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            eager, graph = time_call(lambda x=x, qw=qw: linear(x, qw))
            _row(name, fmt, m, qw.nbytes(), 2 * m * n * k, eager, graph, hbm)


def bench_moe(fmt: str, tokens: list[int], hbm: float, e: int = 128, h: int = 2048,
              inter: int = 768, topk: int = 8) -> None:
    bank = random_bank(fmt, e, h, inter)
    per_expert = (bank.w13.nbytes() + bank.w2.nbytes()) / e
    emap = torch.arange(e, dtype=torch.int32, device="cuda")  # the slot indirection, identity
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        ids = routing(t, e, topk)
        w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
        touched = int(torch.unique(ids).numel())
        eager, graph = time_call(
            lambda x=x, ids=ids, w=w: fused_moe(x, bank, ids, w, "silu", emap))
        _row("moe", fmt, t, touched * per_expert, 6 * t * topk * h * inter, eager, graph, hbm)


GEMV_TILES = [(2, 256, 1), (4, 256, 2), (4, 256, 4), (8, 256, 4), (16, 256, 4), (8, 512, 4),
              (16, 256, 8), (32, 256, 8),
              # wide chunks (not Q4_K / Q6_K, whose dot takes one super-block): a program's
              # loads of a whole row pair go out together instead of one chunk per round trip
              (1, 1024, 1), (2, 512, 1), (2, 1024, 1), (2, 1024, 2), (2, 2048, 2), (4, 1024, 2),
              (4, 2048, 4), (8, 2048, 4)]
# (BN, BK, num_warps) of the int8-dot GEMV (gemv_i8.py: NVFP4, Q4_K, split Q8_0 at one token,
# bf16 x; FREETOKEN_GPU_INT8_DOT=0 sweeps the fp32 GEMV's GEMV_TILES instead): x is quantized
# per program, so more rows per program share that work
I8_TILES = [(2, 1024, 1), (4, 512, 2), (4, 1024, 2), (4, 2048, 4), (8, 256, 4), (8, 512, 4),
            (8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (16, 512, 4), (16, 1024, 4),
            (16, 1024, 8), (16, 2048, 8), (32, 512, 8)]
# (BN, BK, num_warps) of the fused MoE's per-route int8 GEMVs at 2-16 tokens (the tiles
# FREETOKEN_GPU_MOE_ROUTE_TILES sets end to end): wider row blocks, fewer programs per route
I8_ROUTE_TILES = [(16, 1024, 4), (16, 1024, 8), (32, 1024, 4), (32, 1024, 8), (64, 1024, 4),
                  (64, 1024, 8), (32, 512, 4), (64, 512, 8), (128, 1024, 8)]
# (form, tiles) of the tensor-core MoE kernels timed by --moe-mma: the int8 form's (BN,
# num_warps, unroll), the fp16 form's (BN, num_warps)
MMA_SWEEP = [("i8", (32, 4, True)), ("f16", (64, 4)), ("f16", (128, 4)), ("f16", (128, 8))]
# (BN, BK, num_warps) of split Q8_0's GEMV: its rows are aligned int8 runs, wide chunks pay
SPLIT_TILES = [(4, 1024, 4), (8, 1024, 4), (8, 1024, 8), (8, 2048, 8), (4, 2048, 4),
               (16, 2048, 8), (2, 2048, 4)]
# (BM, BN, BK, num_warps) for 16 and 512 tokens; BK 0 = the format's (256 for Q4_K, else 128)
DOT_TILES = {16: [(16, 16, 0, 4), (16, 32, 0, 4), (16, 64, 0, 4), (16, 32, 0, 8), (16, 32, 0, 2)],
             # prefill (more than 128 tokens); at 512 tokens top-8 over 128 experts an expert
             # has 32 routes on average, so BM = 32 pads its block less than 64
             512: [(64, 64, 0, 4), (64, 64, 0, 8), (128, 64, 0, 8), (64, 128, 0, 8),
                   (128, 128, 0, 8), (32, 64, 0, 4), (32, 128, 0, 4), (32, 128, 0, 8),
                   (64, 128, 0, 4), (64, 256, 0, 8), (32, 256, 0, 8), (64, 64, 256, 4),
                   (32, 128, 256, 4), (32, 64, 64, 4)]}


def _i8(fmt: str) -> bool:
    """Whether one-token calls of this format take the int8-dot GEMV (bf16 x)."""
    from freetoken import env

    return fmt in ("nvfp4", "Q4_K", "Q8_0s") and env.gpu_int8_dot()


def _race(choices, run, base: float, base_label: str):
    """Each choice c timed as run(c) (graph replays, else eager): ([(c, seconds or None, the
    error's name for a choice that failed)], the fastest (seconds, label), base included)."""
    rows, best = [], (base, base_label)
    for c in choices:
        try:
            eager, graph = time_call(lambda c=c: run(c))
        except Exception as ex:  # noqa: BLE001 - a choice that does not apply ends no table
            rows.append((c, None, type(ex).__name__))
            continue
        rows.append((c, graph or eager, None))
        best = min(best, (graph or eager, str(c)))
    return rows, best


def _try(label: str, fn, nbytes: float, flops: float) -> str:
    try:
        eager, graph = time_call(fn)
        g = graph or eager
    except Exception as e:  # noqa: BLE001 - one failing tile choice must not end the sweep
        return f"{label} failed: {type(e).__name__}: {str(e)[:80]}"
    return f"{label} {nbytes / g / 1e6:5.0f} GB/s {flops / g / 1e9:5.1f} TF/s {g * 1e3:7.1f} us"


def sweep(fmt: str, hbm: float, tokens: tuple[int, ...] = (1, 16, 512), e: int = 128,
          inter: int = 768) -> None:
    """Tile choices: dense o_proj / qkv and a MoE layer (e experts, hidden 2048, FFN inter,
    top-8) at 1, 16 and 512 tokens."""
    from freetoken.kernels.triton.linear import triton_linear
    from freetoken.kernels.triton.moe import fused_moe_triton

    h, topk = 2048, 8
    bank = random_bank(fmt, e, h, inter)
    per_expert = (bank.w13.nbytes() + bank.w2.nbytes()) / e
    dense = [(n, k, make_weight(fmt, (n, k))) for _, n, k in DENSE[:2]]
    fbk = 256 if fmt in ("Q4_K", "Q6_K") else 128
    gemv_tiles = I8_TILES if _i8(fmt) else GEMV_TILES
    for m in tokens:
        tiles = [(1, bn, bk, w) for bn, bk, w in gemv_tiles] if m == 1 else \
            [(bm, bn, bk or fbk, w) for bm, bn, bk, w in DOT_TILES[512 if m > 128 else 16]]
        if 1 < m <= 4 and _i8(fmt):  # the int8 GEMV once per token
            tiles += [(1, bn, bk, w) for bn, bk, w in I8_TILES if bk >= 1024]
        if m == 16:
            tiles += [(1, bn, bk, w) for bn, bk, w in GEMV_TILES[2:5]]  # per-route MoE
        if 1 < m <= 16 and _i8(fmt):
            tiles += [(1, bn, bk, w) for bn, bk, w in I8_ROUTE_TILES]
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k, _ in dense}
        ids = routing(m, e, topk)
        w = torch.softmax(torch.randn(m, topk, device="cuda"), -1)
        xm = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        moe_bytes = int(torch.unique(ids).numel()) * per_expert
        for t in tiles:
            if fmt in ("Q4_K", "Q6_K") and \
                    (t[2] % 256 if t[0] == 1 and _i8(fmt) else t[2] != 256):
                continue
            cells = []
            if t[0] != 1 or m == 1 or (m <= 4 and _i8(fmt)):
                for n, k, qw in dense:
                    cells.append(_try(f"{n}x{k}", lambda x=xs[k], qw=qw, t=t:
                                      triton_linear(x, qw, t), qw.nbytes(), 2 * m * n * k))
            moe = (xm, bank, ids, w, "silu", None, t)
            cells.append(_try("moe", lambda a=moe: fused_moe_triton(*a), moe_bytes,
                              6 * m * topk * h * inter))
            print(f"sweep {fmt:6s} m={m:3d} tiles={t}: " + " | ".join(cells), flush=True)
    print(f"(HBM copy {hbm:.0f} GB/s)")


def sweep_split(hbm: float) -> None:
    """Split Q8_0 (dense only): GEMV tiles at one token, tl.dot tiles at 4 and 16."""
    from freetoken.kernels.triton.linear import triton_linear

    for name, n, k in DENSE:
        qw = make_weight("Q8_0s", (n, k))
        for m in (1, 4, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gemv_tiles = I8_TILES if _i8("Q8_0s") else SPLIT_TILES
            tiles = [(1, bn, bk, w) for bn, bk, w in gemv_tiles] if m == 1 else \
                [(bm, bn, 256, w) for bm, bn, _, w in DOT_TILES[16]]
            if m == 4 and _i8("Q8_0s"):  # the int8 GEMV once per token
                tiles += [(1, bn, bk, w) for bn, bk, w in I8_TILES if bk >= 1024]
            cells = [_try(f"{t}", lambda a=(x, qw, t): triton_linear(*a), qw.nbytes(),
                          2 * m * n * k) for t in tiles]
            print(f"sweep Q8_0s {name} m={m:2d}:\n  " + "\n  ".join(cells), flush=True)
    print(f"(HBM copy {hbm:.0f} GB/s)")


# (BN, BK, num_warps) of the int8 GEMV taking several tokens a program (linear._i8_tokens):
# the four best of eight on the H200's NVFP4 qkv at 2-16 tokens (2026-12-04; 4 rows, or 2
# rows and 2 warps, lost 5-45% everywhere); each is a compile per token count and K, and
# eight took the whole 90 s of a run for one format
MT_TILES = [(8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (16, 2048, 8)]
# the dense decode linears of Qwen3-30B-A3B (qkv, o_proj) and Qwen3.6-35B-A3B's GDN layers
# (in_proj_qkvz 12288 x 2048, out_proj 2048 x 4096)
MT_SHAPES = [("qkv", 5120, 2048), ("o_proj", 2048, 4096), ("qkvz", 12288, 2048)]


def bench_linear_mt(formats: list[str], tokens: tuple[int, ...] = (2, 4, 8, 16)) -> None:
    """Dense linears at 2-16 tokens: today's choice (`triton_linear` without tiles: the
    one-token int8 GEMV once per token, or tl.dot tiles) against the int8 GEMV taking MT
    tokens a program (tiles (1, BN, BK, warps, MT), MT the tokens' power of two, at most
    linear.I8_MT_MAX), graph-replayed us and the ratio to today's; the line per shape and
    token count names the best. Decides linear.I8_MULTI_TOKENS and I8_MULTI_TILES."""
    import os

    from freetoken.kernels.triton import linear
    from freetoken.kernels.triton.linear import triton_linear

    os.environ["FREETOKEN_GPU_LINEAR_MT"] = "0"  # today's choice where tiles are not given
    for fmt in formats:
        for name, n, k in MT_SHAPES:
            qw = make_weight(fmt, (n, k))
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                mt = min(linear.I8_MT_MAX, 1 << (m - 1).bit_length())
                base = time_call(lambda x=x, qw=qw: triton_linear(x, qw))
                base = base[1] or base[0]
                rows, best = _race([(1, bn, bk, w, mt) for bn, bk, w in MT_TILES],
                                   lambda t, x=x, qw=qw: triton_linear(x, qw, t), base, "today")
                cells = [f"{t[1:4]} failed: {why}" if g is None else
                         f"{t[1:4]} {g * 1e3:6.1f} us ({base / g:4.2f}x)" for t, g, why in rows]
                print(f"mt {fmt:6s} {name:6s} {n}x{k} m={m:2d} today {base * 1e3:6.1f} us "
                      f"({qw.nbytes() / base / 1e6:5.0f} GB/s); best {best[1]} "
                      f"{best[0] * 1e3:6.1f} us\n  " + "\n  ".join(cells), flush=True)


# (BT, BN, num_warps, BK at most) of the fused MoE's int8 grouped kernels timed by --moe-grouped
# (moe.GROUP_I8_TILES' defaults among them: NVFP4 (2, 16, 4, 512), Q4_K (2, 32, 8, 512)); each
# one compiles both kernels once, a few seconds
GROUP_I8_SWEEP = [(2, 16, 4, 512), (4, 16, 4, 512), (2, 32, 8, 512), (4, 32, 8, 256)]


def bench_moe_grouped(tokens: tuple[int, ...] = (4, 8, 16), e: int = 128, h: int = 2048,
                      inter: int = 768, topk: int = 8) -> None:
    """One MoE layer of Qwen3-30B-A3B's shape (Q4_K and NVFP4 banks, bf16 x quantized by the
    RMSNorm before it, as at decode) at 4, 8 and 16 tokens: the per-route int8 GEMVs (today's
    default) against the int8 grouped kernels (`moe_grouped.py`, each expert's rows read once
    for all of its routes) at GROUP_I8_SWEEP's tiles. us per layer replayed from a CUDA graph,
    the ratio per-route / grouped (> 1: grouped faster) and the best per line. Decides
    moe.GROUPED_TOKENS (the token counts where the best ratio is > 1) and GROUP_I8_TILES."""
    from freetoken import kernels
    from freetoken.kernels.triton.moe import fused_moe_triton

    print(f"{'format':6s} {'T':>3s} {'experts':>7s} {'per-route us':>12s}  "
          + "  ".join(f"{str(gt):>20s}" for gt in GROUP_I8_SWEEP) + "   best (BT, BN, warps, BK)")
    for fmt in ("Q4_K", "nvfp4"):
        bank = random_bank(fmt, e, h, inter)
        emap = torch.arange(e, dtype=torch.int32, device="cuda")  # as the cache backends pass
        nw = torch.rand(h, device="cuda") + 0.5
        for t in tokens:
            torch.manual_seed(t)
            xr = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            x = kernels.rms_norm(xr, nw, 1e-6, quantize=True)  # the codes attached, as at decode
            ids = routing(t, e, topk)
            w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
            call = functools.partial(fused_moe_triton, x, bank, ids, w, "silu", emap)
            eager, graph = time_call(lambda call=call: call(grouped=False))
            route = graph or eager
            rows, best = _race(GROUP_I8_SWEEP, lambda gt, c=call: c(grouped=True, group_tiles=gt),
                               route, "per-route")
            cells = [f"{why:>20s}" if g is None else f"{g * 1e3:9.1f} ({route / g:4.2f}x)    "
                     for _, g, why in rows]
            print(f"{fmt:6s} {t:3d} {int(torch.unique(ids).numel()):7d} {route * 1e3:12.1f}  "
                  + "  ".join(cells) + f"   {best[1]} {best[0] * 1e3:.1f} us", flush=True)


def bench_moe_mma(tokens: tuple[int, ...] = (2, 4, 8, 16), e: int = 128, h: int = 2048,
                  inter: int = 768, topk: int = 8, formats: tuple[str, ...] = ("Q4_K", "nvfp4")
                  ) -> None:
    """One MoE layer of Qwen3-30B-A3B's shape (Q4_K, then NVFP4 experts; bf16 x quantized by
    the RMSNorm before it) at 2-16 tokens, the weights from HBM (64 random routings cycled in
    one CUDA graph, as `bench_hbm_tiles`): the per-route int8 GEMVs (today's default) against
    the tensor-core kernels (`moe_mma.py`) at each form and tiles of MMA_SWEEP the format
    takes ("-": not). us a layer, one line per format and token count; the best last."""
    from freetoken.kernels.triton.moe import fused_moe_triton
    from freetoken.kernels.triton.moe_mma import fused_moe_mma, supported_mma

    nw = torch.rand(h, device="cuda") + 0.5
    print(f"{'format':6s} {'T':>3s} {'per-route us':>12s}  "
          + "  ".join(f"{f + str(t):>16s}" for f, t in MMA_SWEEP) + "   best (form, tiles)")
    for fmt in formats:
        bank = random_bank(fmt, e, h, inter)
        for t in tokens:
            x, rw = moe_inputs(t, h, topk, nw)
            idss = [routing(t, e, topk) for _ in range(64)]
            route = cycled_ms([functools.partial(fused_moe_triton, x, bank, ids, rw, "silu")
                               for ids in idss])
            cells, best = [], None
            for form, tile in MMA_SWEEP:
                if not supported_mma(bank, x.dtype, form):
                    cells.append(f"{'-':>16s}")
                    continue
                try:
                    ms = cycled_ms([functools.partial(fused_moe_mma, x, bank, ids, rw, "silu",
                                                      None, tile, form) for ids in idss])
                except Exception as err:  # noqa: BLE001 - one failing tile must not end it
                    cells.append(f"{type(err).__name__:>16s}")
                    continue
                cells.append(f"{ms * 1e3:7.1f} ({route / ms:4.2f}x)")
                if best is None or ms < best[1]:
                    best = ((form, tile), ms)
            tail = f"   {best[0]} {best[1] * 1e3:.1f} us" if best else ""
            print(f"{fmt:6s} {t:3d} {route * 1e3:12.1f}  " + "  ".join(cells) + tail,
                  flush=True)


def bench_moe_switch(name: str, values: list[str], tokens: tuple[int, ...] = (1, 2, 4, 8, 16),
                     e: int = 128, h: int = 2048, inter: int = 768, topk: int = 8) -> None:
    """The per-route MoE (today's decode path, 30B shape, bf16 x quantized by the RMSNorm
    before it, weights from HBM: 64 random routings cycled in one CUDA graph) under each value
    of the environment switch `name` (FREETOKEN_GPU_MOE_MAXNREG, FREETOKEN_GPU_MOE_ROUTE_TILES,
    ...; "" unset): us a layer per value, and each one's ratio to the first's (below 1:
    faster)."""
    from freetoken.kernels.triton.moe import fused_moe_triton

    nw = torch.rand(h, device="cuda") + 0.5
    print(f"{'format':6s} {'T':>3s} " + "  ".join(f"{v or 'unset':>16s}" for v in values))
    saved = os.environ.get(name)
    try:
        for fmt in ("Q4_K", "nvfp4"):
            bank = random_bank(fmt, e, h, inter)
            for t in tokens:
                x, rw = moe_inputs(t, h, topk, nw)
                idss = [routing(t, e, topk) for _ in range(64)]
                cells, base = [], None
                for v in values:
                    os.environ[name] = v
                    ms = cycled_ms([functools.partial(fused_moe_triton, x, bank, ids, rw,
                                                      "silu") for ids in idss])
                    base = ms if base is None else base
                    cells.append(f"{ms * 1e3:6.1f} ({ms / base:4.2f})")
                print(f"{fmt:6s} {t:3d} " + "  ".join(f"{c:>16s}" for c in cells), flush=True)
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def bench_moe_routes(e: int = 128, h: int = 2048, inter: int = 768, topk: int = 8) -> None:
    """What bounds the per-route MoE (today's decode path, 30B shape, bf16 x quantized by the
    RMSNorm before it): at 1, 4 and 16 tokens the same number of routes over random experts
    (as with uniform routing), over 8 experts only (every token picks the same ones: a
    fifth of the bytes at 16 tokens, the rest read again from L2) and over as many distinct
    experts as routes. If the time follows the routes, not the distinct bytes, the per-route
    work (each route expanding its expert's codes) bounds it, not HBM."""
    from freetoken.kernels.triton.moe import fused_moe_triton

    print(f"{'format':6s} {'T':>3s} {'routing':9s} {'experts':>7s} {'routes':>6s} {'us':>7s} "
          f"{'TB/s of distinct bytes':>22s}")
    for fmt in ("Q4_K", "nvfp4"):
        bank = random_bank(fmt, e, h, inter)
        per_expert = (bank.w13.nbytes() + bank.w2.nbytes()) / e
        emap = torch.arange(e, dtype=torch.int32, device="cuda")
        nw = torch.rand(h, device="cuda") + 0.5
        for t in (1, 4, 16):
            x, w = moe_inputs(t, h, topk, nw)
            cases = {
                "random": routing(t, e, topk),
                "same 8": torch.arange(topk, device="cuda").repeat(t, 1),
                "distinct": (torch.arange(t * topk, device="cuda") % e).reshape(t, topk),
            }
            for name, ids in cases.items():
                u = int(torch.unique(ids).numel())
                _, g = time_call(lambda ids=ids, x=x, w=w, bank=bank, emap=emap:
                                 fused_moe_triton(x, bank, ids, w, "silu", emap, grouped=False))
                print(f"{fmt:6s} {t:3d} {name:9s} {u:7d} {t * topk:6d} {g * 1e3:7.1f} "
                      f"{u * per_expert / g / 1e9:22.2f}", flush=True)


def profile_step_kernels(t: int, e: int = 128, h: int = 2048, inter: int = 768,
                         topk: int = 8) -> None:
    """For a profiler started off (`ncu --profile-from-start off`): the decode kernels of one
    30B-shape layer at t tokens (split Q8_0 qkv and o_proj, the Q4_K MoE's gate/up and down,
    the fused residual norm + router, decode attention over 128 keys), each run three times to
    warm up, then once between cudaProfilerStart and cudaProfilerStop."""
    from freetoken import kernels
    from freetoken.kernels.triton.attention import decode
    from freetoken.kernels.triton.moe import fused_moe_triton
    from freetoken.kernels.triton.route import norm_gate_route_triton

    qkv, o = make_weight("Q8_0s", (5120, h)), make_weight("Q8_0s", (h, 4096))
    bank = random_bank("Q4_K", e, h, inter)
    emap = torch.arange(e, dtype=torch.int32, device="cuda")
    nw = torch.rand(h, device="cuda") + 0.5
    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    xr = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    x = kernels.rms_norm(xr, nw, 1e-6, quantize=True)  # the codes attached, as at decode
    xa = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    ids = routing(t, e, topk)
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
    # decode attention over 128 keys a sequence (the 30B's 32 query and 4 KV heads of 128,
    # bf16 pages of 16)
    page, ctx = 16, 128
    cache = torch.randn(2, t * ctx // page, page, 4, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(t * ctx // page, device="cuda").to(torch.int32).view(t, -1)
    lens = torch.full((t,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(t, 32, 128, device="cuda", dtype=torch.bfloat16)
    ops = [lambda: linear(x, qkv), lambda: linear(xa, o),
           lambda: fused_moe_triton(x, bank, ids, w, "silu", emap, grouped=False),
           lambda: norm_gate_route_triton(xr, xr, nw, 1e-6, True, gate, topk, False, True,
                                          None),
           lambda: decode(q, cache, table, lens, scale=128 ** -0.5, window=None, softcap=None)]
    for _ in range(3):
        for f in ops:
            f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for f in ops:
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"ran the {t}-token decode kernels once between cudaProfilerStart and Stop")


def bench_dense_gemm(tokens: tuple[int, ...] = (128, 256, 512, 2048)) -> None:
    """Prefill's dense linears: the tl.dot tiles (`linear._blocks`' choice) against decoded
    rows and torch's GEMM (`linear.dequant_gemm`, the choice from DEQUANT_GEMM_TOKENS)."""
    from freetoken.kernels.triton.formats import format_id
    from freetoken.kernels.triton.linear import _DOT, _blocks, dequant_gemm, triton_linear

    for fmt in ("nvfp4", "Q4_K", "Q8_0s"):
        for name, n, k in DENSE[:2]:
            qw = make_weight(fmt, (n, k))
            for m in tokens:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                t = _blocks(m, n, k, format_id(qw), _DOT[x.dtype])
                flops = 2 * m * n * k
                cells = [_try(f"tiles {t}", lambda x=x, qw=qw, t=t: triton_linear(x, qw, t),
                              qw.nbytes(), flops),
                         _try("decoded + GEMM", lambda x=x, qw=qw, o=out: dequant_gemm(x, qw, o),
                              qw.nbytes(), flops)]
                print(f"dense {fmt:6s} {name} {n}x{k} m={m:4d}: " + " | ".join(cells),
                      flush=True)


def bench_router(e: int = 128, h: int = 2048) -> None:
    """The MoE router at 1 and 16 tokens: the fused gate GEMV + top-k (experts per program,
    warps) against the unfused path (bf16 GEMM, cast, route kernel)."""
    from freetoken.kernels.route import route_topk
    from freetoken.kernels.triton.route import gate_route_triton

    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    for t in (1, 16):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        _, g = time_call(lambda x=x: route_topk((x @ gate.T).float(), 8))
        cells = [f"unfused {g * 1e3:.1f} us"]
        for be, w in ((8, 4), (4, 1), (2, 1), (1, 1), (4, 2), (2, 2)):
            _, g = time_call(lambda x=x, be=be, w=w: gate_route_triton(x, gate, 8, False, True,
                                                                        None, be, w))
            cells.append(f"fused be={be} w={w} {g * 1e3:.1f} us")
        print(f"router {t:2d} tokens: " + " | ".join(cells), flush=True)


def routing(t: int, e: int, topk: int) -> torch.Tensor:
    """Random top-k expert ids [t, topk] on the GPU, distinct within each token (uniform
    routing, as random weights route)."""
    return torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(t)])


def moe_inputs(t: int, h: int, topk: int, nw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's MoE inputs at t tokens, seeded by t: x [t, h] in bf16 through the
    RMSNorm (weight nw) with its codes attached, as at decode, and softmax route weights."""
    from freetoken import kernels

    torch.manual_seed(t)
    x = kernels.rms_norm(torch.randn(t, h, device="cuda", dtype=torch.bfloat16), nw, 1e-6,
                         quantize=True)
    return x, torch.softmax(torch.randn(t, topk, device="cuda"), -1)


def cycled_ms(fns: list) -> float:
    """ms per call of a list of calls (each on other weights), all captured in one CUDA graph
    and replayed: with more bytes among them than L2 holds, each call reads from HBM as in a
    decode step (graph_ms replays one call, whose weights stay in L2 once they fit)."""
    import itertools

    it = itertools.cycle(fns)
    return graph_ms(lambda: next(it)(), calls=len(fns))


def _hbm_cells(tiles, call, weights, default) -> str:
    """`call(w, t)` per tile t: us with every `weights` in turn (one graph: from HBM where they
    outgrow L2) and with the first replayed (L2-hot), the default marked *."""
    cells = []
    for t in tiles:
        name = "x".join(str(v) for v in t[1:4]) + (f" mt={t[4]}" if len(t) > 4 else "") \
            if t[0] == 1 else "x".join(str(v) for v in t)
        try:
            hot = graph_ms(lambda t=t: call(weights[0], t))
            cold = cycled_ms([lambda w=w, t=t: call(w, t) for w in weights])
        except Exception as e:  # noqa: BLE001 - one failing tile must not end the sweep
            cells.append(f"{name} failed: {type(e).__name__}")
            continue
        mark = "*" if default is not None and tuple(default) == tuple(t) else ""
        cells.append(f"{name}{mark} {cold * 1e3:.2f} (hot {hot * 1e3:.2f})")
    return " | ".join(cells)


def bench_hbm_tiles(fmt: str = "Q8_0s", tokens: tuple[int, ...] = (1,), moe_fmt: str = "Q4_K",
                    total: int = 200 << 20) -> None:
    """Decode tiles measured with the weights from HBM: the dense linears (qkv, o_proj of the
    30B shape, `fmt`) and the MoE layer (128 x 2048 x 768 `moe_fmt` experts, top-8, another
    random routing each call) at each token count, each tile also timed L2-hot (one call
    replayed: how the --sweep figures were taken). us per call; the default tiles marked *
    (dense: the int8 GEMV's one-token tiles and several-token ones, tl.dot tiles from 5; the
    MoE: the per-route int8 GEMV's)."""
    from freetoken.kernels.triton.formats import format_id
    from freetoken.kernels.triton.linear import _DOT, _blocks, _i8_blocks, triton_linear
    from freetoken.kernels.triton.moe import _i8_tiles, fused_moe_triton

    e, h, inter, topk = 128, 2048, 768, 8
    bank = random_bank(moe_fmt, e, h, inter)
    for m in tokens:
        for name, n, k in DENSE[:2]:
            w0 = make_weight(fmt, (n, k))
            ws = [w0] + [make_weight(fmt, (n, k)) for _ in range(max(1, total // w0.nbytes()))]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fid = format_id(w0)
            default = _i8_blocks(m, n, k, fid) if _i8(fmt) else None
            default = default or _blocks(m, n, k, fid, _DOT[x.dtype])
            if m == 1:
                tiles = [(1, bn, bk, w) for bn, bk, w in I8_TILES]
            else:
                mt = min(16, 1 << (m - 1).bit_length())
                tiles = [(1, bn, bk, w, mt) for bn, bk, w in MT_TILES] if _i8(fmt) else []
                tiles += [(bm, bn, bk or 256, w) for bm, bn, bk, w in DOT_TILES[16]]
            if tuple(default) not in tiles:
                tiles.append(tuple(default))
            cells = _hbm_cells(tiles, lambda w, t, x=x: triton_linear(x, w, t), ws, default)
            print(f"hbm {fmt} {name} {n}x{k} m={m}, us HBM (L2-hot): {cells}", flush=True)
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        rw = torch.softmax(torch.randn(m, topk, device="cuda"), -1)
        idss = [routing(m, e, topk) for _ in range(64)]
        dflt = _i8_tiles(format_id(bank.w13), h, torch.bfloat16, None, m)
        default = None if dflt is None else (1, *dflt[:3])
        cand = [(2, 1024, 1), (4, 1024, 2), (8, 1024, 4), (16, 1024, 4), (16, 512, 4),
                (32, 1024, 4), (32, 1024, 8), (16, 2048, 4), (8, 2048, 4), (16, 256, 4)] \
            if m == 1 else I8_ROUTE_TILES
        tiles = [(1, *c) for c in cand]
        if default is not None and default not in tiles:
            tiles.append(default)
        cells = _hbm_cells(tiles, lambda ids, t, x=x, rw=rw, bank=bank: fused_moe_triton(
            x, bank, ids, rw, "silu", None, t), idss, default)
        print(f"hbm {moe_fmt} MoE 128x2048x768 top-8 m={m}, us HBM (L2-hot): {cells}",
              flush=True)


def bench_norm_router(e: int = 128, h: int = 2048, layers: int = 160) -> None:
    """The fused post-attention RMSNorm + router (`norm_gate_route_triton`) at 1, 4 and 16
    tokens for (experts, warps) per program and split by hidden slices (values, warps), the
    30B shape's router (128 x 2048 bf16); each
    call reads another of `layers` router weights (80 MB at the defaults: more than L2 holds,
    so the weight comes from HBM as in a decode step). us per call, replayed from a graph."""
    import itertools

    from freetoken.kernels.triton.route import (
        NORM_ROUTE_SPLIT,
        NORM_ROUTE_TILES,
        norm_gate_route_triton,
    )

    gates = [torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
             for _ in range(layers)]
    nw = torch.rand(h, device="cuda") + 0.5
    for t in (1, 4, 16):
        xr = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        cells = []
        for be, w in ((2, 1), (1, 1), (4, 1), (1, 2), (2, 2), (4, 2), (8, 2), (2, 4), (4, 4),
                      (8, 4), (16, 4), (16, 8)):
            it = itertools.cycle(gates)
            ms = graph_ms(lambda be=be, w=w, it=it, xr=xr, res=res: norm_gate_route_triton(
                xr, res, nw, 1e-6, True, next(it), 8, False, True, None, be, w, (0, 1)),
                calls=layers)
            mark = "*" if (be, w) == NORM_ROUTE_TILES and not NORM_ROUTE_SPLIT[0] else ""
            cells.append(f"{be}x{w}{mark} {ms * 1e3:.2f}")
        print(f"norm+router {t:2d} tokens, us (BExWARPS): " + " | ".join(cells), flush=True)
        cells = []
        for split in ((32, 2), (64, 2), (64, 4), (128, 4), (128, 8), (256, 4), (256, 8),
                      (512, 8)):
            it = itertools.cycle(gates)
            ms = graph_ms(lambda split=split, it=it, xr=xr, res=res: norm_gate_route_triton(
                xr, res, nw, 1e-6, True, next(it), 8, False, True, None, split=split),
                calls=layers)
            mark = "*" if split == NORM_ROUTE_SPLIT else ""
            cells.append(f"{split[0]}x{split[1]}{mark} {ms * 1e3:.2f}")
        print(f"norm+router {t:2d} tokens, us (split BHxWARPS): " + " | ".join(cells),
              flush=True)


def bench_plan(e: int = 256, k: int = 8, slots: int = 1024, layers: int = 160) -> None:
    """The slot cache's plan at 1 and 4 tokens (Qwen3.6-35B-A3B's 256 experts top-8, a pool of
    `slots`, 1024 being its rate 0.1 and 2560 its 0.25; more layers than the pool holds, so
    every call evicts): posting the CPU's job from the plan kernel against the plan kernel
    followed by the send kernel. us per layer call, replayed from a CUDA graph; no worker
    answers (the jobs are only written)."""
    from freetoken.kernels.triton.handoff import job_args, send
    from freetoken.kernels.triton.slot_plan import plan_triton
    from freetoken.moe.handoff import layout
    from freetoken.moe.policy import FetchPolicy
    from freetoken.moe.slot_cache import SlotCache

    bank = ExpertBank(QuantWeight(torch.zeros(e, 32, 64), "f32", (e, 32, 64)),
                      QuantWeight(torch.zeros(e, 64, 16), "f32", (e, 64, 16)), torch.ones(e, 4))
    cache = SlotCache([bank] * layers, slots, "cuda")
    table, cap, _ = cache._limit_cap(FetchPolicy(0.3, None, "bench"))
    off = layout(64, k, e, 2048)
    buf = torch.zeros(off["size"], dtype=torch.uint8, pin_memory=True)
    seq = torch.zeros(1, dtype=torch.int32, device="cuda")
    for t in (1, 4):
        x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(t, k, device="cuda")
        ids = [torch.stack([torch.randperm(e)[:k] for _ in range(t)]).cuda()
               for _ in range(layers)]

        def calls(fused: bool, ids=ids, x=x, w=w) -> None:
            for layer in range(layers):
                job = job_args(x, ids[layer], w, seq, buf, off, layer, 0, 1)
                if fused:
                    plan_triton(cache, layer, ids[layer], table, cap, True, None, job)
                else:
                    plan_triton(cache, layer, ids[layer], table, cap, True)
                    send(job, cache.slot_of[layer * e:(layer + 1) * e])

        cells = []
        for label, fused in (("plan + send kernel", False), ("plan posting the job", True)):
            _, g = time_call(lambda fused=fused: calls(fused))
            cells.append(f"{label} {g * 1e3 / layers:.1f} us" if g else f"{label} -")
        print(f"slot plan, {slots} slots, {t} token(s): " + " | ".join(cells), flush=True)


# (name, query heads, KV heads, head size) of decode attention
ATTN_SHAPES = [("30B", 32, 4, 128), ("35B", 16, 2, 256)]
# (context, keys the page table holds): the table sets the split count (`num_splits`), the
# context each split's share; a graph captured for 4096 keys replays shorter contexts too
ATTN_CONTEXTS = [(128, 128), (128, 4096), (1024, 1024), (1024, 4096), (4096, 4096)]


def bench_attention(hbm: float, page: int = 16) -> None:
    """Decode attention, bf16 KV in pages of 16 keys (the engine's default), Qwen3-30B-A3B's
    and Qwen3.6-35B-A3B's heads at batch 1, 4 and 16: split-K merged by the last split to
    arrive, reading 1, 4 or 16 splits' partials a round (MERGE_GROUP), against the merge
    kernel's launch and one split. us per call replayed from a CUDA graph; GB/s of the K and
    V bytes the contexts hold."""
    from freetoken.kernels.triton import attention as tri
    from freetoken.kernels.triton.attention import _tiles, decode, num_splits

    # (label, decode's keywords, MERGE_GROUP: splits the merging program reads a round)
    variants = (("merged g1", {"fused_merge": True}, 1), ("merged g4", {"fused_merge": True}, 4),
                ("merged g16", {"fused_merge": True}, 16),
                ("merge launch", {"fused_merge": False}, 1), ("1 split", {"splits": 1}, 1))
    group0 = tri.MERGE_GROUP
    print(f"{'shape':5s} {'batch':>5s} {'ctx':>5s} {'table':>5s} {'splits':>6s} "
          + " ".join(f"{label + ' us':>15s} {'GB/s':>6s}" for label, _, _ in variants))
    for name, n_q, n_kv, d in ATTN_SHAPES:
        for b in (1, 4, 16):
            for ctx, keys in ATTN_CONTEXTS:
                n_pages = b * keys // page
                cache = torch.randn(2, n_pages, page, n_kv, d, device="cuda",
                                    dtype=torch.bfloat16)
                table = torch.randperm(n_pages, device="cuda").to(torch.int32).view(b, -1)
                lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
                q = torch.randn(b, n_q, d, device="cuda", dtype=torch.bfloat16)
                nbytes = 2 * b * ctx * n_kv * d * cache.element_size()
                call = functools.partial(decode, q, cache, table, lens, scale=d ** -0.5,
                                         window=None, softcap=None)
                cells = []
                for _, kw, group in variants:
                    tri.MERGE_GROUP = group  # read at launch: baked into the graph captured
                    eager, graph = time_call(lambda call=call, kw=kw: call(**kw))
                    ms = graph or eager
                    cells.append(f"{ms * 1e3:15.1f} {nbytes / ms / 1e6:6.0f}")
                tri.MERGE_GROUP = group0
                splits = num_splits(b, n_kv, keys, _tiles(d)[0])
                print(f"{name:5s} {b:5d} {ctx:5d} {keys:5d} {splits:6d} " + " ".join(cells),
                      flush=True)
    print(f"(HBM copy {hbm:.0f} GB/s)")
    bench_rope_attention(page)


# (name, query heads, KV heads, head size, rotary values) of the q/k rope before attention
ROPE_SHAPES = [("30B", 32, 4, 128, 128), ("35B", 16, 2, 256, 64)]


def bench_rope_attention(page: int = 16) -> None:
    """A decode step's q/k norm, rotary and KV store (qkv rows as the projection gives them)
    then attention: `qk_rope_triton`'s launch and decode's, against decode doing both
    (`decode(rope=...)`, the default; FREETOKEN_GPU_ROPE_ATTN=0 gives the two back). us per
    step replayed from a CUDA graph, where the gap between the two launches counts too."""
    from freetoken.kernels.triton.attention import decode
    from freetoken.kernels.triton.rotary import qk_rope_triton

    print(f"\n{'shape':5s} {'batch':>5s} {'ctx':>5s} {'rope + decode us':>16s} "
          f"{'one launch us':>13s}")
    for name, n_q, n_kv, d, r in ROPE_SHAPES:
        for b in (1, 4, 16):
            for ctx in (128, 1024, 4096):
                n_pages = b * ctx // page
                cache = torch.randn(2, n_pages, page, n_kv, d, device="cuda",
                                    dtype=torch.bfloat16)
                table = torch.randperm(n_pages, device="cuda").to(torch.int32).view(b, -1)
                lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
                slots = (table[:, -1].long() * page + page - 1).contiguous()  # the last key
                qkv = torch.randn(b, (n_q + 2 * n_kv) * d, device="cuda", dtype=torch.bfloat16)
                q, k, v = (x.view(b, -1, d) for x in qkv.split([n_q * d, n_kv * d, n_kv * d], -1))
                cos, sin = torch.rand(2, b, r, device="cuda").unbind(0)
                w = torch.rand(2, d, device="cuda").unbind(0)
                kw = dict(scale=d ** -0.5, window=None, softcap=None)

                def two(q=q, k=k, v=v, cos=cos, sin=sin, w=w, cache=cache, slots=slots,
                        table=table, lens=lens, kw=kw):
                    qo, _ = qk_rope_triton(q, k, cos, sin, *w, 1e-6, (v, cache, slots))
                    decode(qo, cache, table, lens, **kw)

                def one(q=q, k=k, v=v, cos=cos, sin=sin, w=w, cache=cache, slots=slots,
                        table=table, lens=lens, kw=kw):
                    decode(q, cache, table, lens, rope=(k, v, cos, sin, *w, 1e-6, slots), **kw)

                cells = [f"{(g or e) * 1e3:.1f}" for e, g in (time_call(two), time_call(one))]
                print(f"{name:5s} {b:5d} {ctx:5d} {cells[0]:>16s} {cells[1]:>13s}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="nvfp4,Q4_K,Q8_0s,Q8_0,Q6_K,mxfp4,MXFP4,fp8_block,bf16")
    p.add_argument("--dense-tokens", default="1,16,512")
    p.add_argument("--moe-tokens", default="1,16,512")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--sweep", default="", help="formats whose GEMV tiles to sweep first")
    p.add_argument("--sweep-tokens", default="1,16,512", help="token counts of the sweep")
    p.add_argument("--sweep-moe", default="128,768",
                   help="experts,FFN of the sweep's MoE layer (256,512: Qwen3.6-35B-A3B)")
    p.add_argument("--linear-mt", default="",
                   help="only time dense linears at 2-16 tokens: the int8 GEMV taking several "
                        "tokens a program against today's choice, for these formats "
                        "(nvfp4,Q4_K,Q8_0s)")
    p.add_argument("--moe-grouped", action="store_true",
                   help="only time one MoE layer (30B shape, Q4_K and NVFP4) at 4, 8 and 16 "
                        "tokens: per-route int8 GEMVs against the int8 grouped kernels")
    p.add_argument("--moe-mma", action="store_true",
                   help="only time one MoE layer (30B shape, Q4_K, weights from HBM) at 2-16 "
                        "tokens: per-route int8 GEMVs against the int8 tensor-core kernels")
    p.add_argument("--moe-switch", default=None, metavar="NAME=V,V",
                   help="only time the per-route MoE (30B shape, weights from HBM) at 1-16 "
                        "tokens under each value of an environment switch (an empty value: "
                        "unset; the first value is the ratios' base), e.g. "
                        "FREETOKEN_GPU_MOE_MAXNREG=0,128,96")
    p.add_argument("--moe-routes", action="store_true",
                   help="only time one MoE layer (30B shape) at 1, 4 and 16 tokens over random, "
                        "8 shared and all distinct experts: bound by routes or by bytes")
    p.add_argument("--profile-step-kernels", type=int, default=0, metavar="T",
                   help="only run one 30B-shape layer's decode kernels at T tokens once, "
                        "between cudaProfilerStart and Stop (for ncu --profile-from-start off)")
    p.add_argument("--router", action="store_true", help="only time the MoE router variants")
    p.add_argument("--hbm-tiles", default=None, metavar="FMT[,MOE_FMT]",
                   help="only time decode tiles of the dense linears (FMT: Q8_0s, nvfp4, "
                        "Q4_K) and the MoE (MOE_FMT, default Q4_K) with weights from HBM and "
                        "L2-hot")
    p.add_argument("--hbm-tokens", default="1", metavar="T,T",
                   help="token counts of --hbm-tiles (default 1)")
    p.add_argument("--norm-router", action="store_true",
                   help="only time the fused RMSNorm + router's experts and warps per program")
    p.add_argument("--dense-gemm", action="store_true",
                   help="only time prefill's dense linears: tl.dot tiles against decoded rows "
                        "and torch's GEMM")
    p.add_argument("--attention", action="store_true",
                   help="only time decode attention: split-K merged in the kernel against "
                        "the merge kernel's launch and one split")
    p.add_argument("--plan", action="store_true",
                   help="only time the slot plan with and without posting the CPU's job")
    p.add_argument("--plan-slots", default=None,
                   help="pool sizes of --plan (default 1024,2560: the 35B's cache rates 0.1 "
                        "and 0.25)")
    a = p.parse_args()
    if a.profile_step_kernels < 0:
        p.error(f"--profile-step-kernels takes a token count of 1 or more (0: off), got "
                f"{a.profile_step_kernels}")
    if a.plan_slots is not None and not a.plan:
        p.error("--plan-slots goes with --plan")
    if a.dense_gemm and (a.router or a.plan or a.sweep):
        p.error("--dense-gemm runs alone (not with --router, --plan or --sweep)")
    if a.attention and (a.router or a.plan or a.dense_gemm or a.sweep):
        p.error("--attention runs alone (not with --router, --plan, --dense-gemm or --sweep)")
    if a.attention:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu_kernels.py --attention: needs a CUDA GPU (it times the "
                     "compiled kernels from CUDA graphs); on the CPU the kernels' tests run "
                     "under Triton's interpreter: pytest tests/kernels/test_triton_attention.py")
        bench_attention(hbm_copy_gbs())
        return
    if a.linear_mt:
        bench_linear_mt(a.linear_mt.split(","))
        return
    if a.moe_grouped:
        bench_moe_grouped()
        return
    if a.moe_mma:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu_kernels.py --moe-mma: needs a CUDA GPU (it times the compiled "
                     "kernels from CUDA graphs); on the CPU the kernels' tests run under "
                     "Triton's interpreter: pytest tests/kernels/test_triton_moe_mma.py")
        bench_moe_mma()
        return
    if a.moe_switch:
        name, eq, values = a.moe_switch.partition("=")
        from freetoken import env

        if not eq or not env.known(name):
            p.error(f"--moe-switch {a.moe_switch!r}: NAME=V,V with a FreeToken switch "
                    "(freetoken/env.py lists them)")
        bench_moe_switch(name, values.split(","))
        return
    if a.moe_routes:
        bench_moe_routes()
        return
    if a.profile_step_kernels:
        profile_step_kernels(a.profile_step_kernels)
        return
    if a.router:
        bench_router()
        return
    if a.norm_router:
        bench_norm_router()
        return
    if a.hbm_tiles:
        fmts = a.hbm_tiles.split(",")
        try:
            tokens = tuple(int(t) for t in a.hbm_tokens.split(","))
        except ValueError:
            p.error(f"--hbm-tokens {a.hbm_tokens!r}: comma-separated token counts")
        if len(fmts) > 2 or not all(1 <= t <= 16 for t in tokens):
            p.error("--hbm-tiles takes FMT or FMT,MOE_FMT; --hbm-tokens counts of 1 to 16")
        bench_hbm_tiles(fmts[0], tokens, fmts[1] if len(fmts) > 1 else "Q4_K")
        return
    if a.dense_gemm:
        bench_dense_gemm()
        return
    if a.plan:
        for slots in (int(n) for n in (a.plan_slots or "1024,2560").split(",")):
            bench_plan(slots=slots)
        return
    hbm = hbm_copy_gbs()
    print(f"HBM copy (read + write): {hbm:.0f} GB/s  ({torch.cuda.get_device_name()})")
    for fmt in filter(None, a.sweep.split(",")):
        sweep_split(hbm) if fmt == "Q8_0s" else \
            sweep(fmt, hbm, tuple(int(t) for t in a.sweep_tokens.split(",")),
                  *(int(v) for v in a.sweep_moe.split(",")))
    print(f"{'shape':10s} {'format':9s} {'tokens':>6s} {'MB':>9s} {'eager us':>9s} "
          f"{'graph us':>9s} {'GB/s':>8s} {'% HBM':>6s} {'TFLOP/s':>7s}")
    for fmt in filter(None, a.formats.split(",")):
        if not a.skip_dense:
            bench_dense(fmt, [int(t) for t in a.dense_tokens.split(",")], hbm)
        if fmt != "Q8_0s":  # expert banks stay in Q8_0 blocks
            bench_moe(fmt, [int(t) for t in a.moe_tokens.split(",")], hbm)


if __name__ == "__main__":
    main()
