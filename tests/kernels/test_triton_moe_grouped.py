"""The grouped decode MoE (`freetoken.kernels.triton.moe_grouped`: routes grouped by slot on the
device, each expert's rows read once for all of its tokens).

fp32 kernels (fp32 activations, and formats without int8 dots): against float64 math on the
codecs' weights and against the torch reference `fused_moe` (the CPU path), with and without
the slot indirection (`expert_map`, some experts at -1), with experts picked by many tokens
(several groups of BT routes for one slot), and mixed formats (Q4_K gate/up, Q6_K down).
Tolerance per output, as in test_triton_moe.py: the down projection sums I products of
|a| |w| and a is itself an fp32 sum of H products: fp32 activations 2 (H + I) eps
sum|route| |s_down| (|a| |Wd|)^T (the kernels accumulate in fp32 in another association than
the reference); bf16 activations on CUDA: the same bound plus the bf16 rounding of the output,
2^-8 of it. Without CUDA the kernels run in Triton's interpreter on small shapes; with CUDA at
Qwen3-30B-A3B's (128 experts, hidden 2048, expert width 768, top-8) at 1, 4 and 16 tokens.

int8 kernels (bf16 activations; NVFP4, Q4_K, split Q8_0): the per-route int8 path's bits, per
route (the GLU output a, fp32 or its codes, and down's fp32 rows y) and for the layer's output:
the same integer dp4a sums, the same chunks in the same order and the same fp32 epilogue. In the
interpreter with the same row blocks and chunks both ways; timed on the GPU by
`benchmarks/bench_gpu_kernels.py --moe-grouped`.
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
from freetoken.kernels.triton import moe as tmoe  # noqa: E402
from freetoken.kernels.triton import moe_grouped  # noqa: E402
from freetoken.kernels.triton.formats import split_q8_0  # noqa: E402
from freetoken.kernels.triton.gemv_i8 import use_i8  # noqa: E402
from freetoken.kernels.triton.moe import fused_moe_triton  # noqa: E402
from freetoken.kernels.triton.moe_grouped import group_routes  # noqa: E402
from freetoken.moe.banks import ExpertBank, expert_weight  # noqa: E402
from freetoken.moe.reference import glu  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# (experts, top-k, hidden, expert width)
SHAPE = (128, 8, 2048, 768) if CUDA else (8, 3, 256, 256)


def _bank(f13: str, f2: str, gen: torch.Generator) -> ExpertBank:
    e, _, h, inter = SHAPE
    scales = torch.ones(e, 4)
    scales[:, :3] = torch.rand(e, 3, generator=gen) * 3e-2 + 1e-3
    return ExpertBank(cases.random_weight(f13, gen, 2 * inter, h, (e,)),
                      cases.random_weight(f2, gen, h, inter, (e,)), scales)


def _reference(x, bank, ids, w, emap, act, cache=None):
    """float64 output and the error scale sum_j |r| |s_down| (|a| @ |Wd|^T), per output; only
    the experts the routes touch are dequantized (once per `cache`, expert -> (w13, w2))."""
    inter = bank.intermediate
    s = bank.scales.double()
    out = torch.zeros(x.shape[0], bank.hidden, dtype=torch.float64)
    mag = torch.zeros_like(out)
    cache = {} if cache is None else cache
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if emap is not None and emap[e] < 0:
                continue
            if e not in cache:
                cache[e] = (dequantize(expert_weight(bank.w13, e)).double(),
                            dequantize(expert_weight(bank.w2, e)).double())
            w13, w2 = cache[e]
            h = w13 @ x[t].double()
            a = glu(h[:inter] * s[e, 0], h[inter:] * s[e, 1], act)
            r = float(w[t, j]) * s[e, 2]
            out[t] += r * (w2 @ a)
            mag[t] += abs(r) * (w2.abs() @ a.abs())
    return out, mag


def _routes(tokens: int, gen: torch.Generator, hot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k ids drawn from the first `hot` experts only (so experts repeat across tokens)."""
    e, k, _, _ = SHAPE
    hot = min(hot, e)
    ids = torch.stack([torch.randperm(hot, generator=gen)[:k] for _ in range(tokens)])
    ids = torch.randperm(e, generator=gen)[ids]  # the hot experts anywhere in the bank
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), -1)


