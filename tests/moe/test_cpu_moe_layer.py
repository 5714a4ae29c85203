"""Whole MoE layers on the CPU executor against the torch float64 reference (moe_reference).

Experts are N(0, 1/K) weights quantized by the ModelOpt NVFP4 recipe (with per-expert
second-level scales, or with scale2 = 1), inputs N(0, 1). The W4A8 tiers' int8 activations
(per 16 values, rounding error <= amax / 254) dominate the error against the
dequantize-then-float64 truth. The issue's bar, max|err| / max|ref| < 1e-2 as the seed measured
on real experts, is checked on real experts in test_cpu_moe_real_experts.py; here the executor
is pinned to a float64 model of its own W4A8 math. Results must be bit-identical with 1 and N
threads.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from cpu_moe_cases import w4a8_layer_model

from freetoken import _cpu_moe
from freetoken.formats.modelopt_quantize import quantize_nvfp4
from freetoken.formats.qweight import QuantWeight
from freetoken.moe.cpu_executor import CpuMoeExecutor
from freetoken.moe.reference import moe_reference

HOST_TIERS = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
E, H, INTER, TOPK = 8, 256, 752, 4
# Against the unquantized reference. On these N(0, 1) layers the int8 activations alone (the
# W4A8 float64 model shows the same) cost 0.8-1.5e-2; real experts and activations stay below
# 1e-2 (test_cpu_moe_real_experts.py).
REF_BAR = 2e-2


def quantized_bank(gen: torch.Generator, N: int, K: int, with_scales: bool):
    """E experts of N(0, 1/K) weights quantized to NVFP4 by the ModelOpt recipe; returns the
    bank and each expert's second-level scale (1 when with_scales is False)."""
    codes, sc, s2 = [], [], []
    for _ in range(E):
        w = torch.randn(N, K, generator=gen) / K**0.5
        c, s, z = quantize_nvfp4(w, None if with_scales else torch.tensor(1.0))
        codes.append(c), sc.append(s), s2.append(z)
    bank = QuantWeight(torch.stack(codes), "nvfp4", (E, N, K), scales=torch.stack(sc))
    return bank, torch.stack(s2)


@functools.lru_cache(maxsize=4)
def make_layer(seed: int, with_scales: bool):
    """Experts as a quantized checkpoint has them: gate and up quantized separately (each
    with its own scale2), then stacked into w13; scales [E, 4] = (gate, up, down, 1)."""
    gen = torch.Generator().manual_seed(seed)
    gate, s_g = quantized_bank(gen, INTER, H, with_scales)
    up, s_u = quantized_bank(gen, INTER, H, with_scales)
    w2, s_d = quantized_bank(gen, H, INTER, with_scales)
    w13 = QuantWeight(torch.cat([gate.data, up.data], 1), "nvfp4", (E, 2 * INTER, H),
                      scales=torch.cat([gate.scales, up.scales], 1))
    scales = torch.stack([s_g, s_u, s_d, torch.ones(E)], dim=1)
    return w13, w2, scales


