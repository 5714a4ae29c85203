"""Reference kernels against float64 math and gguf-py's numpy codecs.

- linear: quantized weights (GGUF Q8_0 / Q4_0 made by gguf.quants, NVFP4 with a second-level
  scale) against x @ W^T in float64 with W dequantized by gguf-py (or from the NVFP4
  definition); fp32 accumulation over K <= 512 stays within 1e-5 relative. Tiled (rows in
  several tiles) and untiled paths give identical results.
- embedding: quantized rows gathered then dequantized equal the dequantized table's rows.
- paged attention: scrambled pages, GQA, sliding window, soft-capping, chunked prefill and
  decode against dense float64 softmax attention; 1e-5 relative.
"""

from __future__ import annotations

import importlib
import sys

import gguf
import numpy as np
import pytest
import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.kernels import embedding, paged_attention
from freetoken.models.testing import SimpleKV

T = gguf.GGMLQuantizationType
linear_mod = importlib.import_module("freetoken.kernels.linear")


def _gguf_weight(kind: T, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, kind)  # [n, row_bytes] uint8
    ref = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float64))
    return QuantWeight(torch.from_numpy(raw), "gguf", (n, k), ggml_type=int(kind)), ref


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.BF16])
def test_linear_gguf_tiled(kind, monkeypatch):
    qw, w = _gguf_weight(kind, 384, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    whole = linear_mod._quant_linear(x, qw)  # the torch reference (the CPU path's own test:
    monkeypatch.setattr(linear_mod, "TILE_ELEMS", 128 * 512)  # tests/layers/test_cpu_kernels.py)
    tiled = linear_mod._quant_linear(x, qw)  # three tiles of 128 rows
    ref = x.double() @ w.T
    assert torch.equal(whole, tiled)
    assert float((whole.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_linear_nvfp4_scale2_and_bias():
    from freetoken.formats.nvfp4 import E2M1_VALUES

    g = torch.Generator().manual_seed(2)
    n, k = 64, 128
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 16, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
    s2 = torch.tensor(3e-4)
    qw = QuantWeight(codes, "nvfp4", (n, k), scales=scales, scale2=s2)
    # Definition: value 2i in the low nibble, 2i+1 in the high nibble; x block scale (16).
    vals = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, k).long()
    w = E2M1_VALUES.double()[vals] * scales.double().repeat_interleave(16, dim=1)
    x, b = torch.randn(3, k, generator=g), torch.randn(n, generator=g)
    ref = (x.double() @ w.T) * 3e-4 + b.double()
    out = linear_mod._quant_linear(x, qw) + b  # the torch reference
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_embedding_gathers_quantized_rows():
    qw, w = _gguf_weight(T.Q4_0, 100, 64, seed=3)
    ids = torch.tensor([[5, 99, 0], [5, 7, 42]])
    rows = embedding(ids, qw, torch.float32)
    assert rows.shape == (2, 3, 64)
    assert torch.equal(rows.double(), w[ids])


def _dense_ref(q, k, v, scale, window, softcap) -> torch.Tensor:
    """q [L, Hq, d], k/v [L, Hkv, d] of one full sequence -> [L, Hq, d] in float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(q.shape[0])
    ok = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0)])
def test_paged_attention_chunked_prefill_and_decode(window, softcap):
    g = torch.Generator().manual_seed(4)
    lens, hq, hkv, d, scale = [19, 7, 33], 4, 2, 16, 0.3
    qkv = [[torch.randn(L, h, d, generator=g) for h in (hq, hkv, hkv)] for L in lens]
    kv = SimpleKV([(hkv, d)], num_pages=16, page_size=4)
    outs = [[] for _ in lens]
    # Step 1: the first half of each prompt; step 2: the rest; then two decode steps.
    cuts = [[0, L // 2, L - 2, L - 1, L] for L in lens]
    for step in range(4):
        spans = [(c[step], c[step + 1]) for c in cuts]
        ctx = kv.context([(i, b - a) for i, (a, b) in enumerate(spans)])
        q, k, v = (torch.cat([qkv[i][j][a:b] for i, (a, b) in enumerate(spans)])
                   for j in range(3))
        o = paged_attention(q, k, v, kv.caches[0], ctx, scale=scale, window=window,
                            softcap=softcap)
        for i, part in enumerate(o.split([b - a for a, b in spans])):
            outs[i].append(part)
    for i in range(len(lens)):
        ref = _dense_ref(*qkv[i], scale, window, softcap)
        got = torch.cat(outs[i]).double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))


@pytest.mark.parametrize("tokens", [1, 3])
def test_qk_rope_of_qkv_views_is_the_reference(tokens):
    """q and k split from one qkv output (the CPU path ropes them as one tensor) and apart."""
    from freetoken.kernels import qk_rope
    from freetoken.kernels.rotary import rotary_reference

    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (4 + 2 + 2) * 16, generator=g)
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.reshape(tokens, 4, 16), k.reshape(tokens, 2, 16)
    ang = torch.rand(tokens, 8, generator=g) * 10
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    for qq, kk in ((q, k), (q.clone(), k.clone())):
        qo, ko = qk_rope(qq, kk, cos, sin)
        assert torch.equal(qo, rotary_reference(qq, cos, sin))
        assert torch.equal(ko, rotary_reference(kk, cos, sin))


def test_paged_attention_mixed_step_one_token_sequences():
    """A step that mixes a prefill chunk with one-token sequences (those go to the executor's
    decode attention on the CPU) against float64, as the other attention tests."""
    g = torch.Generator().manual_seed(6)
    hq, hkv, d, scale = 4, 2, 16, 0.3
    lens = [12, 9, 14]
    qkv = [[torch.randn(L, h, d, generator=g) for h in (hq, hkv, hkv)] for L in lens]
    kv = SimpleKV([(hkv, d)], num_pages=16, page_size=4)
    outs = [[] for _ in lens]
    # step 1: 5, 8 and 13 tokens; step 2: one token for sequences 1 and 2, 7 for sequence 0
    for spans in ([(0, 5), (0, 8), (0, 13)], [(5, 12), (8, 9), (13, 14)]):
        ctx = kv.context([(i, b - a) for i, (a, b) in enumerate(spans)])
        q, k, v = (torch.cat([qkv[i][j][a:b] for i, (a, b) in enumerate(spans)])
                   for j in range(3))
        o = paged_attention(q, k, v, kv.caches[0], ctx, scale=scale)
        for i, part in enumerate(o.split([b - a for a, b in spans])):
            outs[i].append(part)
    for i in range(len(lens)):
        ref = _dense_ref(*qkv[i], scale, None, None)
        got = torch.cat(outs[i]).double()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
