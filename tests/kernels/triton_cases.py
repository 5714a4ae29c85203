"""Random weights of every format the Triton kernels decode, with finite values (block scales
drawn from a narrow range), and the float bound the kernel tests use."""

from __future__ import annotations

import gguf
import torch

from freetoken.formats.qweight import QuantWeight

FORMATS = ["nvfp4", "mxfp4", "fp8_block", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
           "MXFP4"]
# Byte offsets of the f16 block scales inside each GGUF block (their high byte is redrawn).
_F16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
           "Q6_K": (208,)}


def _bytes(gen: torch.Generator, *shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8)


def _gguf(name: str, gen: torch.Generator, lead: tuple[int, ...], n: int, k: int) -> QuantWeight:
    t = gguf.GGMLQuantizationType[name]
    block, size = gguf.GGML_QUANT_SIZES[t]
    data = _bytes(gen, *lead, n, k // block, size)
    for at in _F16_AT.get(name, ()):  # f16 scales in [2^-7, 2^-3): exponent bits 8..11
        data[..., at + 1] = _bytes(gen, *lead, n, k // block, lo=0x20, hi=0x30)
    if name == "MXFP4":  # E8M0 exponents near 2^0 (GGUF halves them)
        data[..., 0] = _bytes(gen, *lead, n, k // block, lo=120, hi=130)
    return QuantWeight(data.reshape(*lead, n, -1), "gguf", (*lead, n, k), ggml_type=int(t))


def random_weight(name: str, gen: torch.Generator, n: int, k: int,
                  lead: tuple[int, ...] = ()) -> QuantWeight:
    """A weight [*lead, n, k] in format `name` (FORMATS, or bf16 / f32) with finite values."""
    shape = (*lead, n, k)
    if name in ("bf16", "f32"):
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        return QuantWeight((torch.randn(shape, generator=gen) * 0.05).to(dtype), name, shape)
    if name == "nvfp4":
        scales = _bytes(gen, *lead, n, k // 16, lo=0x20, hi=0x40).view(torch.float8_e4m3fn)
        return QuantWeight(_bytes(gen, *lead, n, k // 2), "nvfp4", shape, scales=scales)
    if name == "mxfp4":
        return QuantWeight(_bytes(gen, *lead, n, k // 2), "mxfp4", shape,
                           scales=_bytes(gen, *lead, n, k // 32, lo=118, hi=128))
    if name == "fp8_block":
        codes = _bytes(gen, *lead, n, k, lo=0, hi=0x70)  # finite magnitudes, both signs below
        codes |= _bytes(gen, *lead, n, k, lo=0, hi=2) << 7
        scales = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=gen) * 0.01 + 1e-3
        return QuantWeight(codes.view(torch.float8_e4m3fn), "fp8_block", shape, scales=scales)
    return _gguf(name, gen, lead, n, k)


def to_device(qw: QuantWeight, dev: torch.device | str) -> QuantWeight:
    return QuantWeight(qw.data.to(dev), qw.fmt, qw.shape,
                       scales=None if qw.scales is None else qw.scales.to(dev),
                       scale2=None if qw.scale2 is None else qw.scale2.to(dev),
                       ggml_type=qw.ggml_type, source=qw.source)


def fp32_bound(k: int, mag: torch.Tensor) -> torch.Tensor:
    """Reordered fp32 sums of k products differ by at most ~k * eps * sum |x||w| (`mag`); 2x
    margin for the scale multiplications."""
    return 2 * k * torch.finfo(torch.float32).eps * mag + 1e-30


def bf16_bound(mag: torch.Tensor) -> torch.Tensor:
    """bf16 tensor-core dots: each weight rounded to bf16 (2^-9 relative), the output rounded
    to bf16 (2^-9 of |y| <= sum |x||w|): 2^-8 * sum |x||w|, doubled for margin."""
    return 2.0**-7 * mag + 1e-30


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 GEMVs' activation quantization (kernels/triton/gemv_i8.py) in torch: x fp32
    [..., K] -> (q fp32 [..., K] integers, d fp32 [..., K / 32]); q = floor(x * fp32(127 /
    amax) + 1/2), d = amax / 127, both divisions rounded once (IEEE), no fused multiply-add."""
    xb = x.reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.floor(xb * inv[..., None] + 0.5)
    return q.reshape(x.shape), amax / 127.0


def check_codes(q: torch.Tensor, y: torch.Tensor) -> None:
    """Rows of codes q (int32 [M, xq_len(K)], gemv_i8.quant_store's layout) are exactly the
    quantization of y [M, K] (the values as stored): codes, negated codes, block scales and
    block sums."""
    m, k = y.shape
    q = q.cpu()
    assert tuple(q.shape) == (m, k // 2 + k // 16)
    want_q, want_d = quantize_ref(y.float().cpu())
    codes = q[:, :k // 4].contiguous().view(torch.int8).float()
    neg = q[:, k // 4:k // 2].contiguous().view(torch.int8).float()
    d = q[:, k // 2:k // 2 + k // 32].contiguous().view(torch.float32)
    sums = q[:, k // 2 + k // 32:]
    assert torch.equal(codes, want_q), "codes"
    assert torch.equal(neg, -want_q), "negated codes"
    assert torch.equal(d, want_d), "block scales"
    assert torch.equal(sums.float(), want_q.reshape(m, -1, 32).sum(-1)), "block sums"


class Spy:
    """A kernel that records the arguments of its launches (the tensors they fill)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append(args)
            return self.kernel[grid](*args, **kw)
        return launch
