"""`fused_moe(..., expert_map=...)`: the bank as a pool of slots, expert e read from slot map[e].

References: `freetoken.moe.reference.moe_reference` (float64 math on the codecs' dequantized
weights) on the plain bank, with the routing weight of every route whose expert maps to -1 set
to 0 (such a route is computed elsewhere, so it must add nothing). The pool holds the experts
in a shuffled order plus slots of garbage that no expert maps to. Tolerance 1e-5 of max
|reference|: fp32 accumulation over K <= 128 against float64 (the same bound as the plain
bank's test in tests/moe/test_banks.py). The CUDA path runs the same cases (skipped without CUDA).
On the CPU, FREETOKEN_CPU_FLOAT=1 keeps the plain bank's calls on this torch path too (the
executor's int8 dots would take them at these sizes; tests/moe covers those).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.kernels.moe import fused_moe
from freetoken.moe.banks import ExpertBank
from freetoken.moe.reference import moe_reference

E, SLOTS, H, INTER, TOPK = 6, 9, 128, 64, 3
TOL = 1e-5


@pytest.fixture(autouse=True)
def float_math_on_the_cpu(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")


def _q8_0(gen: torch.Generator, e: int, n: int, k: int) -> QuantWeight:
    w = (torch.randn(e, n, k, generator=gen) * 0.1).numpy()
    raw = gguf.quants.quantize(w.reshape(-1, k), gguf.GGMLQuantizationType.Q8_0)
    return QuantWeight(torch.from_numpy(raw.reshape(e, n, -1).copy()), "gguf", (e, n, k),
                       ggml_type=int(gguf.GGMLQuantizationType.Q8_0))


def _nvfp4(gen: torch.Generator, e: int, n: int, k: int) -> QuantWeight:
    data = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0x20, 0x48, (e, n, k // 16), generator=gen, dtype=torch.uint8)
    return QuantWeight(data, "nvfp4", (e, n, k), scales=scales.view(torch.float8_e4m3fn))


def _bank(fmt: str, gen: torch.Generator) -> ExpertBank:
    make = _nvfp4 if fmt == "nvfp4" else _q8_0
    scales = torch.ones(E, 4)
    scales[:, :3] = torch.rand(E, 3, generator=gen) * 3e-2 + 1e-3
    return ExpertBank(make(gen, E, 2 * INTER, H), make(gen, E, H, INTER), scales)


def _pool_weight(qw: QuantWeight, slot_of: torch.Tensor, gen: torch.Generator) -> QuantWeight:
    """[SLOTS, ...] copy of an [E, ...] weight: expert e at slot_of[e], random bytes elsewhere."""
    def place(t: torch.Tensor) -> torch.Tensor:
        raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        pool = torch.randint(0, 256, (SLOTS, *raw.shape[1:]), generator=gen, dtype=torch.uint8)
        pool = pool.to(raw.dtype)
        pool[slot_of] = raw
        return pool.view(t.dtype)

    scales = None if qw.scales is None else place(qw.scales)
    return QuantWeight(place(qw.data), qw.fmt, (SLOTS, *qw.shape[1:]), scales=scales,
                       ggml_type=qw.ggml_type)


def _pool(bank: ExpertBank, gen: torch.Generator) -> tuple[ExpertBank, torch.Tensor]:
    slot_of = torch.randperm(SLOTS, generator=gen)[:E]
    scales = torch.rand(SLOTS, 4, generator=gen) * 100  # garbage in unused slots must not leak
    scales[slot_of] = bank.scales
    pool = ExpertBank(_pool_weight(bank.w13, slot_of, gen), _pool_weight(bank.w2, slot_of, gen),
                      scales)
    return pool, slot_of.to(torch.int32)


def _case(fmt: str, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    bank = _bank(fmt, gen)
    pool, expert_map = _pool(bank, gen)
    expert_map[torch.tensor([1, 4])] = -1  # experts 1 and 4 are computed elsewhere
    x = torch.randn(batch, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(batch)])
    w = torch.softmax(torch.randn(batch, TOPK, generator=gen), -1)
    kept = torch.where(expert_map[ids] >= 0, w, torch.zeros_like(w))
    ref = moe_reference(x, ids, kept, bank.w13, bank.w2, bank.scales, "silu")
    return bank, pool, expert_map, x, ids, w, ref


def _err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double().cpu() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("fmt", ["nvfp4", "q8_0"])
def test_expert_map_matches_plain_bank(fmt, batch):
    bank, pool, expert_map, x, ids, w, ref = _case(fmt, batch, 11 * batch + len(fmt))
    y = fused_moe(x, pool, ids, w, "silu", expert_map)
    assert _err(y, ref) <= TOL
    # The identity map over the plain bank is the plain call.
    ident = torch.arange(E, dtype=torch.int32)
    assert torch.equal(fused_moe(x, bank, ids, w, "silu", ident), fused_moe(x, bank, ids, w))


def test_expert_map_all_missing_is_zero():
    bank, pool, expert_map, x, ids, w, _ = _case("q8_0", 3, 5)
    y = fused_moe(x, pool, ids, w, "silu", torch.full((E,), -1, dtype=torch.int32))
    assert torch.count_nonzero(y) == 0


def test_expert_map_checks():
    bank, pool, expert_map, x, ids, w, _ = _case("q8_0", 2, 7)
    with pytest.raises(ValueError, match="expert_map must be int32"):
        fused_moe(x, pool, ids, w, "silu", expert_map.long())
    with pytest.raises(ValueError, match="slot outside"):
        fused_moe(x, pool, ids, w, "silu", torch.full((E,), SLOTS, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expert id out of range \[0, 6\)"):
        fused_moe(x, pool, torch.full_like(ids, E), w, "silu", expert_map)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 5, 40])
@pytest.mark.parametrize("fmt", ["nvfp4", "q8_0"])
def test_expert_map_cuda(fmt, batch):
    _, pool, expert_map, x, ids, w, ref = _case(fmt, batch, 3 * batch + len(fmt))
    dev = torch.device("cuda")
    pool = pool.to(torch.float32, dev)
    y = fused_moe(x.to(dev), pool, ids.to(dev), w.to(dev), "silu", expert_map.to(dev))
    assert _err(y, ref) <= TOL


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