def _check(y: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, extra: float = 0.0) -> None:
    _, _, h, inter = SHAPE
    factor = 2 * (h + inter) * torch.finfo(torch.float32).eps + extra
    err = (y.double().cpu() - ref).abs()
    bound = factor * mag + 1e-30
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.2f}"


def _device_bank(bank: ExpertBank) -> ExpertBank:
    return ExpertBank(cases.to_device(bank.w13, DEV), cases.to_device(bank.w2, DEV),
                      bank.scales.to(DEV))


# CPU (interpreter): (w13, w2, tokens, hot experts, activation, map, group tiles BT, BN, warps)
CPU_CASES = [("nvfp4", "nvfp4", 4, 4, "silu", True, (2, 64, 4)),
             ("Q4_K", "Q6_K", 5, 3, "gelu_tanh", False, (2, 128, 4)),
             ("Q8_0", "Q8_0", 6, 5, "silu", True, (4, 128, 4)),
             ("Q4_K", "Q4_K", 3, 8, "silu", True, (4, 128, 4)),
             ("bf16", "bf16", 2, 3, "silu", False, (2, 128, 4))]


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the CUDA test covers the real shape")
@pytest.mark.parametrize("f13,f2,tokens,hot,act,use_map,gtiles", CPU_CASES)
def test_grouped_matches_reference_interpreter(f13, f2, tokens, hot, act, use_map, gtiles):
    gen = torch.Generator().manual_seed(tokens * 7 + hot)
    bank = _bank(f13, f2, gen)
    x = torch.randn(tokens, SHAPE[2], generator=gen)
    ids, w = _routes(tokens, gen, hot)
    emap = None
    if use_map:
        emap = torch.arange(SHAPE[0], dtype=torch.int32)
        emap[ids[0, :2]] = -1  # computed elsewhere: must add nothing
    ref, mag = _reference(x, bank, ids, w, emap, act)
    _check(fused_moe_reference(x, bank, ids, w, act, emap), ref, mag)  # the torch oracle
    y = fused_moe_triton(x, _device_bank(bank), ids, w, act, emap, grouped=True,
                         group_tiles=gtiles)
    assert y.dtype == x.dtype, "the output is in x's dtype (fused_moe_triton's contract)"
    _check(y, ref, mag)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("f13,f2", [("nvfp4", "nvfp4"), ("Q4_K", "Q6_K")])
def test_grouped_matches_reference_cuda(f13, f2, monkeypatch):
    """Batch 1, 4, 16; uniform routing, 12 hot experts with a map, 9 hot experts without.
    The fp32 GEMVs (FREETOKEN_GPU_INT8_DOT=0) for the bf16 case too: the bound above is
    theirs; bf16 activations by default take int8 dots over x quantized per 32 values, whose
    bound test_triton_gemv_i8.py derives and checks (against it this check failed on the
    H200 by up to 1.28x)."""
    monkeypatch.setenv("FREETOKEN_GPU_INT8_DOT", "0")
    gen = torch.Generator().manual_seed(len(f13) * 10 + len(f2))
    bank = _bank(f13, f2, gen)  # one bank per format (drawing it is the slow part)
    dev_bank = _device_bank(bank)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for tokens in (1, 4, 16):
        x = torch.randn(tokens, SHAPE[2], generator=gen)
        for hot, use_map in ((SHAPE[0], False), (12, True), (9, False)):
            ids, w = _routes(tokens, gen, hot)
            emap = None
            if use_map:
                emap = torch.arange(SHAPE[0], dtype=torch.int32)
                emap[ids[0, :3]] = -1
            _check_cuda(x, bank, dev_bank, ids, w, emap, cache)


def _check_cuda(x, bank, dev_bank, ids, w, emap, cache) -> None:
    ref, mag = _reference(x, bank, ids, w, emap, "silu")
    dmap = None if emap is None else emap.to(DEV)
    args = (dev_bank, ids.to(DEV), w.to(DEV), "silu", dmap)
    _check(fused_moe_triton(x.to(DEV), *args, grouped=True), ref, mag)
    _check(fused_moe_triton(x.to(DEV), *args), ref, mag)  # the batch-size default
    xb = x.to(torch.bfloat16)
    ref_b, mag_b = _reference(xb.float(), bank, ids, w, emap, "silu", cache)
    _check(fused_moe(xb.to(DEV), *args).float(), ref_b, mag_b, 2.0**-8)


