"""The model tests compare FreeToken with transformers (and llama.cpp) in float math: on the
CPU, quantized layers run with FREETOKEN_CPU_FLOAT=1 here (decoded tiles, fp32 GEMM). The
default int8 dots are checked against the same goldens in test_cpu_decode_path.py, which
switches them back on."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def cpu_float_math(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")