def routing(gen: torch.Generator, T: int):
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
    r = torch.softmax(torch.randn(T, TOPK, generator=gen), dim=-1)
    return ids, r


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("with_scales", [False, True], ids=["no-scale2", "scale2"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_layer_matches_reference_and_thread_count(T: int, activation: str, with_scales: bool):
    w13, w2, scales = make_layer(0, with_scales)
    gen = torch.Generator().manual_seed(T * 10 + with_scales)
    x = torch.randn(T, H, generator=gen)
    ids, r = routing(gen, T)
    ref = moe_reference(x, ids, r, w13, w2, scales, activation)
    ex1, exn = CpuMoeExecutor(1), CpuMoeExecutor(3)
    one = ex1.forward(x, ids, r, w13, w2, scales, activation)
    many = exn.forward(x, ids, r, w13, w2, scales, activation)
    err = rel_err(one, ref)
    msg = f"\n{ex1.isa} T={T} {activation} scale2={with_scales}: vs torch reference {err:.2e}"
    if ex1.isa.endswith("vnni"):
        model = w4a8_layer_model(x, ids, r, w13, w2, scales, activation)
        err_model = rel_err(one, model)
        print(f"{msg}; W4A8 float64 model vs reference {rel_err(model, ref):.2e}; "
              f"executor vs W4A8 model {err_model:.2e}")
        # The executor's fp32 GLU output and the model's float64 one may round to different
        # int8 values where they sit at a half-way point: one such flip moves the output by
        # about 1e-5 of its max; a wrong lane, block or scale costs 1e-3 or more.
        assert err_model < 1e-4
    else:
        print(msg)
    assert err < REF_BAR
    assert torch.equal(one, many), "result depends on the thread count"
    # 15 threads (the GPU host's count): small work items, many "last finisher" races
    wide = CpuMoeExecutor(15).forward(x, ids, r, w13, w2, scales, activation)
    assert torch.equal(one, wide), "result depends on the thread count (15)"


def test_prefill_batch_equals_tokens_one_at_a_time():
    """A batch whose input the pool quantizes (T * H > 8192) against the same tokens one at a
    time (quantized by the caller inside the layer's run): bit for bit the same, since a row's
    dot does not depend on how many tokens share it, and each token's sum is its own."""
    w13, w2, scales = make_layer(0, True)
    gen = torch.Generator().manual_seed(11)
    T = 40
    assert T * H > 8192
    x = torch.randn(T, H, generator=gen)
    ids, r = routing(gen, T)
    ex = CpuMoeExecutor(3)
    batch = ex.forward(x, ids, r, w13, w2, scales, "silu")
    single = torch.cat([ex.forward(x[t:t + 1], ids[t:t + 1], r[t:t + 1], w13, w2, scales, "silu")
                        for t in range(T)])
    assert torch.equal(batch, single)
    assert rel_err(batch, moe_reference(x, ids, r, w13, w2, scales, "silu")) < REF_BAR


@pytest.mark.parametrize("tier", [t for t in ("avx2_vnni", "avx512_fp32", "avx2_fp32", "scalar")
                                  if t in HOST_TIERS])
def test_layer_other_tiers(tier: str):
    w13, w2, scales = make_layer(0, True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, H, generator=gen)
    ids, r = routing(gen, 3)
    one = CpuMoeExecutor(1, isa=tier).forward(x, ids, r, w13, w2, scales, "gelu_tanh")
    many = CpuMoeExecutor(2, isa=tier).forward(x, ids, r, w13, w2, scales, "gelu_tanh")
    if tier.endswith("vnni"):
        assert rel_err(one, w4a8_layer_model(x, ids, r, w13, w2, scales, "gelu_tanh")) < 1e-5
    else:  # fp32 W4A16: fp32 rounding only
        assert rel_err(one, moe_reference(x, ids, r, w13, w2, scales, "gelu_tanh")) < 1e-5
    assert torch.equal(one, many)


def test_bf16_output_and_repeated_expert():
    w13, w2, scales = make_layer(0, False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, H, generator=gen)
    ids = torch.tensor([[5, 5, 1, 0], [2, 7, 3, 5]])  # token 0 routes to expert 5 twice
    r = torch.rand(2, TOPK, generator=gen)
    ex = CpuMoeExecutor(2)
    f32 = ex.forward(x, ids, r, w13, w2, scales)
    b16 = ex.forward(x, ids, r, w13, w2, scales, out_dtype=torch.bfloat16)
    assert b16.dtype == torch.bfloat16
    assert torch.equal(b16, f32.to(torch.bfloat16))  # round to nearest even, like torch
    assert rel_err(f32, moe_reference(x, ids, r, w13, w2, scales)) < REF_BAR


def test_bad_arguments():
    w13, w2, scales = make_layer(0, False)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, H, generator=gen)
    ids, r = routing(gen, 2)
    ex = CpuMoeExecutor(1)

    def bad(match: str, **kw):
        args = dict(x=x, expert_ids=ids, route_weights=r, w13=w13, w2=w2, scales=scales)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            ex.forward(**args)

    bad("x: dtype must be torch.float32", x=x.double())
    bad("x: must be contiguous", x=torch.randn(H, 2).t())
    bad("x: expected a \\[T, H\\]", x=torch.randn(H))
    bad("expert_ids: dtype", expert_ids=ids.float())
    bad("expert_ids\\[1, 2\\] = 8 is outside \\[0, 8\\)",
        expert_ids=torch.tensor([[0, 1, 2, 3], [0, 1, 8, 3]]))
    bad("route_weights: shape must be \\[2, 4\\]", route_weights=r[:, :2].contiguous())
    bad("scales: shape must be \\[8, 4\\]", scales=scales[:4].contiguous())
    bad("w2: shape must be", w2=w13)
    bad("w13: in_features 256 must equal", x=torch.randn(2, 128))
    bad("activation must be one of", activation="relu")
    bad("out_dtype must be", out_dtype=torch.float16)
    bad("w13.scales: dtype must be torch.float8_e4m3fn",
        w13=QuantWeight(w13.data, "nvfp4", w13.shape, scales=w13.scales.view(torch.uint8)))
    bad("w13.data: shape must be",
        w13=QuantWeight(w13.data[:, :, :64].contiguous(), "nvfp4", w13.shape, scales=w13.scales))
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        CpuMoeExecutor(0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