def _group_table(ids: torch.Tensor, emap: torch.Tensor | None, bt: int) -> list[list[int]]:
    """[slot, routes...] per group: the slot's groups, then one [-1, route] per route mapped
    to -1; the groups after those hold no route."""
    slot, cnt, routes = (t.cpu() for t in group_routes(ids.to(DEV), emap, bt))
    groups = []
    for g in range(ids.numel()):
        n = int(cnt[g])
        if int(slot[g]) < 0:
            assert (slot[g:] == -1).all(), "groups must be numbered without gaps"
            if n == 0:
                assert (cnt[g:] == 0).all(), "the routes mapped to -1 come first"
                break
        assert 1 <= n <= bt
        groups.append([int(slot[g])] + routes[g * bt:g * bt + n].tolist())
    return groups


def test_group_routes_covers_every_route_once():
    ids = torch.tensor([[2, 0, 5], [2, 7, 0], [2, 5, 1], [2, 3, 0]])
    emap = torch.arange(8, dtype=torch.int32)
    emap[3] = -1
    # routes (t * 3 + j) by slot: 2 -> 0, 3, 6, 9; 0 -> 1, 5, 11; 5 -> 2, 7; 7 -> 4; 1 -> 8;
    # route 10's expert 3 is elsewhere
    got = _group_table(ids, emap.to(DEV), 2)
    assert got == [[2, 0, 3], [0, 1, 5], [5, 2, 7], [7, 4], [2, 6, 9], [1, 8], [0, 11],
                   [-1, 10]]
    got = _group_table(ids, None, 4)
    assert got == [[2, 0, 3, 6, 9], [0, 1, 5, 11], [5, 2, 7], [7, 4], [1, 8], [3, 10]]


# -- the int8 grouped kernels: the per-route int8 path's bits --------------------------------------
I8_E, I8_H = 8, 256
# 5 tokens, top-2: expert 0 picked by four tokens (one group with BT 4, two with BT 2), expert 1
# by two, experts 2, 3, 4 once; expert 5 is elsewhere (slot -1: its route's row adds nothing)
I8_IDS = torch.tensor([[0, 1], [2, 0], [0, 1], [3, 5], [4, 0]])
I8_FORMATS = ["nvfp4", "Q4_K", "Q8_0"]


def _i8_case(fmt: str, seed: int):
    """A bank as the GPU holds it (Q8_0 split), bf16 x (the int8 path), route weights, a map;
    FFN 128 (Q4_K 256: its int8 dot takes whole super-blocks)."""
    gen = torch.Generator().manual_seed(seed)
    inter = 256 if fmt == "Q4_K" else 128
    w13, w2 = (cases.to_device(cases.random_weight(fmt, gen, n, k, (I8_E,)), DEV)
               for n, k in ((2 * inter, I8_H), (I8_H, inter)))
    if fmt == "Q8_0":
        w13, w2 = split_q8_0(w13), split_q8_0(w2)
    bank = ExpertBank(w13, w2, (torch.rand(I8_E, 4, generator=gen) * 3e-2 + 1e-3).to(DEV))
    x = torch.randn(I8_IDS.shape[0], I8_H, generator=gen).to(torch.bfloat16).to(DEV)
    w = torch.softmax(torch.randn(I8_IDS.shape, generator=gen), -1).to(DEV)
    emap = torch.arange(I8_E, dtype=torch.int32)
    emap[5] = -1
    return bank, x, w, emap.to(DEV)


def _run(monkeypatch, module, name: str, *args, **kw):
    """fused_moe_triton's output and (a, y) as the down kernel `name` of `module` read and
    wrote them (positional arguments 0 and 8 of both down kernels)."""
    spy = cases.Spy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    out = fused_moe_triton(*args, **kw)
    monkeypatch.setattr(module, name, spy.kernel)
    assert len(spy.calls) == 1, f"{name} did not run"
    return out, spy.calls[0][0], spy.calls[0][8]


