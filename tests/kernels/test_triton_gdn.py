"""The gated delta-net decode kernels (kernels/triton/gdn.py) against float64 math written
from the layer's definition (layers/gdn.py's docstring; its torch helpers `l2norm` and
`recurrent_step` run in float64 here).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1). Tolerances:
- fp32 projection: |err| <= 1e-4 (|ref| + 1) on the output and the states: each value is a
  sum of at most dk = 64 fp32 products of O(1) terms plus a few exp / sqrt, ~1e-6 relative;
  the bound leaves a hundredfold margin and still fails on any wrong index, gate or order;
- bf16 projection: the output is rounded three times as the torch path rounds it (o before
  the norm, the norm's output, y), each 2^-9 relative (2^-8 under the interpreter, which
  truncates): 4 * 2^-8 |ref| + 1e-3;
- slots the step does not name are left bit for bit.
The one-launch step (`_fused_kernel`) against the three launches: bit for bit under the
interpreter (the same helpers in the same order); compiled, the two may round apart (FMA
contraction, reduction layouts), so there within 1e-5 (2^-7 for bf16 outputs).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).parent))
import triton_cases as cases  # noqa: E402

from freetoken.kernels import xq  # noqa: E402
from freetoken.kernels.triton import gdn as kernels  # noqa: E402
from freetoken.kernels.triton.arrive import counters  # noqa: E402
from freetoken.kernels.triton.gdn import gdn_decode  # noqa: E402
from freetoken.layers.gdn import GDNSpec, l2norm, recurrent_step  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(proj, s: GDNSpec, conv_w, neg_a, dt_bias, norm_w, conv, ssm, slots, positions):
    """float64: (y [B, value_dim], conv, ssm after the step)."""
    conv, ssm = conv.double().clone(), ssm.double().clone()
    mixed, z, b, a = proj.double().split([s.conv_dim, s.value_dim, s.num_v_heads,
                                          s.num_v_heads], dim=-1)
    beta = torch.sigmoid(b)
    g = neg_a.double() * F.softplus(a + dt_bias.double())
    prev, state = conv[slots], ssm[slots]
    if positions is not None:
        keep = (positions > 0).double()
        prev, state = prev * keep[:, None, None], state * keep[:, None, None, None]
    win = torch.cat([prev, mixed[..., None]], dim=-1)
    conv[slots] = win[..., 1:]
    c = F.silu((win * conv_w.double()).sum(-1))
    q, k, v = c.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
    q = l2norm(q.reshape(-1, s.num_k_heads, s.head_k_dim)) * s.head_k_dim ** -0.5
    k = l2norm(k.reshape(-1, s.num_k_heads, s.head_k_dim))
    r = s.num_v_heads // s.num_k_heads
    q, k = ((t.repeat(1, r, 1) if s.v_tiled else t.repeat_interleave(r, dim=1))
            for t in (q, k))
    o = recurrent_step(q, k, v.reshape(-1, s.num_v_heads, s.head_v_dim), g, beta, state)
    ssm[slots] = state
    n = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + s.norm_eps) * norm_w.double()
    y = n * F.silu(z.reshape(o.shape))
    return y.reshape(proj.shape[0], s.value_dim), conv, ssm


def _case(spec: GDNSpec, B: int, num_slots: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    width = spec.conv_dim + spec.value_dim + 2 * spec.num_v_heads
    # a wider tensor's columns: the projection may be a strided view
    proj = (torch.randn(B, width + 8, generator=gen) * 2)[:, 3:3 + width].to(dtype)
    conv_w = torch.randn(spec.conv_dim, spec.conv_kernel, generator=gen) * 0.5
    neg_a = -torch.rand(spec.num_v_heads, generator=gen) * 2
    dt_bias = torch.randn(spec.num_v_heads, generator=gen)
    norm_w = torch.rand(spec.head_v_dim, generator=gen) + 0.5
    conv = torch.randn(num_slots, *spec.state_shapes()[0], generator=gen)
    ssm = torch.randn(num_slots, *spec.state_shapes()[1], generator=gen) * 0.3
    return proj, conv_w, neg_a, dt_bias, norm_w, conv, ssm


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_positions", [True, False])
def test_decode_step_matches_float64(fused: bool, tiled: bool, dtype: torch.dtype,
                                     with_positions: bool) -> None:
    spec = GDNSpec(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=64,
                   head_v_dim=64, conv_kernel=4, norm_eps=1e-6, v_tiled=tiled)
    proj, conv_w, neg_a, dt_bias, norm_w, conv, ssm = _case(spec, 3, 5, 11 + tiled, dtype)
    slots = torch.tensor([2, 0, 3])
    positions = torch.tensor([5, 0, 7]) if with_positions else None  # row 1 starts over
    y_ref, conv_ref, ssm_ref = _reference(proj, spec, conv_w, neg_a, dt_bias, norm_w, conv,
                                          ssm, slots, positions)
    dconv, dssm = conv.to(DEV), ssm.to(DEV)
    y = gdn_decode(proj.to(DEV), spec, conv_w.to(DEV), neg_a.to(DEV), dt_bias.to(DEV),
                   norm_w.to(DEV), dconv, dssm, slots.to(DEV),
                   None if positions is None else positions.to(DEV), fused=fused)
    assert y.dtype == dtype and y.shape == (3, spec.value_dim)

    def close(got, ref, rel, abs_):
        err = (got.cpu().double() - ref).abs()
        bound = rel * ref.abs() + abs_
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"

    if dtype == torch.float32:
        close(y, y_ref, 1e-4, 1e-4)
    else:
        close(y, y_ref, 4 * 2.0 ** -8, 1e-3)
    close(dconv, conv_ref, 1e-4, 1e-4)
    close(dssm, ssm_ref, 1e-4, 1e-4)
    untouched = [1, 4]
    assert torch.equal(dconv.cpu()[untouched], conv[untouched])
    assert torch.equal(dssm.cpu()[untouched], ssm[untouched])


def test_decode_step_codes_for_out_proj() -> None:
    """With `quantize`, the gated norm also stores y's int8 codes for out_proj's GEMV, attached
    to y: exactly the quantizer's codes of the stored y (each head writes its blocks of the
    row), and y is the same as without them."""
    spec = GDNSpec(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=64,
                   head_v_dim=64, conv_kernel=4, norm_eps=1e-6, v_tiled=False)
    proj, conv_w, neg_a, dt_bias, norm_w, conv, ssm = _case(spec, 3, 5, 21, torch.bfloat16)
    slots = torch.tensor([2, 0, 3])
    args = [t.to(DEV) for t in (proj, conv_w, neg_a, dt_bias, norm_w)]
    ys = []
    for quantize in (True, False):
        ys.append(gdn_decode(args[0], spec, *args[1:], conv.clone().to(DEV),
                             ssm.clone().to(DEV), slots.to(DEV), None, quantize=quantize))
    q = xq.attached(ys[0])
    assert q is not None and xq.attached(ys[1]) is None
    cases.check_codes(q, ys[0])
    assert torch.equal(ys[0].cpu(), ys[1].cpu())


def _both_paths(spec: GDNSpec, case, slots, positions, quantize: bool = True):
    """The step through the three launches and through the fused one, on copies of the
    same states: {fused: (y, codes, conv, ssm)}, and the fused path's counters are zero."""
    proj, conv_w, neg_a, dt_bias, norm_w, conv, ssm = (t.to(DEV) for t in case)
    out = {}
    for fused in (False, True):
        dconv, dssm = conv.clone(), ssm.clone()
        y = gdn_decode(proj, spec, conv_w, neg_a, dt_bias, norm_w, dconv, dssm, slots.to(DEV),
                       None if positions is None else positions.to(DEV), quantize=quantize,
                       fused=fused)
        out[fused] = (y, xq.attached(y), dconv, dssm)
    for use in ("gdn_qk", "gdn_norm"):  # reset by the last arrivers: a graph replay starts at 0
        assert not counters(use, kernels.FUSED_COUNTERS, proj.device).any(), use
    return out


