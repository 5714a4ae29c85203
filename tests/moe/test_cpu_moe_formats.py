"""Dots of the non-NVFP4 formats (bf16, f16, f32, fp8_block, mxfp4, GGUF Q4_0 / Q8_0 / Q4_K /
Q6_K) on each vectorized build of the portable kernels (scalar, avx2_fp32, avx512_fp32 and the
VNNI tiers that reuse them), against float64 references of the dequantized weights.

References: torch's own bf16/f16 -> float64 conversion; fp8 and mxfp4 decoded from the format
definitions (E4M3 table, E8M0 = 2^(b-127), E2M1); GGUF through gguf-py's numpy
`gguf.quants.dequantize` (bit-exact with llama.cpp). Float formats take fp32 activations; GGUF
integer formats take activations quantized to int8 per 32 values (like llama.cpp's q8_0), done
here in numpy by the rule. Bound: |err| <= (K/16 + 8) * 2^-22 * sum|w*a| (fp32 rounding of the
block products and a fixed-order sum; gguf-py's fp32 dequant adds one more ulp per weight).
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from cpu_moe_cases import E2M1, e4m3_values, quant_int8_blocks, special_activation

from freetoken import _cpu_moe
from freetoken.formats.qweight import QuantWeight
from freetoken.moe.cpu_executor import CpuMoeExecutor

HOST_TIERS = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
TIERS = [t for t in ("scalar", "avx2_fp32", "avx2_vnni", "avx512_fp32", "avx512_vnni")
         if t in HOST_TIERS]
N = 300  # 3 fp8 row blocks, the last partial
Q = gguf.GGMLQuantizationType


def _randint(gen, shape, lo, hi) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32)


def make_float(fmt: str, gen, K: int):
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[fmt]
    data = torch.randn(2, N, K, generator=gen).to(dt)
    return QuantWeight(data, fmt, (2, N, K)), data[1].double().numpy()


def make_fp8(gen, K: int):
    b = _randint(gen, (2, N, K), 0, 256)
    b = torch.where((b & 0x7F) == 0x7F, 0x38, b).to(torch.uint8)  # no NaN codes
    nb = (2, -(-N // 128), -(-K // 128))
    s = torch.rand(nb, generator=gen) * 2 + 0.01
    w = QuantWeight(b.view(torch.float8_e4m3fn), "fp8_block", (2, N, K), scales=s)
    ref = e4m3_values()[b[1].numpy()] * np.repeat(np.repeat(s[1].double().numpy(), 128, 0),
                                                  128, 1)[:N, :K]
    return w, ref


def make_mxfp4(gen, K: int):
    codes = _randint(gen, (2, N, K // 2), 0, 256).to(torch.uint8)
    e8 = _randint(gen, (2, N, K // 32), 120, 134).to(torch.uint8)
    w = QuantWeight(codes, "mxfp4", (2, N, K), scales=e8)
    c = codes[1].numpy()
    vals = E2M1[np.stack([c & 15, c >> 4], -1).reshape(N, K)]
    return w, vals * np.repeat(2.0 ** (e8[1].numpy().astype(np.float64) - 127), 32, 1)


# byte offsets of the fp16 scale fields in each block (set to sane values; the rest random)
GGUF_FIELDS = {Q.Q4_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def make_gguf(qtype, gen, K: int, n: int = N):
    bs, bb = gguf.GGML_QUANT_SIZES[qtype]
    raw = _randint(gen, (2, n, K // bs, bb), 0, 256).to(torch.uint8).numpy()
    for off in GGUF_FIELDS[qtype]:
        d = (np.random.default_rng(K + off).random((2, n, K // bs)) * 0.02 + 1e-3)
        raw[..., off:off + 2] = d.astype(np.float16).view(np.uint8).reshape(2, n, K // bs, 2)
    data = torch.from_numpy(raw.reshape(2, n, K // bs * bb).copy())
    w = QuantWeight(data, "gguf", (2, n, K), ggml_type=int(qtype))
    ref = gguf.quants.dequantize(raw[1].reshape(n, -1), qtype).astype(np.float64)
    return w, ref


CASES = {
    "f32": (lambda g, K: make_float("f32", g, K), [200, 2048], False),
    "f16": (lambda g, K: make_float("f16", g, K), [200, 2048], False),
    "bf16": (lambda g, K: make_float("bf16", g, K), [200, 2048], False),
    "fp8_block": (make_fp8, [320, 2048], False),
    "mxfp4": (make_mxfp4, [736, 2048], False),
    "Q4_0": (lambda g, K: make_gguf(Q.Q4_0, g, K), [736, 2048], True),
    "Q8_0": (lambda g, K: make_gguf(Q.Q8_0, g, K), [736, 2048], True),
    "Q4_K": (lambda g, K: make_gguf(Q.Q4_K, g, K), [768, 2048], True),
    "Q6_K": (lambda g, K: make_gguf(Q.Q6_K, g, K), [768, 2048], True),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", list(CASES))
def test_format_dot_vs_float64(fmt: str, tier: str):
    make, ks, int8_acts = CASES[fmt]
    ex = CpuMoeExecutor(2, isa=tier)
    worst = 0.0
    for K in ks:
        gen = torch.Generator().manual_seed(K)
        w, W = make(gen, K)
        x = torch.randn(3, K, generator=gen)
        x[0, :32] = 0  # an all-zero activation block
        out = ex.expert_matmul(w, 1, x).numpy().astype(np.float64)  # [3, N]
        for t in range(3):
            if int8_acts:
                q, d = quant_int8_blocks(x[t].numpy(), 32)
                a = q.astype(np.float64) * np.repeat(d.astype(np.float64), 32)
            else:
                a = x[t].numpy().astype(np.float64)
            ref = W @ a
            err = np.abs(out[t] - ref)
            bound = (K / 16 + 8) * 2.0**-22 * (np.abs(W) @ np.abs(a))
            assert np.all(err <= bound), f"{fmt} {tier} K={K}: err {err.max():.3g}"
            worst = max(worst, err.max() / np.abs(ref).max())
    print(f"\n{fmt} on {tier}: max rel err {worst:.2e}")


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0"])
def test_gguf_dot_token_alone_same_bits(fmt: str, tier: str):
    """A token alone (one token: the kernels that take several rows at a time, Q4_K's and
    Q5_K's 4 rows on avx512_vnni) gets the same bits as in a call of three tokens (one row at a
    time), at row counts that leave 1-3 rows after the groups, on one and two threads (other
    row splits)."""
    for n, K in ((302, 2048), (13, 768)):
        gen = torch.Generator().manual_seed(n + K)
        w, _ = make_gguf(Q[fmt], gen, K, n)
        x = torch.randn(3, K, generator=gen)
        together = CpuMoeExecutor(1, isa=tier).expert_matmul(w, 1, x)
        for threads in (1, 2):
            ex = CpuMoeExecutor(threads, isa=tier)
            for t in range(3):
                alone = ex.expert_matmul(w, 1, x[t:t + 1])[0]
                assert torch.equal(alone, together[t]), f"{fmt} {tier} {n}x{K} token {t}"


@pytest.mark.parametrize("tier", TIERS)
def test_q4k_activation_is_q8_32_in_lane_order(tier: str):
    """The avx512_vnni tier's Q4_K activations are the Q8_32 ones with each super-block's 256
    int8 values reordered for its dot's lanes (lane j of vector v: values 16 (j % 2) + 4 v ..
    + 3 of sub-block j / 2), scales and sums as they were; the other tiers' are Q8_32 as is."""
    K = 768
    x = special_activation(torch.Generator().manual_seed(3), K)
    ex = CpuMoeExecutor(1, isa=tier)
    q8 = ex.prepared_activation(x, "Q8_0").numpy()
    q4k = ex.prepared_activation(x, "Q4_K").numpy()
    assert np.array_equal(q4k[K:], q8[K:])
    if tier != "avx512_vnni":
        assert np.array_equal(q4k, q8)
        return
    v, j, i = np.meshgrid(np.arange(4), np.arange(16), np.arange(4), indexing="ij")
    src = (32 * (j // 2) + 16 * (j % 2) + 4 * v + i).reshape(-1)  # byte 64 v + 4 j + i's value
    want = q8[:K].reshape(-1, 256)[:, src].reshape(-1)
    assert np.array_equal(q4k[:K], want)
    assert not np.array_equal(q4k[:K], q8[:K])  # the order is not the identity


def test_removed_gfni_switch_is_refused(monkeypatch):
    """FREETOKEN_CPU_MOE_NO_GFNI chose between two Q4_K kernels that no longer exist: set, the
    executor says so rather than run as if it did something."""
    monkeypatch.setenv("FREETOKEN_CPU_MOE_NO_GFNI", "1")
    with pytest.raises(ValueError, match="FREETOKEN_CPU_MOE_NO_GFNI was removed"):
        CpuMoeExecutor(1)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("K", [32, 736, 2048])
def test_q8_32_activation_quant_matches_the_rule(tier: str, K: int):
    """The GGUF formats' int8 activations (Q8_32: int8 q[K], fp32 d[K/32], int32 sum[K/32]) on
    every tier, SIMD ones included, bit for bit the numpy rule: all-zero blocks, blocks below
    3.7e-37 (zeros) and half-way values x * 127 / amax = n + 0.5 (round half to even)."""
    gen = torch.Generator().manual_seed(K)
    x = special_activation(gen, K)
    if K == 32:
        x[0] = 127.0  # 127 / amax = 1: the other values are n + 0.5 exactly
        x[1:] = torch.arange(31, dtype=torch.float32) - 14.5
    raw = CpuMoeExecutor(1, isa=tier).prepared_activation(x, "Q8_0").numpy()
    q = raw[:K].view(np.int8)
    d = raw[K : K + K // 8].view(np.float32)
    s = raw[K + K // 8 : K + K // 4].view(np.int32)
    q_ref, d_ref = quant_int8_blocks(x.numpy(), 32)
    assert np.array_equal(q, q_ref) and np.array_equal(d, d_ref)
    assert np.array_equal(s, q_ref.astype(np.int32).reshape(-1, 32).sum(1))
    if K >= 64:
        assert not q[:32].any() and d[0] == 0 and s[0] == 0  # the zero / sub-3.7e-37 block


@pytest.mark.parametrize("tier", TIERS)
def test_q6k_activation_adds_sums_per_16(tier: str):
    """The SIMD tiers' Q6_K activations: the Q8_32 bytes of every GGUF format, then int32 sums
    of each 16 int8 values (the Q6_K dots take the codes' -32 from them); the scalar tier's are
    Q8_32 alone."""
    K = 768
    x = special_activation(torch.Generator().manual_seed(2), K)
    ex = CpuMoeExecutor(1, isa=tier)
    q8 = ex.prepared_activation(x, "Q8_0").numpy()
    q6 = ex.prepared_activation(x, "Q6_K").numpy()
    assert np.array_equal(q6[: q8.size], q8)
    if tier == "scalar":
        assert q6.size == q8.size
        return
    s16 = q6[q8.size:].view(np.int32)
    assert np.array_equal(s16, q8[:K].view(np.int8).astype(np.int32).reshape(-1, 16).sum(1))


def test_mixed_formats_layer_thread_invariant():
    """A Q4_K gate/up bank with a Q6_K down bank (a Q4_K_M file): 1 vs 3 threads identical."""
    from freetoken.moe.reference import moe_reference

    gen = torch.Generator().manual_seed(0)
    w13, _ = make_gguf(Q.Q4_K, gen, 256, n=512)  # [2, 2I = 512, H = 256]
    w2, _ = make_gguf(Q.Q6_K, gen, 256, n=256)  # [2, H = 256, I = 256]
    x = torch.randn(4, 256, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0]])
    r = torch.rand(4, 2, generator=gen)
    scales = torch.ones(2, 4)
    one = CpuMoeExecutor(1).forward(x, ids, r, w13, w2, scales)
    many = CpuMoeExecutor(3).forward(x, ids, r, w13, w2, scales)
    assert torch.equal(one, many)
    ref = moe_reference(x, ids, r, w13, w2, scales)
    err = float((one - ref).abs().max() / ref.abs().max())
    print(f"\nQ4_K/Q6_K layer vs torch reference: {err:.2e}")
    assert err < 2e-2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
