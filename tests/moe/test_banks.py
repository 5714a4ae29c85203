"""Expert banks and the fused MoE entry point.

- `fused_moe`'s torch path (`fused_moe_reference`, fp32) against a float64 reference written
  here from the contract (`y[t] = sum_j r * (glu(x Wg^T s_gate, x Wu^T s_up) @ Wd^T s_down)`)
  with weights from the NVFP4 definition (cpu_moe_cases.nvfp4_f64) or gguf-py's numpy
  `gguf.quants` (Q8_0), random positive scales far from 1, silu and gelu_tanh, batches 1, 3
  and 8. Tolerance 1e-5 of max |reference|: fp32 accumulation over K <= 256 against float64.
- stacking per-expert weights and building banks: shapes, scales columns (gate, up, down, 1),
  and the errors for mixed formats, bad shapes and per-expert scales on a merged gate+up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import cpu_moe_cases as cases  # noqa: E402

from freetoken.formats.errors import FormatError  # noqa: E402
from freetoken.formats.qweight import QuantWeight  # noqa: E402
from freetoken.kernels.moe import fused_moe, fused_moe_reference  # noqa: E402
from freetoken.moe.banks import (  # noqa: E402
    ExpertBank,
    bank_from_merged,
    build_bank,
    stack_experts,
)
from freetoken.moe.reference import glu  # noqa: E402

E, H, INTER, K = 6, 128, 64, 2
TOL = 1e-5


def _q8_0(gen: torch.Generator, e: int, n: int, k: int) -> tuple[QuantWeight, np.ndarray]:
    w = (torch.randn(e, n, k, generator=gen) * 0.1).numpy()
    raw = gguf.quants.quantize(w.reshape(-1, k), gguf.GGMLQuantizationType.Q8_0)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(e, n, k)
    qw = QuantWeight(torch.from_numpy(raw.reshape(e, n, -1).copy()), "gguf", (e, n, k),
                     ggml_type=int(gguf.GGMLQuantizationType.Q8_0))
    return qw, ref.astype(np.float64)


def _bank(fmt: str, gen: torch.Generator) -> tuple[ExpertBank, np.ndarray, np.ndarray]:
    if fmt == "nvfp4":
        w13, w2 = cases.random_nvfp4(gen, E, 2 * INTER, H), cases.random_nvfp4(gen, E, H, INTER)
        r13, r2 = cases.nvfp4_f64(w13), cases.nvfp4_f64(w2)
    else:
        (w13, r13), (w2, r2) = _q8_0(gen, E, 2 * INTER, H), _q8_0(gen, E, H, INTER)
    scales = torch.ones(E, 4)
    scales[:, :3] = torch.rand(E, 3, generator=gen) * 3e-2 + 1e-3
    return ExpertBank(w13, w2, scales), r13, r2


def _reference(x, ids, w, r13, r2, scales, act) -> np.ndarray:
    x, s = x.double(), scales.double()
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.from_numpy(r13[e]) @ x[t]
            a = glu(h[:INTER] * s[e, 0], h[INTER:] * s[e, 1], act)
            out[t] += float(w[t, j]) * (torch.from_numpy(r2[e]) @ a) * s[e, 2]
    return out.numpy()


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("fmt", ["nvfp4", "q8_0"])
def test_fused_moe_matches_float64(fmt, act, batch):
    gen = torch.Generator().manual_seed(hash((fmt, act, batch)) % 2**31)
    bank, r13, r2 = _bank(fmt, gen)
    x = torch.randn(batch, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(batch)])
    w = torch.softmax(torch.randn(batch, K, generator=gen), -1)
    y = fused_moe_reference(x, bank, ids, w, act).double().numpy()
    ref = _reference(x, ids, w, r13, r2, bank.scales, act)
    err = np.abs(y - ref).max() / np.abs(ref).max()
    print(f"{fmt} {act} batch {batch}: {err:.2e}")
    assert err <= TOL
    bank.scales.fill_(1.0)  # dropping the scales must show
    y1 = fused_moe_reference(x, bank, ids, w, act).double().numpy()
    assert np.abs(y1 - ref).max() / np.abs(ref).max() > 0.5


def test_fused_moe_checks_arguments():
    bank, _, _ = _bank("nvfp4", torch.Generator().manual_seed(0))
    x = torch.randn(2, H)
    with pytest.raises(ValueError, match="out of range"):
        fused_moe(x, bank, torch.tensor([[0, E]]).expand(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"x must be \[T, 128\]"):
        fused_moe(torch.randn(2, 64), bank, torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))


def _f32(e_out_in, s2=None, name="w") -> QuantWeight:
    return QuantWeight(torch.randn(*e_out_in), "f32", tuple(e_out_in), scale2=s2, source=name)


def test_stack_and_build_bank_scales():
    gates = [_f32((INTER, H), torch.tensor(0.5 + e)) for e in range(E)]
    ups = [_f32((INTER, H)) for _ in range(E)]  # no scale: ones
    downs = [_f32((H, INTER), torch.tensor(2.0)) for _ in range(E)]
    g, u, d = stack_experts(gates), stack_experts(ups), stack_experts(downs)
    assert g.shape == (E, INTER, H) and u.scale2 is None and g.scale2.shape == (E,)
    bank = build_bank(g, u, d)
    assert bank.w13.shape == (E, 2 * INTER, H) and bank.w13.scale2 is None
    assert torch.equal(bank.w13.data[3, :INTER], gates[3].data)
    assert torch.equal(bank.w13.data[3, INTER:], ups[3].data)
    want = torch.tensor([[0.5 + e, 1.0, 2.0, 1.0] for e in range(E)])
    assert torch.equal(bank.scales, want) and bank.has_scales()


def test_bank_errors_name_the_tensor():
    a, b = _f32((INTER, H), name="e0"), QuantWeight(torch.zeros(INTER, H, dtype=torch.bfloat16),
                                                    "bf16", (INTER, H), source="e1")
    with pytest.raises(FormatError, match="e1.*experts differ"):
        stack_experts([a, b])
    g = _f32((E, INTER, H), name="gate")
    with pytest.raises(FormatError, match="do not fit"):
        build_bank(g, g, _f32((E, H, INTER + 16), name="down"))
    merged = _f32((E, 2 * INTER, H), torch.ones(E), name="blk.0.ffn_gate_up_exps")
    with pytest.raises(FormatError, match="ffn_gate_up_exps.*merged gate.up"):
        bank_from_merged(merged, _f32((E, H, INTER)))
    ok = bank_from_merged(_f32((E, 2 * INTER, H), torch.tensor(3.0)), _f32((E, H, INTER)))
    assert torch.equal(ok.scales[:, :2], torch.full((E, 2), 3.0))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
