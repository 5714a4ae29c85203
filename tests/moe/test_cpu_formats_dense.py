"""The dense models' GGUF formats in the CPU executor: the dots of Q4_1, Q5_0, Q5_1, Q5_K and GGUF
MXFP4 on every ISA tier this CPU has, and `dequant_rows` (the prefill path's row decoder) of every
format, against references nobody here wrote.

Dots: against a float64 dot of gguf-py's numpy `dequantize` of the same blocks with the same
int8 activations (quantized per 32 by the rule, cpu_moe_cases.quant_int8_blocks). Weights from
gguf-py's `quantize` where it has the type (Q4_1, Q5_0, Q5_1, MXFP4), random valid blocks (random
bytes, finite fp16 scales) for Q5_K. The dots are exact in int32 per block; what is left is fp32
rounding: the block factor d * da, one FMA per block and a chain sum of K/32 terms, the min terms
(m * da * sum(a), two roundings and a sum) and gguf-py's own fp32 d * q + m. Each costs a few ulp
of |d * q * a| or |m * a|, so |err| <= (K/16 + 8) * 2^-22 * sum((|w - m| + |m|) * |a|), m the
block's min term (the value of a code of 0, got by dequantizing the blocks with their codes
cleared; 0 for the formats without one): the bound of test_cpu_moe_formats.py with the min
term's magnitude added (w = d * q + m can cancel, its parts do not).

dequant_rows: bit for bit (as uint32) gguf-py's dequantize for the GGUF types, with fully random
finite fp16 scales (subnormal to 65504, both signs) so that any fused or reordered fp32 step would
show; the float formats against their definitions (exact products).
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from cpu_moe_cases import E2M1, e4m3_values, nvfp4_f64, quant_int8_blocks, random_nvfp4

from freetoken import _cpu_moe
from freetoken.formats.qweight import QuantWeight
from freetoken.moe.cpu_executor import CpuMoeExecutor

HOST_TIERS = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
TIERS = [t for t in ("scalar", "avx2_fp32", "avx2_vnni", "avx512_fp32", "avx512_vnni")
         if t in HOST_TIERS]
Q = gguf.GGMLQuantizationType
N = 40  # rows (the dots split them in runs of 4: 40 = 10 runs, 2 threads)
NEW = [Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.MXFP4]
GGUF = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4]
# byte offsets of each type's fp16 fields (scales and mins) and of its codes
F16_FIELDS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
              Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.MXFP4: []}
CODES = {Q.Q4_1: slice(4, None), Q.Q5_0: slice(2, None), Q.Q5_1: slice(4, None),
         Q.Q5_K: slice(16, None), Q.MXFP4: slice(1, None)}


def as_weight(raw: np.ndarray, qtype, K: int) -> QuantWeight:
    """uint8 blocks [n, K / bs * bb] as a one-expert bank [1, n, K]."""
    data = torch.from_numpy(np.ascontiguousarray(raw).reshape(1, raw.shape[0], -1))
    return QuantWeight(data, "gguf", (1, raw.shape[0], K), ggml_type=int(qtype))


def random_blocks(qtype, rng: np.random.Generator, n: int, K: int, wild: bool) -> np.ndarray:
    """Random bytes with finite fp16 fields: scales of 1e-3..2e-2 (positive), or, when `wild`,
    any finite fp16 (subnormals to 65504, both signs)."""
    bs, bb = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, K // bs, bb), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        if wild:
            h = rng.integers(0, 1 << 16, (n, K // bs), dtype=np.uint16)
            h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h)  # inf / NaN -> exponent 0
        else:
            h = (rng.random((n, K // bs)) * 0.02 + 1e-3).astype(np.float16).view(np.uint16)
        raw[..., off:off + 2] = h.view(np.uint8).reshape(n, K // bs, 2)
    return raw.reshape(n, -1)


def dense_weight(qtype, rng: np.random.Generator, K: int) -> np.ndarray:
    if qtype == Q.Q5_K:  # gguf-py cannot quantize it
        return random_blocks(qtype, rng, N, K, wild=False)
    return gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), qtype)


def min_terms(raw: np.ndarray, qtype) -> np.ndarray:
    """Each value's min term (d * 0 + m, or -dmin * m): the blocks dequantized with codes 0."""
    if qtype not in (Q.Q4_1, Q.Q5_1, Q.Q5_K):
        return np.zeros((raw.shape[0], 1))
    bs, bb = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, bb).copy()
    blocks[..., CODES[qtype]] = 0
    return gguf.quants.dequantize(blocks.reshape(raw.shape[0], -1), qtype).astype(np.float64)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_new_format_dot_vs_float64(qtype, tier: str):
    ex = CpuMoeExecutor(2, isa=tier)
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    worst = 0.0
    for K in ([768, 2048] if bs == 256 else [96, 736, 2048]):
        rng = np.random.default_rng(K)
        raw = dense_weight(qtype, rng, K)
        W = gguf.quants.dequantize(raw, qtype).astype(np.float64)
        parts = np.abs(W - min_terms(raw, qtype)) + np.abs(min_terms(raw, qtype))
        x = torch.from_numpy(rng.standard_normal((5, K)).astype(np.float32))  # token groups 4 + 1
        x[0, :32] = 0  # an all-zero activation block
        w = as_weight(raw, qtype, K)
        out = ex.expert_matmul(w, 0, x)
        assert torch.equal(out, ex.expert_matmul(w, 0, x, threads=1))  # thread-count invariant
        out = out.numpy().astype(np.float64)
        for t in range(5):
            q, d = quant_int8_blocks(x[t].numpy(), 32)
            a = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32)
            ref = W @ a
            err = np.abs(out[t] - ref)
            bound = (K / 16 + 8) * 2.0**-22 * (parts @ np.abs(a))
            assert np.all(err <= bound), f"{qtype.name} {tier} K={K} t={t}: err {err.max():.3g}"
            worst = max(worst, err.max() / np.abs(ref).max())
    print(f"\n{qtype.name} on {tier}: max rel err {worst:.2e}")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("qtype", GGUF, ids=lambda q: q.name)
