"""The executor's GLU per tier (SIMD tiers: a polynomial exp) against float64 math.

silu(x) * y = x / (1 + e^-x) * y and gelu_tanh(x) * y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
x^3))) * y, on x from -100 to 100 (the exp's clamp at -87.3 / 88.4 included), with the scales
applied to x and y first. Tolerance: |out - ref| <= 2e-6 |ref| + 1e-6 (a few fp32 ulp; the
absolute part covers gelu's far negative tail, where 1 + tanh falls below fp32's resolution of
1 and both the SIMD and the libm forms return ~1e-7 or 0 for values ~1e-7).
"""

from __future__ import annotations

import sys

import pytest
import torch

from freetoken import _cpu_moe
from freetoken.moe.cpu_executor import CpuMoeExecutor

HOST_TIERS = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]


def reference(x: torch.Tensor, y: torch.Tensor, activation: str) -> torch.Tensor:
    x, y = x.double(), y.double()
    if activation == "silu":
        a = x / (1 + torch.exp(-x))
    else:
        a = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
    return a * y


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tier", HOST_TIERS)
def test_glu_matches_float64(tier: str, activation: str):
    gen = torch.Generator().manual_seed(0)
    g = torch.cat([torch.randn(997, generator=gen) * s for s in (0.1, 1.0, 4.0, 30.0)]
                  + [torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 89.0, -89.0, 100.0,
                                   -100.0])])
    u = torch.randn(g.shape[0], generator=gen)
    s_gate, s_up = 0.75, 1.5
    out = CpuMoeExecutor(1, isa=tier).glu(g, u, s_gate, s_up, activation)
    ref = reference(g * s_gate, u * s_up, activation)
    err = (out.double() - ref).abs()
    bound = 2e-6 * ref.abs() + 1e-6
    worst = int((err - bound).argmax())
    print(f"\n{tier} {activation}: max |err| {err.max():.2e}, "
          f"max rel {float((err / ref.abs().clamp_min(1e-3)).max()):.2e}")
    assert bool((err <= bound).all()), (g[worst].item(), out[worst].item(), ref[worst].item())
    assert torch.isfinite(out).all()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
