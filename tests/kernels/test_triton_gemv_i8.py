"""The int8-dot decode GEMV (`freetoken/kernels/triton/gemv_i8.py`) against float64 math.

Two checks per format (NVFP4, Q4_K, split Q8_0), one bf16 token:
1. it computes the quantized dot it claims: x quantized per 32 values as the module states
   (q = floor(x * fp32(127 / amax) + 1/2), d = amax / 127), then sum_b d_b sum_k w_k q_k in
   float64 from the codecs' weight values. Tolerance: the bf16 output's rounding, 2^-8 |y|, plus
   1e-5 of sum_b d_b sum_k |w_k q_k| for the fp32 block sums and scale products (a few
   roundings of eps = 2^-23 each per block; 1e-5 is ~80 eps). A code placed at a wrong k, a
   wrong sign or scale, moves y by the order of that magnitude;
2. it stays within the quantization's bound of the unquantized dot: each x_k moves by at most
   d_b / 2, so |y - x.w| <= sum_b d_b / 2 sum_{k in b} |w_k| (+ the tolerance of 1).
The fused MoE's decode kernels in int8 (x quantized for gate / up, the GLU output a for down)
are checked the same way, stage by stage in float64: g, u from the quantized x (fp32 block sums:
within E' = 1e-5 s sum |W| |x^| each), a = act(g) u (within E_a = 1.13 E'_g (|u| + E'_u) +
|act(g)| E'_u; 1.13 bounds silu' and gelu_tanh'), a quantized per 32 as x is; where a * 127 /
amax lies within E_a * 127 / amax + 1e-4 of a rounding tie the kernel's fp32 a may round the
other way, so those codes may differ by one (d'_b |Wd| each); the output adds sum |Wd| E_a.

Without CUDA the kernels run in Triton's interpreter with the integer emulation of dp4a / prmt
(`ASM` false); with CUDA the PTX runs, at larger shapes. The interpreter casts fp32 to bf16 by
truncation (up to one ulp, 2^-7 relative; 0.6% seen), so there the output term is 2^-7 |y|.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import triton_cases as cases  # noqa: E402

from freetoken import kernels  # noqa: E402
from freetoken.formats.dequant import dequantize  # noqa: E402
from freetoken.kernels import xq  # noqa: E402
from freetoken.kernels.triton.formats import split_q8_0  # noqa: E402
from freetoken.kernels.triton.gemv_i8 import xq_len  # noqa: E402
from freetoken.kernels.triton.linear import triton_linear  # noqa: E402
from freetoken.kernels.triton.moe import fused_moe_triton  # noqa: E402
from freetoken.kernels.triton.norm import rms_norm_triton  # noqa: E402
from freetoken.moe.banks import ExpertBank  # noqa: E402
from freetoken.moe.reference import glu  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
N, K = (300, 4096) if CUDA else (16, 512)
FORMATS = ["nvfp4", "Q4_K", "Q8_0"]
BF16_OUT = 2.0**-8 if CUDA else 2.0**-7  # the output's rounding to bf16 (see the module doc)


def check_i8(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
             out_round: float = BF16_OUT) -> None:
    """y [M, N] (any dtype) against x [M, K] fp32 (the values the kernel read) and w [N, K]
    fp32: checks 1 and 2 of the module doc."""
    q, d = cases.quantize_ref(x.double().float())
    dk = d.double().repeat_interleave(32, -1)  # [M, K]
    wd = w.double()
    want = (q.double() * dk) @ wd.T
    mag = (q.double().abs() * dk) @ wd.abs().T
    y = y.double().cpu()
    tol = out_round * want.abs() + 1e-5 * mag + 1e-30
    err = (y - want).abs()
    assert bool((err <= tol).all()), \
        f"quantized dot: max error / tolerance {float((err / tol).max()):.2f}"
    exact = x.double() @ wd.T
    bound = (dk / 2) @ wd.abs().T + tol
    err = (y - exact).abs()
    assert bool((err <= bound).all()), \
        f"against x.w: max error / bound {float((err / bound).max()):.2f}"


def _weight(fmt: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    qw = cases.random_weight(fmt, gen, N, K)
    w = dequantize(qw)
    qd = cases.to_device(qw, DEV)
    if fmt == "Q8_0":
        qd = split_q8_0(qd)  # the layout the loader gives Q8_0 on CUDA
    return qd, w


@pytest.mark.parametrize("fmt", FORMATS)
def test_i8_gemv_matches_float64(fmt):
    qd, w = _weight(fmt, 7 + len(fmt))
    gen = torch.Generator().manual_seed(3)
    for scale, dtype in ((1.0, torch.bfloat16), (1e-3, torch.bfloat16), (1.0, torch.float16)):
        x = (torch.randn(1, K, generator=gen) * scale)
        x[0, 5] = 40.0 * scale  # one outlier: its block's codes are coarse
        x[0, 64:96] = 0.0  # an all-zero block: d = 0, no division by zero
        xb = x.to(dtype)
        tiles = None if CUDA else (1, 8, 256, 4)
        y = triton_linear(xb.to(DEV), qd, tiles)
        assert y.dtype == dtype
        check_i8(y, xb.float(), w, out_round=BF16_OUT if dtype == torch.bfloat16 else 2.0**-11)


@pytest.mark.parametrize("fmt", FORMATS)
def test_i8_gemv_off_switch_is_the_fp32_path(fmt, monkeypatch):
    """FREETOKEN_GPU_INT8_DOT=0 runs the fp32 GEMV: within the fp32-path bound of x.w, tighter
    than the quantization's, and different bits from the int8 path."""
    qd, w = _weight(fmt, 11 + len(fmt))
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y8 = triton_linear(x.to(DEV), qd).cpu()
    monkeypatch.setenv("FREETOKEN_GPU_INT8_DOT", "0")
    yf = triton_linear(x.to(DEV), qd).cpu()
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    assert bool(((yf.double() - ref).abs() <= BF16_OUT * ref.abs() + cases.fp32_bound(K, mag))
                .all())
    assert not torch.equal(y8, yf)