def _check_same(out, dtype: torch.dtype, quantize: bool = True) -> None:
    """The fused path's y, codes and states are the three launches' (see the docstring)."""
    (y3, q3, c3, s3), (y1, q1, c1, s1) = out[False], out[True]
    assert (q1 is not None) == quantize and (q3 is not None) == quantize
    if DEV == "cpu":
        for name, a, b in (("y", y1, y3), ("conv", c1, c3), ("ssm", s1, s3)) + (
                (("codes", q1, q3),) if quantize else ()):
            assert torch.equal(a, b), name
        return
    rel = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y1.float(), y3.float(), rtol=rel, atol=rel)
    torch.testing.assert_close(c1, c3, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s3, rtol=1e-5, atol=1e-5)
    if quantize:
        cases.check_codes(q1, y1)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("with_positions", [True, False])
def test_fused_step_same_as_three_launches(tiled: bool, dtype: torch.dtype, batch: int,
                                           with_positions: bool) -> None:
    """Two value heads per key head (R = 2) of two value blocks each: the q/k conv state
    of a key head is read by four programs and shifted by the last (a first arriver's
    shift would feed the others the shifted state); one row starts over at position 0."""
    spec = GDNSpec(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=64,
                   head_v_dim=64, conv_kernel=4, norm_eps=1e-6, v_tiled=tiled)
    case = _case(spec, batch, 5, 31 + 2 * batch + tiled, dtype)
    slots = torch.tensor([2, 0, 3][:batch])
    positions = torch.tensor([5, 0, 7] if batch == 3 else [0]) if with_positions else None
    out = _both_paths(spec, case, slots, positions)
    _check_same(out, dtype)
    untouched = [s for s in range(5) if s not in slots.tolist()]
    for fused in (False, True):
        assert torch.equal(out[fused][2].cpu()[untouched], case[5][untouched])
        assert torch.equal(out[fused][3].cpu()[untouched], case[6][untouched])


