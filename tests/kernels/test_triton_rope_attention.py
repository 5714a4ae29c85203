"""Decode attention with the step's q/k norm, rotary and KV store in the same launch
(`triton.attention.decode(rope=...)`, behind `kernels.qk_rope_attention`) against the two
launches it replaces (`rotary.qk_rope_triton` with the KV store, then `decode`) and against the
torch reference (`kernels.qk_rope`, then `paged_attention`).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1). There the fused
kernel gives the two launches' outputs, codes and cache bit for bit: it computes each q' and k'
with the products and sums of `_qk_rope_kernel` in the same order and rounds q' to q's dtype
where that kernel stores it. Compiled, the sums of a head's squares may be reduced in another
order (another tile layout), and the quantizing variant is built without fused multiply-adds,
so on CUDA q' and k' agree to a rounding: the outputs within the bf16 bound of
test_triton_attention.py, V in the cache exactly. Against the torch reference, fp32: the
tolerance of test_triton_attention.py (2e-5 + 1e-4 relative).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

sys.path.insert(0, os.path.dirname(__file__))
import triton_cases as cases  # noqa: E402
from test_triton_attention import _cpu, _Spy, close_fp32, make_ctx  # noqa: E402

from freetoken.kernels.attention import paged_attention  # noqa: E402
from freetoken.kernels.rotary import qk_rope  # noqa: E402
from freetoken.layers.rotary import RotaryEmbedding  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# decode contexts: one key (every split but the first empty), a share shorter than a block,
# uneven shares, one key past a block boundary
LENS = [1, 40, 150, 65]


def _step(lens, hq, hkv, d, r, norm, dtype, pad=None, seed=0, cache_dtype=None):
    """One decode step on DEV: (q, k, v strided views of one qkv row per sequence, cos, sin,
    (q_weight, k_weight), cache (random: a stale value at every slot; dtype's unless
    cache_dtype), ctx). pad: the index of a padding row (slot -1)."""
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    pages = sum(-(-n // 16) for n in lens) + 2
    ctx = make_ctx([n - 1 for n in lens], [1] * b, 16, pages, DEV, gen)
    if pad is not None:
        ctx.slot_mapping[pad] = -1
    cache = torch.randn(2, pages, 16, hkv, d, generator=gen).to(cache_dtype or dtype)
    qkv = (torch.randn(b, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype).to(DEV)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    cos, sin = RotaryEmbedding(r, 10000.0)(torch.randint(0, 4000, (b,), generator=gen))
    w = tuple((torch.rand(d, generator=gen) + 0.5).to(DEV) for _ in range(2)) if norm \
        else (None, None)
    return q, k, v, cos.to(DEV), sin.to(DEV), w, cache.to(DEV), ctx


def _both(q, k, v, cos, sin, w, cache, ctx, **kw):
    """((out, codes, cache) of the two launches, the same of the fused one), each on its own
    copy of the cache."""
    from freetoken.kernels.triton.attention import decode
    from freetoken.kernels.triton.rotary import qk_rope_triton

    two, one = cache.clone(), cache.clone()
    qo, _ = qk_rope_triton(q, k, cos, sin, *w, 1e-6, (v, two, ctx.slot_mapping))
    out2, q82 = decode(qo, two, ctx.page_table, ctx.seq_lens, **kw)
    out1, q81 = decode(q, one, ctx.page_table, ctx.seq_lens,
                       rope=(k, v, cos, sin, *w, 1e-6, ctx.slot_mapping), **kw)
    return (out2, q82, two), (out1, q81, one)


def _same(two, one, cache, ctx) -> None:
    (out2, q82, c2), (out1, q81, c1) = two, one
    assert (q81 is None) == (q82 is None)
    # the step's own slots were written, nothing else (a padding row: nothing)
    changed = (c1 != cache).flatten(3).any(-1).reshape(2, -1)  # [2, slots]
    slots = ctx.slot_mapping[ctx.slot_mapping >= 0]
    assert bool(changed[:, slots].all()) and int(changed.sum()) == 2 * slots.numel()
    if CUDA:  # q' and k' to a rounding (the module's docstring)
        torch.testing.assert_close(out1.float(), out2.float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(c1.float(), c2.float(), atol=2e-2, rtol=0)
        assert torch.equal(c1[1], c2[1])
        if q81 is not None:
            cases.check_codes(q81, out1.reshape(out1.shape[0], -1))
        return
    assert torch.equal(out1, out2) and torch.equal(c1, c2)
    assert q81 is None or torch.equal(q81, q82)


_F32, _BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("dtype,cache_dtype", [(_F32, _F32), (_BF16, _BF16), (_BF16, _F32)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("d,r,hq,hkv", [(64, 64, 4, 2), (64, 16, 6, 2), (128, 128, 8, 2),
                                        (128, 32, 4, 4)])
def test_fused_is_the_two_launches(d, r, hq, hkv, norm, dtype, cache_dtype):
    """Full and partial rotary, with and without norm weights, GQA groups of 2, 3, 4 and 1,
    a padding row: one split, four splits merged by the last to arrive (with the output's
    codes) and by the merge kernel, over contexts with empty splits. bf16 rows with an fp32
    cache: q' is rounded to bf16 first, as qk_rope stores it."""
    step = _step(LENS, hq, hkv, d, r, norm, dtype, pad=1, seed=d + r + hq,
                 cache_dtype=cache_dtype)
    for splits, merge, quant in ((1, True, False), (4, True, True), (4, False, False)):
        two, one = _both(*step, scale=d ** -0.5, window=None, softcap=None, splits=splits,
                         fused_merge=merge, quantize=quant)
        _same(two, one, step[6], step[7])


