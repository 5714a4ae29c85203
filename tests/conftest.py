"""Shared fixtures. Test helpers importable by every test live in tests/util.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import util  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same torch RNG state, so a test that draws unseeded random
    data sees the same data whether it runs alone, in a subset or after any other test."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """SmolLM2's real tokenizer as an HF directory (for small random models)."""
    return util.smollm2_tokenizer_dir()
