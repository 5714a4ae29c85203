"""The grouped decode MoE (`freetoken.kernels.triton.moe_grouped`: routes grouped by slot on the
device, each expert's rows decoded once for all of its tokens) against float64 math on the
codecs' weights and against the torch reference `fused_moe` (the CPU path), with and without
the slot indirection (`expert_map`, some experts at -1), with experts picked by many tokens
(several groups of BT routes for one slot), and mixed formats (Q4_K gate/up, Q6_K down).

Tolerance per output, as in test_triton_moe.py: the down projection sums I products of
|a| |w| and a is itself an fp32 sum of H products: fp32 activations 2 (H + I) eps
sum|route| |s_down| (|a| |Wd|)^T (the kernels accumulate in fp32 in another association than
the reference); bf16 activations on CUDA: the same bound plus the bf16 rounding of the output,
2^-8 of it. Without CUDA the kernels run in Triton's interpreter on small shapes; with CUDA at
Qwen3-30B-A3B's (128 experts, hidden 2048, expert width 768, top-8) at 1, 4 and 16 tokens.

    python tests/kernels/test_triton_moe_grouped.py --bench   # CUDA: grouped vs per-route
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
    _check(y, ref, mag)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("f13,f2", [("nvfp4", "nvfp4"), ("Q4_K", "Q6_K")])
def test_grouped_matches_reference_cuda(f13, f2):
    """Batch 1, 4, 16; uniform routing, 12 hot experts with a map, 9 hot experts without."""
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
    slot, cnt, routes = (t.cpu() for t in group_routes(ids.to(DEV), emap, bt))
    groups = []
    for g in range(ids.numel()):
        if int(slot[g]) < 0:
            assert (slot[g:] == -1).all(), "groups must be numbered without gaps"
            break
        n = int(cnt[g])
        assert 1 <= n <= bt
        groups.append([int(slot[g])] + routes[g * bt:g * bt + n].tolist())
    return groups


def test_group_routes_covers_every_route_once():
    ids = torch.tensor([[2, 0, 5], [2, 7, 0], [2, 5, 1], [2, 3, 0]])
    emap = torch.arange(8, dtype=torch.int32)
    emap[3] = -1
    # routes (t * 3 + j) by slot: 2 -> 0, 3, 6, 9; 0 -> 1, 5, 11; 5 -> 2, 7; 7 -> 4; 1 -> 8
    got = _group_table(ids, emap.to(DEV), 2)
    assert got == [[2, 0, 3], [0, 1, 5], [5, 2, 7], [7, 4], [2, 6, 9], [1, 8], [0, 11]]
    got = _group_table(ids, None, 4)
    assert got == [[2, 0, 3, 6, 9], [0, 1, 5, 11], [5, 2, 7], [7, 4], [1, 8], [3, 10]]


BENCH_TILES = {4: [(2, 2, 1), (4, 4, 1)],
               16: [(2, 4, 1), (4, 2, 1), (4, 8, 2), (8, 4, 1), (4, 16, 4)]}


def _bench_tokens(bank: ExpertBank, fmt: str, t: int, time_call) -> None:
    e, k, h = bank.num_experts, 8, bank.hidden
    per_expert = (bank.w13.nbytes() + bank.w2.nbytes()) / e
    emap = torch.arange(e, dtype=torch.int32, device="cuda")
    torch.manual_seed(t)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, device="cuda"), -1)
    mb = int(torch.unique(ids).numel()) * per_expert / 1e6
    variants = [("route", dict(grouped=False)), ("default", {})]
    if t > 1:
        variants.append(("default-rolled", dict(unroll=1)))
    variants += [(f"g{gt}", dict(grouped=True, group_tiles=gt)) for gt in BENCH_TILES.get(t, [])]
    for name, kw in variants:
        try:
            _, g = time_call(lambda kw=kw: fused_moe_triton(x, bank, ids, w, "silu", emap, **kw))
            print(f"moe {fmt:6s} T={t:2d} {name:14s} {g * 1e3:8.1f} us {mb / g:7.0f} GB/s"
                  f" ({mb:.1f} MB distinct)", flush=True)
        except Exception as exc:  # noqa: BLE001 - one failing tile must not stop the rest
            print(f"moe {fmt} T={t} {name}: {type(exc).__name__}: {exc}", flush=True)


def _bench() -> None:
    """Graph-replayed us per MoE layer (Qwen3-30B-A3B shape): the per-route GEMV, the default,
    and grouped tiles (BT, BN, num_warps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_gpu_kernels import make_weight, time_call

    e, h, inter = 128, 2048, 768
    for fmt in ("Q4_K", "nvfp4"):
        bank = ExpertBank(make_weight(fmt, (e, 2 * inter, h)), make_weight(fmt, (e, h, inter)),
                          torch.rand(e, 4, device="cuda") + 0.5)
        for t in (1, 4, 16):
            _bench_tokens(bank, fmt, t, time_call)


if __name__ == "__main__":
    if "--bench" in sys.argv:
        _bench()
    else:
        raise SystemExit(pytest.main([__file__, "-q"]))