def test_dequant_rows_bit_exact_gguf(qtype, tier: str):
    ex = CpuMoeExecutor(2, isa=tier)
    K = 512 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 224
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, rng, N, K, wild=True)
    with np.errstate(over="ignore"):  # MXFP4 scale byte 255 (2^127) times 12 is inf, as in ggml
        ref = gguf.quants.dequantize(raw, qtype)
    w = as_weight(raw, qtype, K)
    for r0, r1 in [(0, N), (3, 29), (7, 7)]:
        got = ex.dequant_rows(w, 0, r0, r1)
        assert got.shape == (r1 - r0, K)
        assert ex.dequant_rows(w, 0, r0, r1, out=torch.full((r1 - r0, K), 7.0)).equal(got)
        assert np.array_equal(bits(got.numpy()), bits(ref[r0:r1])), f"{qtype.name} {tier} {r0}:{r1}"


def float_cases(gen: torch.Generator, K: int):
    """(QuantWeight [2, N, K], float64 [N, K] of expert 1 from the definition)."""
    for fmt, dt in (("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)):
        data = torch.randn(2, N, K, generator=gen).to(dt)
        yield QuantWeight(data, fmt, (2, N, K)), data[1].double().numpy()
    w = random_nvfp4(gen, 2, N, K, signed=True)
    yield w, nvfp4_f64(w)[1]
    codes = torch.randint(0, 256, (2, N, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    e8 = torch.randint(100, 160, (2, N, K // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    c = codes[1].numpy()
    vals = E2M1[np.stack([c & 15, c >> 4], -1).reshape(N, K)]
    yield (QuantWeight(codes, "mxfp4", (2, N, K), scales=e8),
           vals * np.repeat(2.0 ** (e8[1].numpy().astype(np.float64) - 127), 32, 1))
    b = torch.randint(0, 256, (2, N, K), generator=gen, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, 0x38, b).to(torch.uint8)  # no NaN codes
    s = torch.rand(2, 1, -(-K // 128), generator=gen) * 2 + 0.01
    # one fp32 rounding of an exact float64 product (4 x 24 significant bits) = the fp32 product
    ref = (e4m3_values()[b[1].numpy()]
           * np.repeat(s[1].double().numpy(), 128, 1)[:, :K]).astype(np.float32)
    yield QuantWeight(b.view(torch.float8_e4m3fn), "fp8_block", (2, N, K), scales=s), ref


@pytest.mark.parametrize("tier", TIERS)
def test_dequant_rows_float_formats(tier: str):
    ex = CpuMoeExecutor(2, isa=tier)
    K = 352  # not a multiple of 256: a partial segment
    for w, ref in float_cases(torch.Generator().manual_seed(1), K):
        got = ex.dequant_rows(w, 1, 5, N)
        assert np.array_equal(bits(got.numpy()), bits(ref[5:])), f"{w.fmt} {tier}"


def test_dequant_rows_checks_rows():
    raw = random_blocks(Q.Q5_0, np.random.default_rng(0), N, 64, wild=False)
    ex = CpuMoeExecutor(1)
    with pytest.raises(ValueError, match="r0 <= r1"):
        ex.dequant_rows(as_weight(raw, Q.Q5_0, 64), 0, 5, N + 1)
    with pytest.raises(ValueError, match="expert"):
        ex.dequant_rows(as_weight(raw, Q.Q5_0, 64), 1, 0, 1)
    with pytest.raises(ValueError, match="out: shape"):
        ex.dequant_rows(as_weight(raw, Q.Q5_0, 64), 0, 0, 2, out=torch.empty(3, 64))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