def _moe_reference(x, bank, ids, rw, emap, act, down_i8=True):
    """float64 (result [T, H], tolerance [T, H]) of the int8 MoE as the module doc states."""
    w13, w2 = dequantize(bank.w13).double(), dequantize(bank.w2).double()
    s = bank.scales.double()
    inter = w2.shape[-1]
    t_n, h = x.shape
    ref, tol = (torch.zeros(t_n, h, dtype=torch.float64) for _ in range(2))
    for t in range(t_n):
        q, d = cases.quantize_ref(x[t:t + 1].float())
        xq = (q.double() * d.double().repeat_interleave(32, -1))[0]  # [H] x as quantized
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if emap[e] < 0:
                continue
            hh = w13[e] @ xq
            g, u = hh[:inter] * s[e, 0], hh[inter:] * s[e, 1]
            e13 = 1e-5 * (w13[e].abs() @ xq.abs())
            eg, eu = e13[:inter] * s[e, 0], e13[inter:] * s[e, 1]
            a = glu(g, u, act)
            ea = 1.13 * eg * (u.abs() + eu) + glu(g, torch.ones_like(u), act).abs() * eu
            qa, da = cases.quantize_ref(a.float()[None])  # the codes of a as computed here
            if not down_i8:  # the fp32 GEMV reads a as it is
                qa, da = a.float()[None], torch.ones(1, inter // 32)
            amax = a.abs().reshape(-1, 32).amax(-1).repeat_interleave(32)
            inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
            v = a * inv
            tie = ((v - torch.floor(v)) - 0.5).abs() <= ea * inv + 1e-4  # may round either way
            tie = tie & down_i8
            dak = da.double().repeat_interleave(32, -1)[0]
            aq = qa.double()[0] * dak
            r = float(rw[t, j]) * s[e, 2]
            ref[t] += r * (w2[e] @ aq)
            tol[t] += abs(r) * (w2[e].abs() @ (ea + tie * dak + 1e-5 * aq.abs()))
    return ref, tol


_MOE_CASES = [("nvfp4", "nvfp4", "silu"), ("Q4_K", "Q4_K", "gelu_tanh"), ("Q8_0", "Q8_0", "silu"),
              ("Q4_K", "Q6_K", "silu")]


@pytest.mark.parametrize("f13,f2,act,wide", [(*c, False) for c in _MOE_CASES]
                         + [(*_MOE_CASES[0], True), (*_MOE_CASES[3], True)])
def test_i8_fused_moe_decode_within_bound(f13, f2, act, wide, monkeypatch):
    """The fused MoE at decode sizes (one and two tokens) in int8 dots, slots mapped (two
    experts elsewhere: their rows add nothing), against the quantized computation in float64
    (module doc); one token through the per-route down kernel and the sum, two through the
    down-and-sum kernel. Q6_K down has no int8 dot: with it only gate / up run in int8, and the
    reference's down reads a unquantized (tolerance: the fp32 GEMV's, 1e-5 of its sum).
    wide: the int8 GEMVs at 64 rows a program and 8 warps instead of the default tiles (on
    CUDA through FREETOKEN_GPU_MOE_ROUTE_TILES, as a user sets them: Q6_K's fp32 down keeps
    its own; in the interpreter as tiles, against 16 rows and 4 warps)."""
    if wide and CUDA:
        monkeypatch.setenv("FREETOKEN_GPU_MOE_ROUTE_TILES", "64x1024x8")
    e_n, topk = 8, 3
    h, inter = (1024, 512) if CUDA else (256, 256)
    gen = torch.Generator().manual_seed(len(f13) + len(f2))
    scales = torch.ones(e_n, 4)
    scales[:, :3] = torch.rand(e_n, 3, generator=gen) * 3e-2 + 1e-3
    bank = ExpertBank(cases.random_weight(f13, gen, 2 * inter, h, (e_n,)),
                      cases.random_weight(f2, gen, h, inter, (e_n,)), scales)
    dev_bank = ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                          bank.scales.to(DEV))
    # the loader's layout for Q8_0 on CUDA (the int8 dot reads split Q8_0)
    dev_bank = ExpertBank(*(split_q8_0(w) if f == "Q8_0" else w
                            for w, f in ((dev_bank.w13, f13), (dev_bank.w2, f2))),
                          dev_bank.scales)
    emap = torch.arange(e_n, dtype=torch.int32)
    emap[torch.tensor([2, 5])] = -1
    for tokens in (1, 2):
        x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e_n, generator=gen)[:topk] for _ in range(tokens)])
        rw = torch.softmax(torch.randn(tokens, topk, generator=gen), -1)
        ref, tol = _moe_reference(x.float(), bank, ids, rw, emap, act, f2 != "Q6_K")
        y = fused_moe_triton(x.to(DEV), dev_bank, ids.to(DEV), rw.to(DEV), act, emap.to(DEV),
                             None if CUDA else (1, 64, 256, 8) if wide else (1, 16, 256, 4),
                             down_sum=tokens == 2).double().cpu()  # both down kernels
        tol = tol + BF16_OUT * ref.abs() + 1e-30
        err = (y - ref).abs()
        assert bool((err <= tol).all()), f"max error / bound {float((err / tol).max()):.2f}"