def test_fused_step_twice_on_the_states_it_left() -> None:
    """Four value heads on one key head (R = 4) of four value blocks, dk != dv, no codes: two
    steps in a row, each on the states the paths left (so a counter not reset to zero by the
    first call would leave the second's q/k state unshifted and its heads unnormed)."""
    spec = GDNSpec(hidden_size=64, num_k_heads=1, num_v_heads=4, head_k_dim=32,
                   head_v_dim=128, conv_kernel=4, norm_eps=1e-6)
    slots = torch.tensor([3, 1])
    case = _case(spec, 2, 4, 41, torch.bfloat16)
    for step in range(2):
        out = _both_paths(spec, case, slots, torch.tensor([step, 4 + step]), quantize=False)
        _check_same(out, torch.bfloat16, quantize=False)
        proj = _case(spec, 2, 4, 42 + step, torch.bfloat16)[0]
        case = (proj, *case[1:5], out[True][2].cpu(), out[True][3].cpu())


def test_fused_only_within_the_counters(monkeypatch) -> None:
    """`FREETOKEN_GPU_GDN_FUSED=0` and batches of more (sequence, value head) pairs than
    FUSED_COUNTERS take the three launches; by default the one."""
    spec = GDNSpec(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                   head_v_dim=16, conv_kernel=4)
    args = [t.to(DEV) for t in _case(spec, 3, 3, 51, torch.float32)]

    class Refused:
        def __getitem__(self, grid):
            raise AssertionError("the fused kernel was launched")

    def step():
        gdn_decode(args[0], spec, *args[1:], torch.arange(3, device=DEV), None)

    monkeypatch.setattr(kernels, "_fused_kernel", Refused())
    with pytest.raises(AssertionError, match="fused kernel"):
        step()
    monkeypatch.setenv("FREETOKEN_GPU_GDN_FUSED", "0")
    step()
    monkeypatch.delenv("FREETOKEN_GPU_GDN_FUSED")
    monkeypatch.setattr(kernels, "FUSED_COUNTERS", 3 * 4 - 1)
    step()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="Triton's interpreter (CPU tensors) is on only on CPU-only hosts")
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_engine_greedy_same_through_the_kernels(arch: str, monkeypatch) -> None:
    """The tiny qwen3.5 models (heads of 32) through the engine: 32 greedy tokens for three
    batched prompts are the same whether the decode steps' GDN layers run the torch path or
    these kernels (under Triton's interpreter), float32 on the CPU: the kernels' wiring into
    the layer (projection columns, states, slots, restarts). On a GPU host the kernels run
    compiled in every qwen3.5 decode step; the tests above check their numbers there."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_qwen3_5 as tq

    from freetoken import SamplingParams
    from freetoken.engine.llm import LLM
    from freetoken.layers import gdn

    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    out = {}
    for triton_path in (False, True):
        monkeypatch.setattr(gdn, "TRITON_ON_CPU", triton_path)
        llm = LLM(str(tq.hf_dir(arch)), device="cpu", dtype="float32", show_progress=False,
                  max_running_requests=4)
        out[triton_path] = [r.token_ids for r in llm.generate(tq.prompts(), greedy)]
        del llm
    assert out[True] == out[False]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
