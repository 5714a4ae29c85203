"""The fp16 decodes of `moe_mma`'s inline PTX (`_NIBBLES_F16`: Q4_K, `_E2M1_F16`: NVFP4),
emulated instruction by instruction as the PTX ISA defines them (`ptx_emu.py`), against the
values their definitions give: for NVFP4 the E2M1 table times the E4M3 scale as torch
converts it (exact in fp16), for Q4_K q s + nm rounded once to fp16. Every 16-bit code word
in the low lane, random words, scales and mins in the high one. Triton's interpreter runs
the kernels' fp32 fallbacks, not this PTX; on a GPU the kernel tests run the PTX itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # as every kernel test module: decorated once, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
import ptx_emu  # noqa: E402

pytest.importorskip("triton")
from freetoken.kernels.triton import moe_mma  # noqa: E402

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
N = 1 << 16


def _words(seed: int) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    rng = np.random.default_rng(seed)
    return np.arange(N, dtype=np.uint32), rng.integers(0, N, N).astype(np.uint32), rng


def _e2m1(c: np.ndarray) -> np.ndarray:
    return np.where(c & 8, -E2M1[c & 7], E2M1[c & 7])


def _nvfp4_errors(body: str) -> int:
    w0, w1, rng = _words(1)
    # E4M3 scale bytes, either sign, every finite one (0x7F, 0xFF are NaN)
    s0, s1 = (rng.integers(0, 0x7F, N).astype(np.uint32)
              | (rng.integers(0, 2, N).astype(np.uint32) << 7) for _ in range(2))
    outs = ptx_emu.run(body, [w0 | (w1 << 16), s0 | (s1 << 16)], 4)
    bad = 0
    for i, out in enumerate(outs):  # value 4m + i of each word
        lo, hi = ptx_emu.halves(out)
        bad += int((lo != _e2m1((w0 >> 4 * i) & 15) * ptx_emu.e4m3(s0)).sum())
        bad += int((hi != _e2m1((w1 >> 4 * i) & 15) * ptx_emu.e4m3(s1)).sum())
    return bad


def test_nvfp4_decode_is_the_codec():
    """Each of the 8 values is E2M1 times its word's E4M3 scale, exactly (-0 codes as 0)."""
    assert _nvfp4_errors(moe_mma._E2M1_F16.value) == 0


def test_nvfp4_check_fails_a_wrong_permute():
    """The check above can fail: the third values' byte permute taken one byte off."""
    assert _nvfp4_errors(moe_mma._E2M1_F16.value.replace("0x6622", "0x6633")) > 0


def _q4_k_errors(body: str) -> int:
    w0, w1, rng = _words(2)
    # fp16 scales d sc (>= 0) and negated mins -(dmin mn) (<= 0), a lane each
    s = [ptx_emu.to_f16_bits(rng.uniform(0, 0.05, N)) for _ in range(4)]
    nm = [ptx_emu.to_f16_bits(-rng.uniform(0, 0.05, N)) for _ in range(4)]
    lo_s, hi_s = s[0] | (s[1] << 16), s[2] | (s[3] << 16)
    lo_m, hi_m = nm[0] | (nm[1] << 16), nm[2] | (nm[3] << 16)
    outs = ptx_emu.run(body, [w0 | (w1 << 16), lo_s, lo_m, hi_s, hi_m], 4)
    bad = 0
    # outputs: low nibbles of the even bytes, of the odd, high nibbles of the even, of the odd
    for out, shift, k in zip(outs, (0, 8, 4, 12), (0, 0, 2, 2)):
        for got, w, lane in zip(ptx_emu.halves(out), (w0, w1), (0, 1)):
            q = ((w >> shift) & 15).astype(np.float64)
            want = q * ptx_emu.f16(s[k + lane]) + ptx_emu.f16(nm[k + lane])  # exact
            bad += int((got != want.astype(np.float16).astype(np.float64)).sum())
    return bad


def test_q4_k_decode_rounds_once():
    """Each value is q s + nm rounded once to fp16 (q the nibble)."""
    assert _q4_k_errors(moe_mma._NIBBLES_F16.value) == 0


def test_q4_k_check_fails_a_wrong_permute():
    assert _q4_k_errors(moe_mma._NIBBLES_F16.value.replace("0x4341", "0x4342")) > 0


def test_unknown_instruction_is_an_error():
    with pytest.raises(NotImplementedError, match="mad.lo"):
        ptx_emu.run("mad.lo.u32 $0, $1, $1, $1;", [np.zeros(1, dtype=np.uint32)], 1)