@pytest.mark.parametrize("tiles", ["64x256x4", "32x256x2"])
def test_down_tiles_switch_changes_no_bit(tiles, monkeypatch):
    """FREETOKEN_GPU_MOE_DOWN_TILES=BNxBKxWARPS: one token's down GEMV (the per-route kernel,
    its routes summed by the last to arrive) at other tiles gives the bits of the default ones
    (each row's int8 dot and block scales run in the same order whatever the rows a program),
    and both are within the float64 bound of the quantized computation."""
    e_n, topk = 8, 3
    h, inter = (1024, 512) if CUDA else (256, 256)
    gen = torch.Generator().manual_seed(7)
    scales = torch.ones(e_n, 4)
    scales[:, :3] = torch.rand(e_n, 3, generator=gen) * 3e-2 + 1e-3
    bank = ExpertBank(cases.random_weight("Q4_K", gen, 2 * inter, h, (e_n,)),
                      cases.random_weight("Q4_K", gen, h, inter, (e_n,)), scales)
    dev_bank = ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                          bank.scales.to(DEV))
    x = torch.randn(1, h, generator=gen).to(torch.bfloat16)
    ids = torch.randperm(e_n, generator=gen)[:topk].reshape(1, topk)
    rw = torch.softmax(torch.randn(1, topk, generator=gen), -1)
    args = (x.to(DEV), dev_bank, ids.to(DEV), rw.to(DEV), "silu")
    monkeypatch.delenv("FREETOKEN_GPU_MOE_DOWN_TILES", raising=False)
    y0 = fused_moe_triton(*args).cpu()
    monkeypatch.setenv("FREETOKEN_GPU_MOE_DOWN_TILES", tiles)
    y1 = fused_moe_triton(*args).cpu()
    assert torch.equal(y0, y1)
    ref, tol = _moe_reference(x.float(), bank, ids, rw, torch.arange(e_n), "silu", True)
    tol = tol + BF16_OUT * ref.abs() + 1e-30
    assert bool(((y1.double() - ref).abs() <= tol).all())


