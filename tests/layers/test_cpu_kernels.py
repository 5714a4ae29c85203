"""`linear` on the CPU for quantized weights: the C++ executor's kernels (kernels/cpu_kernels.py).

- By default the executor's int8 dot runs at every token count: the result must be exactly
  what the executor computes for the same bytes as a one-expert bank (its kernels are checked
  against float64 in tests/moe/test_cpu_moe_formats.py), times scale2, plus the bias; and a
  token's row must not depend on the other tokens of the call (batch invariance).
- FREETOKEN_CPU_FLOAT=1 decodes fp32 tiles (bit-identical to gguf-py's dequantize) for torch's
  GEMM: the float64 product of the dequantized weight within fp32 rounding,
  K * 2^-23 * (|x| @ |W|^T) (a sum of K products, each rounded once, plus the accumulation: the
  usual a-priori bound of a length-K fp32 dot, with room for a blocked GEMM's order).
- Formats the executor has no kernel for take the torch reference.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from freetoken.formats.qweight import QuantWeight
from freetoken.kernels import cpu_kernels, linear
from freetoken.moe.cpu_executor import CpuMoeExecutor

Q = gguf.GGMLQuantizationType
KINDS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


# byte offsets of each block's fp16 scale fields: set to sane values, every other byte random
FP16_FIELDS = {Q.Q4_0: [0], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208], Q.Q4_1: [0, 2],
               Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q5_K: [0, 2]}


def _weight(kind, n: int, k: int, seed: int) -> tuple[QuantWeight, np.ndarray]:
    """Random valid blocks and their float64 values by gguf-py's dequantize."""
    rng = np.random.default_rng(seed)
    bs, bb = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n, k // bs, bb), dtype=np.uint8)
    for off in FP16_FIELDS[kind]:
        d = (rng.random((n, k // bs)) * 0.02 + 1e-3).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // bs, 2)
    raw = raw.reshape(n, -1)
    qw = QuantWeight(torch.from_numpy(raw), "gguf", (n, k), ggml_type=int(kind), source="w")
    return qw, gguf.quants.dequantize(raw, kind).astype(np.float64)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_decode_path_is_the_executor_dot(kind):
    qw, _ = _weight(kind, 96, 512, seed=int(kind))
    qw.scale2 = torch.rand(96, generator=torch.Generator().manual_seed(1)) + 0.5
    bias = torch.randn(96, generator=torch.Generator().manual_seed(2))
    one = QuantWeight(qw.data.unsqueeze(0), "gguf", (1, 96, 512), ggml_type=qw.ggml_type)
    ex = CpuMoeExecutor(cpu_kernels.executor().num_threads)
    for shape in ((1,), (3,), (2, 3), (40,)):  # leading dims of x
        x = torch.randn(*shape, 512, generator=torch.Generator().manual_seed(len(shape)))
        y = linear(x, qw, bias)
        ref = ex.expert_matmul(one, 0, x.reshape(-1, 512)) * qw.scale2 + bias
        assert y.shape == (*shape, 96)
        assert torch.equal(y.reshape(-1, 96), ref)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([linear(x[i:i + 1], qw) for i in range(0, 40, 7)])
    assert torch.equal(linear(x, qw)[::7], alone)  # the same rows alone or in a batch


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_float_path_is_fp32_math(kind, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")
    n, k, T = 200, 512, 40
    qw, w = _weight(kind, n, k, seed=7 + int(kind))
    x = torch.randn(T, k, generator=torch.Generator().manual_seed(3))
    y = linear(x, qw).double().numpy()
    xd = x.double().numpy()
    err = np.abs(y - xd @ w.T)
    bound = k * 2.0**-23 * (np.abs(xd) @ np.abs(w).T)
    assert np.all(err <= bound), f"max err / bound {(err / bound).max():.2f}"


def test_tiles_of_the_float_path(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")
    qw, _ = _weight(Q.Q4_K, 300, 256, seed=5)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    whole = linear(x, qw)
    monkeypatch.setattr(cpu_kernels, "TILE_ELEMS", 64 * 256)  # five tiles of 64 rows, one of 44
    assert torch.equal(linear(x, qw), whole)


def test_format_without_executor_kernel_takes_the_reference():
    from freetoken.kernels.linear import _quant_linear

    g = torch.Generator().manual_seed(6)
    data = torch.randn(256, 256, generator=g).to(torch.float8_e4m3fn)
    qw = QuantWeight(data, "fp8_block", (256, 256), scales=torch.rand(2, 2, generator=g) + 0.5)
    x = torch.randn(2, 256, generator=g)
    assert cpu_kernels.cpu_linear(x, qw) is None
    assert torch.equal(linear(x, qw), _quant_linear(x, qw))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu(act):
    """The executor's GLU (polynomial exp, ~1 ulp) against float64, as tight as torch's."""
    import torch.nn.functional as F

    gu = torch.randn(1, 2 * 320, generator=torch.Generator().manual_seed(8)) * 4
    g, u = gu[:, :320].double(), gu[:, 320:].double()
    ref = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
    out = cpu_kernels.cpu_glu(gu.clone(), 320, act)
    assert out.shape == (1, 320)
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    two = torch.randn(2, 640, generator=torch.Generator().manual_seed(3))
    rows = cpu_kernels.cpu_glu(two.clone(), 320, act)
    for t in range(2):  # each row as it would be alone
        assert torch.equal(rows[t:t + 1], cpu_kernels.cpu_glu(two[t:t + 1].clone(), 320, act))


@pytest.mark.parametrize("window,softcap,qk_norm", [(None, None, False), (5, None, True),
                                                    (None, 30.0, False)])
def test_decode_attention_block_matches_the_torch_path(window, softcap, qk_norm):
    """The one-call CPU decode attention (per-head q/k RMSNorm, rotary, KV store, attention over
    scrambled pages) against the torch entry points on a copy of the cache: the stored K within
    fp32 rounding of theirs (the same products and sums), V exactly, the output within 1e-5 of
    its max (fp32 sums over at most 40 positions and 16 dims against another summation order)."""
    from freetoken.kernels import paged_attention, qk_rope
    from freetoken.layers.attention import AttentionSpec
    from freetoken.models.testing import SimpleKV

    g = torch.Generator().manual_seed(9)
    hq, hkv, d, lens = 4, 2, 16, [19, 7, 33]
    spec = AttentionSpec(hidden_size=64, num_heads=hq, num_kv_heads=hkv, head_dim=d, scale=0.3,
                         qk_norm=qk_norm, window=window, softcap=softcap)
    kv = SimpleKV([(hkv, d)], num_pages=16, page_size=4)
    ctx = kv.context([(i, n) for i, n in enumerate(lens)])  # the prompts, by the torch path
    T = sum(lens)
    paged_attention(torch.randn(T, hq, d, generator=g), torch.randn(T, hkv, d, generator=g),
                    torch.randn(T, hkv, d, generator=g), kv.caches[0], ctx, scale=0.3)
    ctx = kv.context([(i, 1) for i in range(len(lens))])  # one decode step
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g)
    ang = torch.rand(len(lens), d // 2, generator=g) * 20
    rope = (torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin())
    wq, wk = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5)
    norms = (wq, wk) if qk_norm else (None, None)

    cache = kv.caches[0].clone()
    q, k, v = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = (t.reshape(len(lens), -1, d) for t in (q, k, v))
    q, k = qk_rope(q, k, *rope, *norms, eps=spec.norm_eps)
    want = paged_attention(q, k, v, cache, ctx, scale=0.3, window=window, softcap=softcap)

    got = cpu_kernels.cpu_decode_attention(qkv, spec, kv.caches[0], ctx, rope, *norms)
    assert got.shape == (len(lens), hq * d)
    err = (got.reshape(want.shape) - want).abs().max() / want.abs().max()
    assert float(err) < 1e-5
    slots = ctx.slot_mapping
    flat, ref = kv.caches[0].view(2, -1, hkv, d), cache.view(2, -1, hkv, d)
    assert torch.equal(flat[1, slots], ref[1, slots])
    assert torch.allclose(flat[0, slots], ref[0, slots], rtol=1e-6, atol=1e-6)
    assert cpu_kernels.cpu_decode_attention(qkv.double(), spec, kv.caches[0], ctx, rope,
                                           *norms) is None  # fp32 only


def _host_tiers() -> list[str]:
    from freetoken import _cpu_moe

    host = [t.strip() for t in _cpu_moe.supported_tiers().split(",")]
    return [t for t in ("scalar", "avx2_fp32", "avx2_vnni", "avx512_fp32", "avx512_vnni")
            if t in host]


@pytest.mark.parametrize("tier", _host_tiers())
def test_a_token_gets_the_same_bits_in_any_batch(tier):
    """Every tier's dots: a token's row alone (1 token), in a group of 2 or 3, and in a batch
    of 16, bit for bit (a request decoded alone must not differ from the same request batched
    with others)."""
    ex = CpuMoeExecutor(2, isa=tier)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(10))
    for kind in KINDS:
        qw, _ = _weight(kind, 64, 512, seed=20 + int(kind))
        one = QuantWeight(qw.data.unsqueeze(0), "gguf", (1, 64, 512), ggml_type=qw.ggml_type)
        batch = ex.expert_matmul(one, 0, x)
        for rows in ([5], [5, 9], [5, 9, 12]):
            part = ex.expert_matmul(one, 0, x[rows])
            assert torch.equal(part, batch[rows]), f"{kind.name} on {tier}, rows {rows}"
