"""Whole MoE layers on real trained weights and real activations, against the float64 reference.

No MoE checkpoint ships as a package, so the experts are the MLPs of eight decoder layers of a
packaged real model, each GLU with its own: SmolLM2-135M-Instruct for silu (hidden 576,
intermediate 1536) and Gemma 3 270M for gelu_tanh (hidden 640, intermediate 2048), their GGUF
weights dequantized and quantized again by the ModelOpt NVFP4 recipe (gate and up each with
its own second-level scale, or every second-level scale 1). The input is what one middle
layer's MLP sees (its pre-MLP norm output) for a real prompt, captured by running the model.
K = 576 / 640 is 36 / 40 blocks of 16, so the 16-lane dot runs two whole groups and a masked
tail of 4 / 8 blocks, the 8-lane one whole groups and a 4-block tail (576).

The bar is the issue's (and the seed's, measured on real experts): max |error| / max
|reference| below 1e-2, where the reference dequantizes the NVFP4 weights and computes in
float64 with unquantized activations. The W4A8 tiers' int8 activations are the whole
difference; on real activations they stay inside it, unlike the N(0, 1) layers of
test_cpu_moe_layer.py.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from freetoken import _cpu_moe, assets
from freetoken.engine.llm import LLM
from freetoken.engine.sampling_params import SamplingParams
from freetoken.formats.dequant import dequantize
from freetoken.formats.modelopt_quantize import quantize_nvfp4
from freetoken.formats.qweight import QuantWeight
from freetoken.moe.cpu_executor import CpuMoeExecutor
from freetoken.moe.reference import moe_reference

HOST_TIERS = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
# activation -> (packaged model, the layers whose MLPs are the experts, the layer whose MLP
# input is x): SmolLM2 has 30 layers, Gemma 3 270M 18.
MODELS = {
    "silu": (assets.smollm2_path, (4, 8, 12, 15, 18, 22, 26, 29), 15),
    "gelu_tanh": (assets.gemma3_270m_path, (1, 3, 5, 7, 9, 11, 13, 15), 9),
}
TOPK = 4
PROMPT = ("The CPU computes the experts that miss the GPU cache where they live, in host memory; "
          "decode speed is set by how close it gets to the memory read bandwidth.")


def nvfp4_bank(ws: list[torch.Tensor], with_scale2: bool) -> tuple[QuantWeight, torch.Tensor]:
    """Stack [N, K] float weights into an NVFP4 bank [E, N, K] and their second-level scales
    (amax / (6 * 448) per matrix, or 1: the block scales then carry the whole range)."""
    one = None if with_scale2 else torch.tensor(1.0)
    codes, scales, scale2 = zip(*(quantize_nvfp4(w, one) for w in ws))
    E, (N, K) = len(ws), ws[0].shape
    bank = QuantWeight(torch.stack(codes), "nvfp4", (E, N, K), scales=torch.stack(scales))
    return bank, torch.stack(scale2)


@functools.lru_cache(maxsize=2)
def real_weights(activation: str):
    """The input layer's MLP input for PROMPT [T, H] and the float MLP weights of the expert
    layers (gate, up [I, H] and down [H, I] each) of the model for `activation`."""
    path, expert_layers, input_layer = MODELS[activation]
    llm = LLM(str(path()))
    layers = llm.engine.model.model.layers
    assert layers[input_layer].mlp.act is layers[0].mlp.act
    seen = []
    hook = layers[input_layer].mlp.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].detach().float().clone()))
    try:
        llm.generate(PROMPT, SamplingParams(max_tokens=1))
    finally:
        hook.remove()
    inter = layers[0].mlp.intermediate
    gates, ups, downs = [], [], []
    for i in expert_layers:
        mlp = layers[i].mlp
        (gu,), (down,) = mlp.gate_up_proj.weights, mlp.down_proj.weights
        gu = dequantize(gu).float()
        gates.append(gu[:inter]), ups.append(gu[inter:]), downs.append(dequantize(down).float())
    return seen[0], gates, ups, downs


@functools.lru_cache(maxsize=4)
def real_layer(activation: str, with_scale2: bool):
    """The NVFP4 layer: x, w13 [E, 2I, H], w2 [E, H, I], scales [E, 4] = (gate, up, down, 1)."""
    x, gates, ups, downs = real_weights(activation)
    gate, s_g = nvfp4_bank(gates, with_scale2)
    up, s_u = nvfp4_bank(ups, with_scale2)
    w2, s_d = nvfp4_bank(downs, with_scale2)
    E, inter, H = gate.shape
    w13 = QuantWeight(torch.cat([gate.data, up.data], 1), "nvfp4", (E, 2 * inter, H),
                      scales=torch.cat([gate.scales, up.scales], 1))
    scales = torch.stack([s_g, s_u, s_d, torch.ones(E)], dim=1)
    return x, w13, w2, scales


@pytest.mark.parametrize("tier", [t for t in ("avx512_vnni", "avx2_vnni", "avx512_fp32",
                                               "scalar") if t in HOST_TIERS])
@pytest.mark.parametrize("with_scale2", [False, True], ids=["no-scale2", "scale2"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_real_experts_within_1e_2(tier: str, T: int, activation: str, with_scale2: bool):
    x_all, w13, w2, scales = real_layer(activation, with_scale2)
    assert x_all.shape[0] >= 2 * T and x_all.shape[1] == w13.shape[2]
    gen = torch.Generator().manual_seed(T)
    x = x_all[T : 2 * T].contiguous()  # past the first token, whose activations are outliers
    E = w13.shape[0]
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)])
    route = torch.softmax(torch.randn(T, TOPK, generator=gen), dim=-1)
    ref = moe_reference(x, ids, route, w13, w2, scales, activation)
    out = CpuMoeExecutor(2, isa=tier).forward(x, ids, route, w13, w2, scales, activation)
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max())
    print(f"\n{tier} T={T} {activation} scale2={with_scale2}: max|err| / max|ref| = {err:.2e}")
    assert err < 1e-2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
