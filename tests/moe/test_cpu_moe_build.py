"""The built extension keeps the NVFP4 dots' software prefetches.

No result depends on them, so no numeric test notices when the compiler drops them: GCC 12
once deleted every prefetch of both dots (a prefetch-only loop inlined through an
always_inline helper) and the DRAM dot lost a third of its speed while every test passed. The
streaming-read ceiling holds a handful of prefetch instructions; each dot instantiation (512-bit
and 256-bit, rows R x tokens NT, full steps and masked tails) holds several, about a hundred in
all. Skipped where objdump (binutils) is missing.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from freetoken import _cpu_moe


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_dot_kernels_keep_their_prefetches():
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", _cpu_moe.__file__],
                         capture_output=True, text=True, check=True).stdout
    n = asm.count("prefetcht0")
    assert n >= 40, f"{_cpu_moe.__file__}: {n} prefetcht0 instructions, expected ~100"