# -- activations quantized once, by the RMSNorm that produces them (kernels/xq.py) ----------------
def _norm_quantized(x: torch.Tensor, eps: float = 1e-6):
    """rms_norm of x on DEV with the codes the kernel wrote, attached as kernels.norm does on
    CUDA (there through kernels.rms_norm itself)."""
    w = torch.rand(x.shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5
    if CUDA:
        y = kernels.rms_norm(x.to(DEV), w.to(DEV), eps, quantize=True)
        q = xq.attached(y)
        assert q is not None, "kernels.rms_norm(quantize=True) attached no codes on CUDA"
        return y, q
    y, _, q = rms_norm_triton(x.to(DEV), w.to(DEV), eps, quantize=True)
    return xq.attach(y, q), q


@pytest.mark.parametrize("width", [512, 96])
def test_quant_store_matches_the_quantizer(width):
    """The codes RMSNorm writes are the module's quantization of its own (stored) output, bit
    for bit: codes, negated codes, block scales d = amax / 127 and block sums (96: a width
    that is not a power of two, masked tail)."""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[1, 32:64] = 0.0  # an all-zero block
    y, q = _norm_quantized(x)
    assert tuple(q.shape) == (3, xq_len(width))
    cases.check_codes(q, y)


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_reads_the_attached_codes(fmt):
    """A linear given the norm's output with its codes computes the same bits as one that
    quantizes for itself (same codes, same sums in the same order), at 1 and 4 tokens; a copy
    of the tensor (no codes) takes the own-quantization path."""
    qd, _ = _weight(fmt, 17 + len(fmt))
    tiles = None if CUDA else (1, 8, 256, 4)
    for m in (1, 4):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y, _ = _norm_quantized(x)
        plain = y.clone()
        assert xq.attached(plain) is None and xq.attached(y[:1]) is None
        assert torch.equal(triton_linear(y, qd, tiles).cpu(), triton_linear(plain, qd, tiles).cpu())


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_several_tokens_a_program_same_bits(fmt, monkeypatch):
    """The int8 GEMV taking MT tokens a program (`linear._i8_tokens`: each weight chunk
    expanded once, dotted with every token's codes) computes each token's bits of the
    one-token GEMV: the same integer dot sums, block and chunk order. 5 tokens as one program
    of 8 (3 padded rows, not stored) and as two of 4, quantizing for itself and reading the
    norm's codes; and by default once I8_MULTI_TOKENS names the format, or
    FREETOKEN_GPU_LINEAR_MT=N says so for every int8 format (0: never)."""
    from freetoken.kernels.triton import linear

    qd, _ = _weight(fmt, 23 + len(fmt))
    bk = 256 if not CUDA else 2048
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    y, _ = _norm_quantized(x)
    want = torch.cat([triton_linear(y[i:i + 1].clone(), qd, (1, 8, bk, 4))
                      for i in range(5)]).cpu()
    for src in (y, y.clone()):  # with the norm's codes, and quantizing in the kernel
        for mt in (8, 4):
            assert torch.equal(triton_linear(src, qd, (1, 8, bk, 4, mt)).cpu(), want), (mt, src)
    fid = linear.format_id(qd)
    monkeypatch.setattr(linear, "I8_MULTI_TOKENS", {fid: 8})
    monkeypatch.setattr(linear, "I8_MULTI_TILES", {fid: (8, bk, 4)})
    assert linear._i8_blocks(5, N, K, fid) == (1, 8, bk, 4, 8)
    assert torch.equal(triton_linear(y.clone(), qd).cpu(), want)
    monkeypatch.setenv("FREETOKEN_GPU_LINEAR_MT", "0")
    assert linear._i8_blocks(5, N, K, fid) is None  # above I8_TOKENS: tl.dot tiles
    monkeypatch.setenv("FREETOKEN_GPU_LINEAR_MT", "4")
    monkeypatch.setattr(linear, "I8_MULTI_TOKENS", {})
    assert linear._i8_blocks(3, N, K, fid) == (1, 8, bk, 4, 4)
    assert torch.equal(triton_linear(y[:3].clone(), qd).cpu(), want[:3])


@pytest.mark.parametrize("f13", ["nvfp4", "Q4_K"])
def test_fused_moe_reads_the_attached_codes(f13):
    """The fused MoE's gate/up at decode sizes reads the attached codes: the same bits as
    quantizing in every program."""
    e_n, topk, h, inter = 8, 3, 512, 256
    gen = torch.Generator().manual_seed(9)
    bank = ExpertBank(cases.to_device(cases.random_weight(f13, gen, 2 * inter, h, (e_n,)), DEV),
                      cases.to_device(cases.random_weight(f13, gen, h, inter, (e_n,)), DEV),
                      (torch.rand(e_n, 4, generator=gen) * 3e-2 + 1e-3).to(DEV))
    tiles = None if CUDA else (1, 64, 256, 4)  # interpreted: few, wide programs
    for tokens in (1, 2):
        x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
        y, _ = _norm_quantized(x)
        ids = torch.stack([torch.randperm(e_n, generator=gen)[:topk]
                           for _ in range(tokens)]).to(DEV)
        rw = torch.softmax(torch.randn(tokens, topk, generator=gen), -1).to(DEV)
        got = fused_moe_triton(y, bank, ids, rw, "silu", None, tiles)
        want = fused_moe_triton(y.clone(), bank, ids, rw, "silu", None, tiles)
        assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("f13,f2", [("nvfp4", "nvfp4"), ("Q4_K", "Q8_0")])
def test_fused_moe_quantized_glu_output(f13, f2):
    """gate/up storing the GLU output as codes (`quant_a`) gives the same bits as the down
    programs quantizing it themselves: the codes are the same function of the same fp32 a.
    Row blocks of 32 both ways (the codes' blocks), slots mapped with one expert elsewhere;
    FFN 256 (one chunk: the down-and-sum kernel) and 512 (per-route down, then the sum)."""
    e_n, topk, h = 8, 3, 256
    inter = 256 if f13 == "nvfp4" else 512
    gen = torch.Generator().manual_seed(4)
    bank = ExpertBank(cases.to_device(cases.random_weight(f13, gen, 2 * inter, h, (e_n,)), DEV),
                      cases.to_device(cases.random_weight(f2, gen, h, inter, (e_n,)), DEV),
                      (torch.rand(e_n, 4, generator=gen) * 3e-2 + 1e-3).to(DEV))
    if f2 == "Q8_0":
        bank = ExpertBank(bank.w13, split_q8_0(bank.w2), bank.scales)
    emap = torch.arange(e_n, dtype=torch.int32)
    emap[3] = -1
    tiles = (1, 32, 256, 4)
    for tokens in (1, 3):
        x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16).to(DEV)
        ids = torch.stack([torch.randperm(e_n, generator=gen)[:topk]
                           for _ in range(tokens)]).to(DEV)
        rw = torch.softmax(torch.randn(tokens, topk, generator=gen), -1).to(DEV)
        got, want = (fused_moe_triton(x, bank, ids, rw, "silu", emap.to(DEV), tiles,
                                      quant_a=qa, down_sum=inter == 256).cpu()
                     for qa in (True, False))
        assert torch.equal(got, want)


