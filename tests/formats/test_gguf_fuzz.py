"""Fuzz: a few hundred mutations of a small valid GGUF (several tensor types, NVFP4 with .scale).

Each case must either load, hand out every tensor's raw view and dequantize every weight, or
raise FormatError; never another exception, never more than CASE_SECONDS (SIGALRM bounds it).
Mutations: byte flips (mostly in the header, where they matter), truncations, and length /
count / offset fields overwritten with boundary values. The seed is fixed, so a failure names
a case that reproduces.
"""

from __future__ import annotations

import random
import signal
import struct
import sys
from pathlib import Path

import pytest
from gguf_fixtures import write_small_gguf

from freetoken.formats.dequant import dequantize
from freetoken.formats.errors import FormatError
from freetoken.formats.gguf import GGUFFile
from freetoken.formats.scales import check_scales

N_CASES = 400
CASE_SECONDS = 5
BIG = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1, 255, 4096]


def mutate(blob: bytes, header_end: int, rng: random.Random) -> bytes:
    b = bytearray(blob)
    kind = rng.choice(["flip", "flip", "truncate", "u64", "u32"])
    if kind == "truncate":
        return bytes(b[: rng.randrange(len(b))])
    pos = rng.randrange(header_end if rng.random() < 0.9 else len(b))
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[min(pos + rng.randrange(8), len(b) - 1)] ^= 1 << rng.randrange(8)
    elif kind == "u64" and pos + 8 <= len(b):
        b[pos : pos + 8] = struct.pack("<Q", rng.choice(BIG))
    elif pos + 4 <= len(b):
        b[pos : pos + 4] = struct.pack("<I", rng.choice(BIG) & 0xFFFFFFFF)
    return bytes(b)


def exercise(path: Path) -> str:
    """Load and use everything; returns 'ok' or 'refused' (FormatError)."""
    try:
        with GGUFFile(path) as g:
            for name in g.tensors:
                g.raw(name).sum()
            try:
                check_scales(g)
            except FormatError:
                pass  # a verdict, not a crash; the weights must still read
            for name in g.tensors:
                try:
                    dequantize(g.weight(name), apply_scale2=False)
                except FormatError:
                    pass
        return "ok"
    except FormatError:
        return "refused"


def _alarm(signum, frame):
    raise TimeoutError(f"case took longer than {CASE_SECONDS} s")


def test_fuzz_small_gguf(tmp_path: Path):
    good = write_small_gguf(tmp_path / "good.gguf")
    blob = good.read_bytes()
    with GGUFFile(good) as g:
        header_end = g.data_offset
    assert exercise(good) == "ok"
    rng = random.Random(20261129)
    seen = {"ok": 0, "refused": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for case in range(N_CASES):
            p = tmp_path / "case.gguf"
            p.write_bytes(mutate(blob, header_end, rng))
            signal.alarm(CASE_SECONDS)
            try:
                seen[exercise(p)] += 1
            except Exception as e:  # anything but FormatError is a bug
                raise AssertionError(f"case {case}: {type(e).__name__}: {e}") from e
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    # Both outcomes must occur, or the mutations are not testing anything.
    print("fuzz outcomes:", seen)
    assert seen["ok"] > 10 and seen["refused"] > 100, seen


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
