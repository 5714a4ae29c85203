"""Architecture name -> model class (imported lazily)."""

from __future__ import annotations

import importlib

from freetoken.formats.errors import FormatError
from freetoken.models.config import SUPPORTED, ModelConfig

_CLASSES = {
    "llama": ("freetoken.models.llama", "LlamaForCausalLM"),
    "qwen2": ("freetoken.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("freetoken.models.qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("freetoken.models.gemma3", "Gemma3ForCausalLM"),
    "qwen3_moe": ("freetoken.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "minimax_m2": ("freetoken.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "gemma4": ("freetoken.models.gemma4", "Gemma4ForCausalLM"),
    "qwen3_5": ("freetoken.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("freetoken.models.qwen3_5", "Qwen3_5ForCausalLM"),
}
assert set(_CLASSES) == set(SUPPORTED)


def model_class(arch: str):
    if arch not in _CLASSES:
        raise FormatError(f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED)}")
    module, name = _CLASSES[arch]
    return getattr(importlib.import_module(module), name)


def build_model(config: ModelConfig):
    """An unloaded model for `config` (weights come from models/loader.py)."""
    return model_class(config.arch)(config)