@pytest.mark.parametrize("value,mode", [("", 0), ("0", 0), ("1", 1), ("on", 1), ("early", 2)])
def test_pdl_switch(value, mode, monkeypatch):
    """FREETOKEN_GPU_PDL: off unless asked; never on where kernels cannot run it (here: the
    interpreter, or a CPU-only machine)."""
    from freetoken import env
    from freetoken.kernels.triton import pdl

    monkeypatch.setenv("FREETOKEN_GPU_PDL", value)
    assert env.gpu_pdl() == mode
    opts = pdl.opts()
    assert opts["launch_pdl"] == (opts["PDL"] > 0)
    if not CUDA or mode == 0:
        assert opts == {"PDL": 0, "launch_pdl": False}


def test_pdl_switch_refuses_other_values(monkeypatch):
    """A value the switch does not know is an error naming it, not silently off."""
    from freetoken import env

    monkeypatch.setenv("FREETOKEN_GPU_PDL", "2")
    with pytest.raises(ValueError, match="FREETOKEN_GPU_PDL='2'"):
        env.gpu_pdl()


@pytest.mark.skipif(not CUDA, reason="programmatic dependent launch runs on the GPU only")
@pytest.mark.parametrize("value", ["1", "early"])
def test_pdl_same_bits(value, monkeypatch):
    """A chain of decode kernels (norm writing codes, a linear and the fused MoE reading them,
    the MoE's gate/up, down and sum) gives the same bits launched programmatically dependent
    as one after the other: every kernel waits for the one before it."""
    gen = torch.Generator().manual_seed(8)
    qd, _ = _weight("nvfp4", 5)
    bank = ExpertBank(cases.to_device(cases.random_weight("nvfp4", gen, 512, K, (8,)), DEV),
                      cases.to_device(cases.random_weight("nvfp4", gen, K, 256, (8,)), DEV),
                      (torch.rand(8, 4, generator=gen) * 3e-2 + 1e-3).to(DEV))
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.rand(K, generator=gen) + 0.5).to(DEV)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(2)]).to(DEV)
    rw = torch.softmax(torch.randn(2, 3, generator=gen), -1).to(DEV)

    def chain():
        h = kernels.rms_norm(x, w, 1e-6, quantize=True)
        return h, triton_linear(h, qd), fused_moe_triton(h, bank, ids, rw, "silu")

    want = chain()
    monkeypatch.setenv("FREETOKEN_GPU_PDL", value)
    got = chain()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