@pytest.mark.parametrize("window,softcap", [(None, 2.0), (50, None), (30, 2.0)])
def test_fused_window_softcap_splits(window, softcap):
    """A sliding window (the split that holds the step's position is then the last of a
    shorter range), a softcap, and the automatic, an odd and the largest split counts (16:
    most splits empty)."""
    step = _step(LENS, 4, 2, 64, 16, True, torch.float32, pad=3, seed=7)
    for splits in (None, 3, 16):
        two, one = _both(*step, scale=0.125, window=window, softcap=softcap, splits=splits)
        _same(two, one, step[6], step[7])


def _owner(n: int, window: int | None, splits: int, block_n: int) -> int:
    """The split whose keys hold position n - 1 (`_decode_kernel`'s shares of n keys)."""
    first = max(n - window, 0) if window else 0
    share = math.ceil(math.ceil((n - first) / splits) / block_n) * block_n
    return (n - 1 - first) // share


@pytest.mark.skipif(CUDA, reason="records the programs under Triton's interpreter")
@pytest.mark.parametrize("window", [None, 50, 100])
def test_the_split_holding_the_step_stores(window, monkeypatch):
    """Exactly one program of each (sequence, kv head) stores the step's k' and v: the split
    whose key range holds the new position (the other splits never read it). Under the
    interpreter the programs run one after another, splits in order, so a wrong (earlier)
    storer would go unseen by the outputs; its program ids are recorded instead."""
    import triton.language as tl

    from freetoken.kernels.triton import attention as tri

    stored = []
    store = tri._store_step_kv

    def spy(*args):
        stored.append(tuple(int(tl.program_id(a).handle.data[0]) for a in range(3)))
        return store(*args)

    monkeypatch.setattr(tri, "_store_step_kv", spy)
    step = _step(LENS, 4, 2, 64, 16, True, torch.float32, pad=1, seed=5)
    for splits in (1, 3, 16):
        stored.clear()
        _both(*step, scale=0.125, window=window, softcap=None, splits=splits)
        want = [(b, h, _owner(n, window, splits, 64)) for b, n in enumerate(LENS)
                for h in range(2)]
        assert stored == want, splits


@pytest.mark.parametrize("d,r,norm,window", [(64, 64, True, None), (64, 16, True, 30),
                                             (128, 32, False, None), (256, 64, True, 50)])
