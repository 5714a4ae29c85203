"""NVFP4 dots of every ISA tier this CPU has, against float64 references from the definition.

W4A8 tiers (avx512_vnni, avx2_vnni) are checked against a float64 dot of the exact decoded
weights with the *same* int8-quantized activations (quantized here in numpy from the rule);
fp32 W4A16 tiers (avx512_fp32, avx2_fp32, scalar) against the float64 dot with the fp32
activations. The only error left is fp32 rounding of the block products and their sum:
each term is rounded a few times (<= 3 ulp) and a row sums K/128 (W4A8) or K/16 (fp32 lanes)
terms per lane plus a 16-lane tree, so |err| <= (K/16 + 8) * 2^-23 * sum|w*a|. Printed: the
max relative error |err| / max|ref| per case (the seed's kernels reach 1.8e-7).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from cpu_moe_cases import (
    nvfp4_f64,
    quant_int8_blocks,
    random_nvfp4,
    special_activation,
    unpack_nvfp4_q8,
)

from freetoken import _cpu_moe
from freetoken.moe.cpu_executor import TIERS, CpuMoeExecutor, nvfp4_q8_reference

HOST_TIERS = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
KS = [48, 752, 2048, 5120]  # 752 = 47 blocks: partial chunks and scalar tails


def tier_param(t: str):
    return pytest.param(t, marks=pytest.mark.skipif(t not in HOST_TIERS, reason=f"CPU lacks {t}"))


# The avx512_vnni tier runs a vpermb dot where the CPU has AVX-512 VBMI; FREETOKEN_CPU_MOE_NO_VBMI
# selects its vpshufb dot (the one CPUs without VBMI, e.g. Cascade Lake, run).
TIER_VARIANTS = [tier_param(t) for t in TIERS] + [
    pytest.param("avx512_vnni/no-vbmi", marks=pytest.mark.skipif(
        "avx512_vnni" not in HOST_TIERS, reason="CPU lacks avx512_vnni"))]


def executor(monkeypatch, variant: str, threads: int = 2) -> CpuMoeExecutor:
    tier, _, opt = variant.partition("/")
    if opt == "no-vbmi":
        monkeypatch.setenv("FREETOKEN_CPU_MOE_NO_VBMI", "1")
    ex = CpuMoeExecutor(threads, isa=tier)
    assert ex.isa == tier
    return ex


@pytest.mark.parametrize("signed", [False, True], ids=["pos-scales", "signed-scales"])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("variant", TIER_VARIANTS)
def test_nvfp4_dot_vs_float64(monkeypatch, variant: str, K: int, signed: bool):
    tier = variant.partition("/")[0]
    gen = torch.Generator().manual_seed(K * 2 + signed)
    w = random_nvfp4(gen, 2, 37, K, signed=signed)
    x = torch.stack([special_activation(gen, K), torch.randn(K, generator=gen)])  # [2, K]
    ex = executor(monkeypatch, variant)
    out = ex.expert_matmul(w, 1, x).numpy().astype(np.float64)  # [2, 37]
    W = nvfp4_f64(w)[1]  # [37, K]
    worst = 0.0
    for t in range(2):
        if tier.endswith("vnni"):
            q, d = quant_int8_blocks(x[t].numpy(), 16)
            a = q.astype(np.float64) * np.repeat(d.astype(np.float64), 16)
        else:
            a = x[t].numpy().astype(np.float64)
        ref = W @ a
        err = np.abs(out[t] - ref)
        bound = (K / 16 + 8) * 2.0**-23 * (np.abs(W) @ np.abs(a))
        assert np.all(err <= bound), f"{tier} K={K}: err {err.max():.3g} > bound"
        worst = max(worst, err.max() / np.abs(ref).max())
    print(f"\n{tier} K={K} {'signed' if signed else 'positive'} scales: max rel err {worst:.2e}")
    assert worst < 1e-6


@pytest.mark.parametrize("K", [752, 2048])
@pytest.mark.parametrize("variant", TIER_VARIANTS)
def test_nvfp4_dot_independent_of_token_count(monkeypatch, variant: str, K: int):
    """A row's result must not depend on how many tokens (1..9) or rows (37: groups of 4 or 2
    plus a tail) share the call: the kernels group rows and tokens by count, but each (row,
    token) keeps its own arithmetic, so results are bit-identical to the one-token call."""
    gen = torch.Generator().manual_seed(K + 5)
    w = random_nvfp4(gen, 2, 37, K, signed=True)
    x = torch.randn(9, K, generator=gen)
    ex = executor(monkeypatch, variant)
    alone = torch.cat([ex.expert_matmul(w, 0, x[t : t + 1]) for t in range(9)])
    for T in (2, 3, 4, 5, 9):
        assert torch.equal(ex.expert_matmul(w, 0, x[:T]), alone[:T]), f"{variant} T={T}"
    if variant == "avx512_vnni":  # the vpermb and vpshufb dots agree bit for bit
        assert torch.equal(executor(monkeypatch, variant + "/no-vbmi").expert_matmul(w, 0, x),
                           alone)


@pytest.mark.parametrize("tier", [tier_param("avx512_vnni"), tier_param("avx2_vnni")])
@pytest.mark.parametrize("K", [16, 48, 752, 2048])
def test_simd_activation_quant_matches_scalar(tier: str, K: int):
    """Same int8 values and scales as the scalar quant and as the rule (numpy), including
    all-zero blocks and blocks with absmax below ~3.7e-37 (zeros)."""
    gen = torch.Generator().manual_seed(K)
    x = special_activation(gen, K)
    if K == 16:
        x[:] = 3.0e-37  # below 127 / FLT_MAX: zeros
    ex = CpuMoeExecutor(1, isa=tier)
    lanes = 16 if tier == "avx512_vnni" else 8  # the dot's int32 lanes, one block each
    simd = ex.prepared_activation(x, "nvfp4")
    assert torch.equal(simd, nvfp4_q8_reference(x, lanes))
    q, d = unpack_nvfp4_q8(simd, K, lanes)
    q_ref, d_ref = quant_int8_blocks(x.numpy(), 16)
    assert np.array_equal(q, q_ref) and np.array_equal(d, d_ref)
    if K >= 64:
        assert not q[:32].any() and not d[:2].any()  # zero and sub-3.7e-37 blocks
        assert np.abs(q[32:48]).max() == 127  # 4e-37 still quantizes
    if K == 16:
        assert not q.any() and not d.any()


@pytest.mark.parametrize(
    "env,expect",
    [
        ({}, "avx512_vnni"),
        ({"FREETOKEN_CPU_MOE_ISA": "avx512"}, "avx512_vnni"),
        ({"FREETOKEN_CPU_MOE_ISA": "avx2"}, "avx2_vnni"),
        ({"FREETOKEN_CPU_MOE_ISA": "scalar"}, "scalar"),
        ({"FREETOKEN_CPU_MOE_NO_VNNI": "1"}, "avx512_fp32"),
        ({"FREETOKEN_CPU_MOE_ISA": "avx2", "FREETOKEN_CPU_MOE_NO_VNNI": "1"}, "avx2_fp32"),
        ({"FREETOKEN_CPU_MOE_NO_AVX512VNNI": "1"}, "avx2_vnni"),
    ],
)
def test_env_switches_pick_the_tier(monkeypatch, env: dict, expect: str):
    if not {"avx512_vnni", "avx2_vnni"} <= set(HOST_TIERS):
        pytest.skip("expectations written for a CPU with AVX-512 VNNI and AVX-VNNI")
    for k in ("FREETOKEN_CPU_MOE_ISA", "FREETOKEN_CPU_MOE_NO_VNNI",
              "FREETOKEN_CPU_MOE_NO_AVX512VNNI"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert CpuMoeExecutor(1).isa == expect


def test_bad_isa_names(monkeypatch):
    with pytest.raises(ValueError, match="isa must be"):
        CpuMoeExecutor(1, isa="sse9")
    monkeypatch.setenv("FREETOKEN_CPU_MOE_ISA", "avx1024")
    with pytest.raises(ValueError, match="FREETOKEN_CPU_MOE_ISA"):
        CpuMoeExecutor(1)

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