@pytest.mark.skipif(CUDA, reason="interpreter shapes and tiles (the same both ways)")
@pytest.mark.parametrize("fmt", I8_FORMATS)
@pytest.mark.parametrize("quant_a,bt", [(False, 4), (True, 2)])
def test_grouped_i8_matches_per_route_bits(fmt, quant_a, bt, monkeypatch):
    """Per route, gate/up's a (fp32, or its codes with quant_a) and down's fp32 row y, and the
    layer's output, are the per-route int8 path's bits: groups of 1, 2 and 4 routes (BT 4) or
    of 1 and 2 (BT 2, expert 0 in two groups), a route mapped to -1 (zero row, nothing
    added), row blocks of 128 and chunks of 256 both ways, the routes summed by the down
    kernel's last-arriving programs both ways."""
    bank, x, w, emap = _i8_case(fmt, len(fmt) + bt)
    assert use_i8(tmoe.format_id(bank.w13), x.dtype), "bf16 x must take the int8 dots"
    args = (x, bank, I8_IDS.to(DEV), w, "silu", emap)
    want, a_r, y_r = _run(monkeypatch, tmoe, "_down_kernel", *args, (1, 128, 256, 4),
                          grouped=False, quant_a=quant_a)
    got, a_g, y_g = _run(monkeypatch, moe_grouped, "_down_i8_kernel", *args, grouped=True,
                         group_tiles=(bt, 128, 4, 256), quant_a=quant_a)
    assert a_g.dtype == (torch.int32 if quant_a else torch.float32)
    here = (emap.cpu()[I8_IDS.reshape(-1)] >= 0).to(DEV)  # the other rows of a are not written
    assert torch.equal(a_g[here], a_r[here])
    assert torch.equal(y_g, y_r)
    assert torch.equal(got, want)


@pytest.mark.skipif(CUDA, reason="interpreter shapes and tiles")
def test_grouped_i8_sum_kernel_and_second_call(monkeypatch):
    """The routes' sum by `_sum_routes_kernel` (FREETOKEN_GPU_DOWN_SUM=0) gives the arrival
    counters' bits, and a second call the first's (the counters reset)."""
    bank, x, w, emap = _i8_case("Q8_0", 3)
    args = (x, bank, I8_IDS.to(DEV), w, "silu", emap)
    kw = dict(grouped=True, group_tiles=(4, 128, 4, 256))
    want = fused_moe_triton(*args, **kw)
    assert torch.equal(fused_moe_triton(*args, **kw), want)
    monkeypatch.setenv("FREETOKEN_GPU_DOWN_SUM", "0")
    assert torch.equal(fused_moe_triton(*args, **kw), want)


def test_grouped_switch_selects_the_path(monkeypatch):
    """FREETOKEN_GPU_MOE_GROUPED=LO-HI picks the grouped kernels at LO to HI tokens where both
    kernels take int8 dots (0: never; unset: GROUPED_TOKENS, None today); grouped=True takes
    them at any size, int8 per kernel where the per-route path would (Q6_K down: fp32)."""
    name = "FREETOKEN_GPU_MOE_GROUPED"
    bank, x, w, emap = _i8_case("nvfp4", 1)
    mixed = ExpertBank(bank.w13, cases.random_weight("Q6_K", torch.Generator(), I8_H, 256,
                                                     (I8_E,)), bank.scales)

    def picked(tokens: int, b: ExpertBank = bank, dtype=torch.bfloat16, grouped=None):
        return tmoe._grouped_tiles(tokens, 8, b, dtype, grouped, None)

    monkeypatch.delenv(name, raising=False)
    assert tmoe.GROUPED_TOKENS is None and not any(picked(t) for t in range(1, 17))
    monkeypatch.setattr(tmoe, "GROUPED_TOKENS", (2, 4))  # a measured default
    assert [t for t in range(1, 17) if picked(t)] == [2, 3, 4]
    monkeypatch.setenv(name, "5-16")
    assert [t for t in range(1, 17) if picked(t)] == list(range(5, 17))
    assert not picked(8, mixed) and not picked(8, dtype=torch.float32)  # int8 both, or not
    monkeypatch.setenv(name, "0")
    assert not any(picked(t) for t in range(1, 17))
    bt, up, down = picked(3, grouped=True)
    assert up[3] and down[3]
    _, up, down = picked(3, mixed, grouped=True)
    assert up[3] and not down[3]
    _, up, down = picked(3, dtype=torch.float32, grouped=True)
    assert not up[3] and not down[3]
    # fused_moe_triton takes the grouped path by the switch (the kernels themselves: above)
    monkeypatch.setenv(name, "1-16")
    seen = []
    monkeypatch.setattr(tmoe, "_fused_grouped", lambda *a: seen.append(a[-3]) or "grouped")
    assert fused_moe_triton(x, bank, I8_IDS.to(DEV), w, "silu", emap) == "grouped"
    assert seen[0][0] == tmoe.GROUP_BT and seen[0][1][3] and seen[0][2][3]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
