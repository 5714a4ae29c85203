"""Runs the straight-line inline PTX of our kernels on numpy arrays, one lane per element, as the
PTX ISA defines each instruction it knows (`prmt` with its sign mode, the f16x2 arithmetic
rounded once to nearest even, `cvt.rn.f16x2.e4m3x2`). Triton's interpreter cannot run inline
assembly, so the kernels' tests there take their fp32 fallbacks: this checks, on a machine
without a GPU, that each PTX block computes what its fallback computes. On the GPU the
kernel tests run the PTX itself.

Registers are uint32 arrays; `run(body, inputs, n_out)` binds $n_out.. to the inputs and
returns $0 .. $n_out - 1. An instruction it does not know is an error, never skipped.
"""

from __future__ import annotations

import re

import numpy as np
import torch


def f16(u: np.ndarray) -> np.ndarray:
    """The low 16 bits of u as an fp16 value, in float64."""
    return (u & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)


def to_f16_bits(x) -> np.ndarray:
    """float64 -> fp16 (rounded once, to nearest even) -> its bits as uint32."""
    return np.asarray(x, dtype=np.float64).astype(np.float16).view(np.uint16).astype(np.uint32)


def halves(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An f16x2 register's (low, high) values."""
    return f16(u), f16(u >> 16)


def pack(lo, hi) -> np.ndarray:
    """(low, high) values rounded to fp16 -> an f16x2 register."""
    return to_f16_bits(lo) | (to_f16_bits(hi) << 16)


def e4m3(b: np.ndarray) -> np.ndarray:
    """E4M3 (fn) bytes -> float64, as torch converts them."""
    return torch.from_numpy(b.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()


def prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """prmt.b32 d, a, b, c (default mode): byte i of d is byte (c's nibble i & 7) of {b, a}
    (a's bytes 0-3, b's 4-7), or, where the nibble's bit 3 is set, that byte's top bit copied
    to all eight bits."""
    src = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, c).shape, dtype=np.uint32)
    for i in range(4):
        sel = (c >> np.uint32(4 * i)) & np.uint32(15)
        byte = ((src >> ((sel & np.uint32(7)).astype(np.uint64) * np.uint64(8)))
                & np.uint64(0xFF)).astype(np.uint32)
        byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint32)
        out |= byte << np.uint32(8 * i)
    return out


def _f16x2(fn):
    def op(*s):
        pairs = [halves(v) for v in s]
        return pack(fn(*(p[0] for p in pairs)), fn(*(p[1] for p in pairs)))
    return op


_M32 = np.uint64(0xFFFFFFFF)
# each: the sources' values (uint32 arrays) -> the destination's. The f16x2 products and sums
# are exact in float64 for the operands here (fp16 times fp16 has 22 significant bits), so
# one rounding of the float64 result is the instruction's rounding.
_OPS = {
    "mov.b32": lambda a: a,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "add.u32": lambda a, b: ((a.astype(np.uint64) + b) & _M32).astype(np.uint32),
    "shr.b32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: ((a.astype(np.uint64) << b.astype(np.uint64)) & _M32)
    .astype(np.uint32),
    "prmt.b32": prmt,
    "sub.f16x2": _f16x2(lambda a, b: a - b),
    "mul.rn.f16x2": _f16x2(lambda a, b: a * b),
    "fma.rn.f16x2": _f16x2(lambda a, b, c: a * b + c),
    "cvt.rn.f16x2.e4m3x2": lambda a: pack(e4m3(a & 0xFF), e4m3((a >> 8) & 0xFF)),
}


def run(body: str, inputs: list[np.ndarray], n_out: int) -> list[np.ndarray]:
    """The PTX block `body` (a kernel's asm string, braces included or not) on inputs bound to
    $n_out, $n_out + 1, ..: its outputs $0 .. $n_out - 1."""
    shape = np.broadcast(*inputs).shape
    regs = {f"${i + n_out}": np.broadcast_to(v, shape).astype(np.uint32)
            for i, v in enumerate(inputs)}

    def value(tok: str) -> np.ndarray:
        return regs[tok] if tok in regs else np.full(shape, int(tok, 0), dtype=np.uint32)

    for line in body.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        split = re.fullmatch(r"\{(\w+), (\w+)\}, (\$?\w+)", rest)
        if op == "mov.b32" and split:  # a 32-bit register into two 16-bit halves
            v = value(split.group(3))
            regs[split.group(1)], regs[split.group(2)] = v & 0xFFFF, v >> 16
            continue
        if op not in _OPS:
            raise NotImplementedError(f"ptx_emu: no emulation of {op!r}")
        dst, *srcs = (a.strip() for a in rest.split(","))
        regs[dst] = np.asarray(_OPS[op](*(value(s) for s in srcs))).astype(np.uint32)
    return [regs[f"${i}"] for i in range(n_out)]
