"""The Triton fused MoE against the torch reference (`freetoken.kernels.moe`'s CPU path), with
slot indirection (`expert_map`, some experts at -1), silu and gelu_tanh, the [E, 4] scales far
from 1, decode sizes (per-route GEMV, no sort) and bigger batches (device-side sort / align,
tl.dot tiles), and mixed formats (a Q4_K_M bank keeps down in Q6_K).

Reference values are float64 math on the codecs' weights (the torch path's own fp32 result is
checked against the same bound). Tolerance per output: the down projection sums I products of
|a| |w| (the GLU output a is itself an fp32 sum of H products): fp32 activations 2 (H + I) eps
sum|route| |s_down| (|a| |Wd|)^T; bf16 (CUDA) 2^-6 of it (bf16 weights and a in the dots).
Without CUDA the kernels run in Triton's interpreter on small shapes with wide row blocks.
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

from freetoken.formats.dequant import dequantize  # noqa: E402
from freetoken.kernels.moe import fused_moe, fused_moe_reference  # noqa: E402
from freetoken.kernels.triton.moe import _align, fused_moe_triton  # noqa: E402
from freetoken.moe.banks import ExpertBank  # noqa: E402
from freetoken.moe.reference import glu  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
E, TOPK = 8, 3
H, INTER = (1024, 512) if CUDA else (256, 256)


def _bank(f13: str, f2: str, gen: torch.Generator) -> ExpertBank:
    scales = torch.ones(E, 4)
    scales[:, :3] = torch.rand(E, 3, generator=gen) * 3e-2 + 1e-3
    return ExpertBank(cases.random_weight(f13, gen, 2 * INTER, H, (E,)),
                      cases.random_weight(f2, gen, H, INTER, (E,)), scales)


def _reference(x, bank, ids, w, emap, act):
    """float64 result and the error scale sum_j |r| |s_down| (|a| @ |Wd|^T) per output."""
    w13, w2 = dequantize(bank.w13).double(), dequantize(bank.w2).double()
    s = bank.scales.double()
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    mag = torch.zeros_like(out)
    for t in range(x.shape[0]):
        for j in range(TOPK):
            e = int(ids[t, j])
            if emap[e] < 0:
                continue
            h = w13[e] @ x[t].double()
            a = glu(h[:INTER] * s[e, 0], h[INTER:] * s[e, 1], act)
            r = float(w[t, j]) * s[e, 2]
            out[t] += r * (w2[e] @ a)
            mag[t] += abs(r) * (w2[e].abs() @ a.abs())
    return out, mag


def _case(f13, f2, tokens, act, seed):
    gen = torch.Generator().manual_seed(seed)
    bank = _bank(f13, f2, gen)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, TOPK, generator=gen), -1)
    emap = torch.arange(E, dtype=torch.int32)
    emap[torch.tensor([2, 5])] = -1  # computed elsewhere: must add nothing
    ref, mag = _reference(x, bank, ids, w, emap, act)
    return bank, x, ids, w, emap, ref, mag


def _check(y, ref, mag, fp32: bool):
    factor = 2 * (H + INTER) * torch.finfo(torch.float32).eps if fp32 else 2.0**-6
    err = (y.double().cpu() - ref).abs()
    bound = factor * mag + 1e-30
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.2f}"


# (w13 format, w2 format, tokens, activation, tiles under the interpreter)
CASES = [("nvfp4", "nvfp4", 1, "silu", (1, 64, 256, 4)),
         ("Q4_K", "Q6_K", 2, "gelu_tanh", (1, 128, 256, 4)),
         ("Q8_0", "Q8_0", 12, "silu", (16, 64, 128, 4)),
         ("Q4_K", "Q4_K", 9, "silu", (16, 128, 256, 4)),
         ("bf16", "bf16", 1, "silu", (1, 128, 256, 4))]


@pytest.mark.parametrize("f13,f2,tokens,act,tiles", CASES)
def test_triton_moe_matches_reference(f13, f2, tokens, act, tiles):
    bank, x, ids, w, emap, ref, mag = _case(f13, f2, tokens, act, tokens * 31 + len(f13))
    _check(fused_moe_reference(x, bank, ids, w, act, emap), ref, mag, True)  # the CPU oracle
    dev_bank = ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                          bank.scales.to(DEV))
    y = fused_moe_triton(x.to(DEV), dev_bank, ids.to(DEV), w.to(DEV), act, emap.to(DEV),
                         None if CUDA else tiles)
    _check(y, ref, mag, True)


@pytest.mark.parametrize("f13,f2,tokens,act,tiles", [CASES[0], CASES[2]])
def test_strided_scales_read_in_place(f13, f2, tokens, act, tiles):
    """A slot pool's scales are a strided view (each slot's row sits inside its bytes): the
    kernels read them through the row stride and give the contiguous copy's bits, with
    garbage between the rows never read."""
    bank, x, ids, w, emap, ref, mag = _case(f13, f2, tokens, act, tokens * 7 + len(f2))
    rows = torch.full((E, 12), float("nan"))
    rows[:, 5:9] = bank.scales
    strided = rows.to(DEV)[:, 5:9]
    assert strided.stride(0) == 12
    w13, w2 = cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV)
    args = (x.to(DEV), ids.to(DEV), w.to(DEV), act, emap.to(DEV), None if CUDA else tiles)
    y = fused_moe_triton(args[0], ExpertBank(w13, w2, strided), *args[1:])
    want = fused_moe_triton(args[0], ExpertBank(w13, w2, bank.scales.to(DEV)), *args[1:])
    assert torch.equal(y.cpu(), want.cpu())
    _check(y, ref, mag, True)


@pytest.mark.parametrize("f13,f2,tokens,act,tiles", [c for c in CASES if c[4][0] == 1])
def test_down_kernel_sums_as_the_sum_kernel(f13, f2, tokens, act, tiles, monkeypatch):
    """Decode: the token's routes summed by the down kernel's last-arriving program
    (`_arrive_and_sum`) are the separate sum kernel's bits (the same fp32 adds in route order,
    routes mapped to -1 adding their zero rows), on a second call too (counters reset)."""
    bank, x, ids, w, emap, ref, mag = _case(f13, f2, tokens, act, tokens * 31 + len(f13))
    dev_bank = ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                          bank.scales.to(DEV))
    args = (x.to(DEV), dev_bank, ids.to(DEV), w.to(DEV), act, emap.to(DEV),
            None if CUDA else tiles)
    monkeypatch.setenv("FREETOKEN_GPU_DOWN_SUM", "0")
    want = fused_moe_triton(*args).cpu()
    monkeypatch.delenv("FREETOKEN_GPU_DOWN_SUM")
    for _ in range(2):
        assert torch.equal(fused_moe_triton(*args).cpu(), want)


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("f13,f2,tokens,act,tiles", [CASES[0], CASES[1]])
def test_down_kernel_folds_the_next_residual_step(f13, f2, tokens, act, tiles, quantize,
                                                  monkeypatch):
    """Decode with a fold (`kernels/norm.py`: the next layer's residual step): the output is
    the plain call's, bit for bit, and carries the RMSNorm kernel's (y, s, codes) of it and the
    residual, computed by the last of each token's row blocks (`_arrive_and_norm`), which
    `add_rms_norm` returns; on a second call too (its counters reset). The codes are asked
    for on the CPU too (the interpreter)."""
    from freetoken.kernels import norm, xq
    from freetoken.kernels.triton.norm import rms_norm_triton

    if quantize and not CUDA:
        monkeypatch.setattr(xq, "wanted", lambda x: True)
    bank, x, ids, w, emap, ref, mag = _case(f13, f2, tokens, act, tokens * 13 + len(f13))
    dev_bank = ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                          bank.scales.to(DEV))
    args = (x.to(DEV), dev_bank, ids.to(DEV), w.to(DEV), act, emap.to(DEV),
            None if CUDA else tiles)
    gen = torch.Generator().manual_seed(tokens)
    res = torch.randn(tokens, H, generator=gen).to(DEV)
    weight = (torch.rand(H, generator=gen) + 0.5).to(DEV)
    want = fused_moe_triton(*args)
    # codes where an int8 GEMV would read them (a 16-bit activation on CUDA; forced on the CPU)
    ny, ns, nq = rms_norm_triton(want, weight, 1e-5, res,
                                 quantize=quantize and xq.wanted(want))
    for _ in range(2):
        got = fused_moe_triton(*args, norm_fold=norm.NormFold(res, weight, 1e-5, quantize))
        assert torch.equal(got, want)
        fy, fs = norm.add_rms_norm(got, res, weight, 1e-5, quantize)
        assert torch.equal(fy, ny) and torch.equal(fs, ns)
        if nq is not None:
            assert torch.equal(xq.attached(fy), nq)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["nvfp4", "Q4_K", "Q8_0", "mxfp4", "MXFP4", "fp8_block"])
@pytest.mark.parametrize("tokens", [1, 4, 16, 100])
def test_fused_moe_entry_point_bf16_cuda(fmt, tokens, monkeypatch):
    # the fp32 GEMV at decode sizes (the bound above); the int8 dots have their own test
    # (test_triton_gemv_i8.py)
    monkeypatch.setenv("FREETOKEN_GPU_INT8_DOT", "0")
    f2 = "Q6_K" if fmt == "Q4_K" else fmt
    bank, x, ids, w, emap, ref, mag = _case(fmt, f2, tokens, "silu", tokens + len(fmt))
    host = bank
    # quantized storage keeps its values on the device (Q8_0 is split into codes and scales
    # there, a layout the CPU's codecs do not read): the reference uses the host bank
    bank = bank.to(torch.bfloat16, DEV)
    xb = x.to(torch.bfloat16)
    ref, mag = _reference(xb.float(), host, ids, w, emap, "silu")
    y = fused_moe(xb.to(DEV), bank, ids.to(DEV), w.to(DEV), "silu", emap.to(DEV))
    _check(y.float(), ref, mag, False)


def _check_align(ids: torch.Tensor, emap: torch.Tensor | None, num_slots: int,
                 bm: int) -> torch.Tensor:
    """`_align`'s contract, in any order of a slot's routes: slots in increasing order, each
    slot's routes once each in the first places of its run, the run padded (value R) to whole
    blocks, every block of the run naming the slot, the unused blocks -1 at the end. Returns
    block_slot."""
    route_ids, block_slot = (t.cpu() for t in _align(ids.to(DEV), None if emap is None
                                                     else emap.to(DEV), num_slots, bm))
    flat = ids.reshape(-1)
    r = flat.numel()
    slots = flat if emap is None else emap[flat]
    blocks = -(-r // bm) + min(r, num_slots)
    assert route_ids.shape == (blocks * bm,) and block_slot.shape == (blocks,)
    pos = 0
    for s in range(num_slots):
        mine = sorted(torch.nonzero(slots == s).flatten().tolist())
        n_blocks = -(-len(mine) // bm)
        run = route_ids[pos:pos + n_blocks * bm].tolist()
        assert sorted(run[:len(mine)]) == mine and set(run[len(mine):]) <= {r}, s
        assert block_slot[pos // bm:pos // bm + n_blocks].tolist() == [s] * n_blocks
        pos += n_blocks * bm
    assert set(route_ids[pos:].tolist()) <= {r} and set(block_slot[pos // bm:].tolist()) <= {-1}
    return block_slot


def test_align_groups_routes_by_slot():
    # slot 0: routes 2, 6; slot 1: route 5 (+pad); slot 2: routes 0, 3 | 4 (+pad); 7 = padding
    ids = torch.tensor([[2], [3], [0], [2], [2], [1], [0]])
    emap = torch.tensor([0, 1, 2, -1], dtype=torch.int32)  # expert e -> slot; 3 is not here
    assert _check_align(ids, emap, 3, 2).tolist()[:4] == [0, 1, 2, 2]


@pytest.mark.parametrize("tokens,experts,bm,mapped", [(64, 16, 16, False), (200, 128, 64, False),
                                                      (37, 40, 16, True), (300, 2100, 32, True)])
def test_align_random_routes(tokens, experts, bm, mapped):
    """Random top-8 routes (several programs of routes; 2,100 slots: the start kernel's
    8-warp block of 4,096) with and without a map that sends some experts nowhere."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:8] for _ in range(tokens)])
    emap = None
    if mapped:
        emap = torch.randperm(experts, generator=gen).to(torch.int32)
        emap[torch.rand(experts, generator=gen) < 0.3] = -1
    _check_align(ids, emap, experts, bm)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_k_quant_gemv_refuses_other_chunks():
    """The fp32 per-route GEMV's K-quant dot reads one super-block a chunk: tiles asking for
    another chunk are refused by name, not computed wrong (they gave zeros for Q6_K)."""
    bank, x, ids, w, emap, _, _ = _case("Q4_K", "Q6_K", 1, "silu", 5)
    dev_bank = ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                          bank.scales.to(DEV))
    args = (x.to(DEV), dev_bank, ids.to(DEV), w.to(DEV), "silu", emap.to(DEV))
    with pytest.raises(ValueError, match="K-quant .* BK=256, got tiles with BK=128"):
        fused_moe_triton(*args, (1, 16, 128, 4))
