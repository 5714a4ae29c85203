"""Random expert banks and float64 references shared by the CPU MoE executor tests.

The references are written from the format definitions (E2M1 / E4M3 tables, the int8 block
quantization rule) and gguf-py's numpy `gguf.quants`, never from the executor's code.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.formats.qweight import QuantWeight

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def e4m3_values() -> np.ndarray:
    """All 256 E4M3 (fn) bytes as float64, from the definition (bias 7, subnormals, NaN)."""
    v = np.empty(256)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        mag = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        if e == 15 and m == 7:
            mag = np.nan
        v[b] = -mag if b & 0x80 else mag
    return v


def random_e4m3(gen: torch.Generator, shape, signed: bool) -> torch.Tensor:
    """Scale bytes: mostly normal values around 2^-3..2^3, some subnormals; optional sign."""
    normal = torch.randint(0x18, 0x50, shape, generator=gen, dtype=torch.int32)
    sub = torch.randint(1, 8, shape, generator=gen, dtype=torch.int32)
    use_sub = torch.rand(shape, generator=gen) < 0.05
    b = torch.where(use_sub, sub, normal)
    if signed:
        b = b | (torch.randint(0, 2, shape, generator=gen, dtype=torch.int32) << 7)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def random_nvfp4(gen: torch.Generator, E: int, N: int, K: int, signed=False) -> QuantWeight:
    data = torch.randint(0, 256, (E, N, K // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    return QuantWeight(data, "nvfp4", (E, N, K), scales=random_e4m3(gen, (E, N, K // 16), signed))


def nvfp4_f64(w: QuantWeight) -> np.ndarray:
    """[E, N, K] float64 from the ModelOpt definition: byte i = (k=2i low, k=2i+1 high)."""
    d = w.data.numpy()
    codes = np.stack([d & 15, d >> 4], axis=-1).reshape(*d.shape[:-1], -1)
    s = e4m3_values()[w.scales.view(torch.uint8).numpy()]
    return E2M1[codes] * np.repeat(s, 16, axis=-1)


def quant_int8_blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 activation rule in float32 numpy: scale = amax / 127, q = rint(x * (127 / amax));
    blocks with amax < 127 / FLT_MAX (where 127 / amax overflows) become zeros."""
    xb = x.astype(np.float32).reshape(-1, block)
    amax = np.abs(xb).max(axis=1)
    tiny = amax < np.float32(127) / np.finfo(np.float32).max
    safe = np.where(tiny, np.float32(1), amax).astype(np.float32)
    inv = (np.float32(127) / safe).astype(np.float32)
    q = np.clip(np.rint((xb * inv[:, None]).astype(np.float32)), -127, 127)
    q[tiny] = 0
    d = np.where(tiny, np.float32(0), (amax / np.float32(127)).astype(np.float32))
    return q.astype(np.int8).reshape(-1), d.astype(np.float32)


# The lane -> block order of the executor's W4A8 activation layouts, by lanes (common.h).
Q8_ORDER = {16: list(range(16)), 8: [0, 1, 4, 5, 2, 3, 6, 7]}


def unpack_nvfp4_q8(raw: torch.Tensor, K: int, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """Read the executor's NVFP4 W4A8 activation (groups of `lanes` blocks, lane m = block
    ord[m]; vector v, lane m, byte i = value 8 * (v // 2) + 2i + v % 2) back into int8 q [K] and
    block scales; checks the bias lanes (-12 * block sums)."""
    L = lanes
    ng = -(-K // (16 * L))
    g = raw.numpy()[: ng * 24 * L].reshape(ng, 24 * L)
    v = g[:, : 16 * L].view(np.int8).reshape(ng, 2, 2, L, 4)  # [group, half, parity, lane, i]
    by_lane = v.transpose(0, 3, 1, 4, 2).reshape(ng, L, 16)  # [group, lane, value]
    inv = np.argsort(Q8_ORDER[L])  # block -> lane
    q = by_lane[:, inv].reshape(-1)[:K]
    d = g[:, 20 * L :].copy().view(np.float32)[:, inv].reshape(-1)[: K // 16] / 128
    bias = g[:, 16 * L : 20 * L].copy().view(np.int32)[:, inv].reshape(-1)[: K // 16]
    assert np.array_equal(bias, -12 * q.astype(np.int64).reshape(-1, 16).sum(1)), "bias lanes"
    return q, d


def special_activation(gen: torch.Generator, K: int) -> torch.Tensor:
    """Random activations with an all-zero block, a block below 3.7e-37, one just above."""
    x = torch.randn(K, generator=gen, dtype=torch.float32) * 3
    if K >= 64:
        x[0:16] = 0
        x[16:32] = torch.randn(16, generator=gen) * 1e-38
        x[32:48] = torch.randn(16, generator=gen).sign() * 4e-37
    return x


def w4a8_layer_model(x, expert_ids, route, w13: QuantWeight, w2: QuantWeight, scales,
                     activation: str) -> torch.Tensor:
    """The W4A8 math of the executor's VNNI tiers in float64: NVFP4 weights decoded from the
    definition, the layer input and the GLU output quantized to int8 per 16 values by the rule;
    everything else exact. Returns fp32 [T, H]."""
    W13, W2 = torch.from_numpy(nvfp4_f64(w13)), torch.from_numpy(nvfp4_f64(w2))
    inter = W13.shape[1] // 2

    def qa(v: torch.Tensor) -> torch.Tensor:
        q, d = quant_int8_blocks(v.to(torch.float32).numpy(), 16)
        return torch.from_numpy(q.astype(np.float64) * np.repeat(d.astype(np.float64), 16))

    act = {"silu": torch.nn.functional.silu,
           "gelu_tanh": lambda g: torch.nn.functional.gelu(g, approximate="tanh")}[activation]
    s = scales.to(torch.float64)
    out = torch.zeros(x.shape[0], W2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        xq = qa(x[t])
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            h = W13[e] @ xq
            g = act(h[:inter] * s[e, 0]) * (h[inter:] * s[e, 1])
            out[t] += float(route[t, j]) * (W2[e] @ qa(g)) * s[e, 2]
    return out.to(torch.float32)