def test_fused_against_reference(d, r, norm, window):
    """fp32 against the torch path: `qk_rope` (RMSNorm, then rotary), then `paged_attention`
    (which stores k' and v itself): the output to the attention tests' tolerance, the stored
    k' to fp32 rounding, v exactly."""
    from freetoken.kernels.triton.attention import decode

    q, k, v, cos, sin, w, cache, ctx = _step(LENS, 4, 2, d, r, norm, torch.float32, seed=11)
    ref_cache = cache.cpu().clone()
    out, _ = decode(q, cache, ctx.page_table, ctx.seq_lens, scale=d ** -0.5, window=window,
                    softcap=None, rope=(k, v, cos, sin, *w, 1e-6, ctx.slot_mapping))
    wq, wk = (None if t is None else t.cpu() for t in w)
    qr, kr = qk_rope(q.cpu(), k.cpu(), cos.cpu(), sin.cpu(), wq, wk, 1e-6)
    ref = paged_attention(qr, kr, v.cpu(), ref_cache, _cpu(ctx), scale=d ** -0.5,
                          window=window)
    close_fp32(out.cpu(), ref)
    torch.testing.assert_close(cache.cpu()[0], ref_cache[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.cpu()[1], ref_cache[1])


def _spied(monkeypatch) -> dict[str, list]:
    """Launch grids of the q/k rope, KV store and decode kernels, by name."""
    from freetoken.kernels.triton import attention as tri
    from freetoken.kernels.triton import rotary as trot

    grids: dict[str, list] = {"rope": [], "store": [], "decode": []}
    monkeypatch.setattr(trot, "_qk_rope_kernel", _Spy(trot._qk_rope_kernel, grids["rope"]))
    monkeypatch.setattr(tri, "_store_kv_kernel", _Spy(tri._store_kv_kernel, grids["store"]))
    monkeypatch.setattr(tri, "_decode_kernel", _Spy(tri._decode_kernel, grids["decode"]))
    return grids


@pytest.mark.parametrize("norm,r", [(True, 64), (False, 16)])
def test_entry_one_launch_unless_switched_off(norm, r, monkeypatch):
    """`kernels.qk_rope_attention` at decode (CPU tensors through the kernels: TRITON_ON_CPU):
    one decode launch; FREETOKEN_GPU_ROPE_ATTN=0 the q/k rope launch (with the KV store), then
    decode, with the same output and cache; a prefill step the two calls as before."""
    from freetoken.kernels import attention as attn
    from freetoken.kernels import qk_rope_attention

    if not CUDA:
        monkeypatch.setattr(attn, "TRITON_ON_CPU", True)
    q, k, v, cos, sin, w, cache, ctx = _step(LENS, 4, 2, 64, r, norm, torch.float32, seed=3)
    grids = _spied(monkeypatch)
    outs, caches = [], []
    for value in ("1", "0"):
        monkeypatch.setenv("FREETOKEN_GPU_ROPE_ATTN", value)
        caches.append(cache.clone())
        outs.append(qk_rope_attention(q, k, v, (cos, sin), *w, 1e-6, caches[-1], ctx,
                                      scale=0.125, window=40, quantize=True))
    assert len(grids["rope"]) == 1 and not grids["store"] and len(grids["decode"]) == 2
    assert torch.equal(caches[0][1], caches[1][1])
    if CUDA:  # q' and k' to a rounding (the module's docstring)
        close_fp32(outs[0], outs[1])
        torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])
    prefill = make_ctx([0, 3], [5, 2], 16, cache.shape[1], DEV, torch.Generator())
    qkv = torch.randn(7, 8 * 64, device=DEV)
    cos, sin = RotaryEmbedding(r, 10000.0)(prefill.positions.cpu())
    qk_rope_attention(*(x.view(7, -1, 64) for x in qkv.split([256, 128, 128], -1)),
                      (cos.to(DEV), sin.to(DEV)), *w, 1e-6, cache, prefill, scale=0.125)
    assert len(grids["rope"]) == (2 if CUDA else 1) and len(grids["decode"]) == 2


def _tiny(arch: str):
    """A tiny random HF model of tests/models (cached there) and its prompts' ids."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    if arch == "qwen3_5":
        import tiny_qwen3_5 as tm
    else:
        import tiny_models as tm
    from freetoken.models import load_model

    model, _ = load_model(str(tm.hf_dir(arch)), show_progress=False)
    return model


@pytest.mark.skipif(CUDA, reason="Triton's interpreter (CPU tensors) is on only on CPU-only "
                                 "hosts")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_model_decode_same_with_the_switch(arch: str, monkeypatch) -> None:
    """The tiny qwen3 (layers/attention.py: q/k norms, full rotary) and qwen3.5 (its own
    attention: partial rotary, gated output) models, float32, three prompts prefilled then
    decoded teacher-forced: the decode steps' attention through the kernels under the
    interpreter, fused and with FREETOKEN_GPU_ROPE_ATTN=0, give the same logits bit for bit,
    and the torch path's within 1e-4 of the largest (the models' tolerance,
    tests/models). The CPU executor's one-call decode attention is set aside, so the torch
    path is qk_rope then paged_attention."""
    from freetoken.kernels import attention as attn
    from freetoken.layers import attention as layer
    from freetoken.models.testing import decode_logits

    monkeypatch.setattr(layer, "cpu_decode_attention", lambda *a: None)
    model = _tiny(arch)
    prompts = [[5, 17, 230, 9, 4000, 12], [300, 2, 2], [77] * 20]
    cont = [[11, 12, 13, 14, 15], [40, 41, 42, 43, 44], [9, 8, 7, 6, 5]]
    grids = _spied(monkeypatch)
    logits, launches = {}, {}
    for path, value in (("torch", None), ("fused", "1"), ("two", "0")):
        monkeypatch.setattr(attn, "TRITON_ON_CPU", value is not None)
        monkeypatch.setenv("FREETOKEN_GPU_ROPE_ATTN", value or "1")
        before = {name: len(g) for name, g in grids.items()}
        logits[path] = torch.stack(decode_logits(model, prompts, cont))
        launches[path] = tuple(len(g) - before[name] for name, g in grids.items())
    layers = len(model.kv_cache_shapes())  # attention layers: one KV cache each
    steps = len(cont[0]) - 1  # the first step prefills the prompts
    # (q/k rope, KV store, decode) launches: none on the torch path, one fused decode per
    # layer and step, or the rope launch before it
    assert launches == {"torch": (0, 0, 0), "fused": (0, 0, layers * steps),
                        "two": (layers * steps, 0, layers * steps)}
    assert torch.equal(logits["fused"], logits["two"])
    ref = logits["torch"]
    assert float((logits["fused"] - ref).abs().max()) <= 1e-4 * float(ref.abs().max())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
