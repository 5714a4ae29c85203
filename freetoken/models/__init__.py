"""Models: one file per architecture, a registry, config parsing and the strict loader.

The engine's interface:

    model, source = load_model(path, dtype=torch.float32, device="cpu")
    hidden = model(input_ids, ctx)            # [T] -> [T, hidden]
    logits = model.compute_logits(hidden[ctx.logits_indices])   # [S, vocab] fp32
    model.kv_cache_shapes()                   # (n_kv_heads, head_dim) per attention layer
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from freetoken.models.base import CausalLM
from freetoken.models.config import ModelConfig, from_gguf, from_hf
from freetoken.models.loader import load_weights
from freetoken.models.registry import build_model

__all__ = ["CausalLM", "ModelConfig", "ModelSource", "load_model"]


@dataclass
class ModelSource:
    """Where a model came from, for the tokenizer: kind "gguf" (with its metadata) or "hf"."""

    kind: str
    path: Path
    config: ModelConfig
    gguf_metadata: dict | None = None
    hf_dir: Path | None = None


def _open_hf(path: Path):
    from freetoken.formats.safetensors import HFCheckpoint
    from freetoken.models.sources import HFSource

    ckpt = HFCheckpoint(path)
    cfg = from_hf(ckpt.config, path=path / "config.json")
    return cfg, HFSource(ckpt), ModelSource("hf", path, cfg, hf_dir=path)


def _open_gguf(path: Path):
    from freetoken.formats.errors import FormatError
    from freetoken.formats.gguf import GGUFFile
    from freetoken.models.sources import GGUFSource

    gf = GGUFFile(path)
    try:
        from freetoken.formats.scales import check_scales
    except ImportError:  # pragma: no cover - scale checks land with the GGUF reader
        check_scales = None
    if check_scales is not None:
        check_scales(gf)
    if "token_embd.weight" not in gf.tensors:
        raise FormatError("missing tensor (the vocabulary size comes from it)", path=path,
                          tensor="token_embd.weight")
    cfg = from_gguf(gf.metadata, gf.tensors["token_embd.weight"].shape[0], path=path)
    cfg = replace(cfg, tie_word_embeddings="output.weight" not in gf.tensors)
    src = GGUFSource(gf, cfg.num_layers)
    return cfg, src, ModelSource("gguf", path, cfg, gguf_metadata=gf.metadata)


def load_model(path: str | os.PathLike | None, *, dtype: torch.dtype = torch.float32,
               device="cpu", show_progress: bool = True) -> tuple[CausalLM, ModelSource]:
    """Load a GGUF file, an HF directory or a packaged model name (None = the default)."""
    from freetoken.assets import resolve_model

    p = resolve_model(path)
    cfg, src, info = _open_hf(p) if p.is_dir() else _open_gguf(p)
    model = build_model(cfg)
    load_weights(model, src, dtype=dtype, device=device, show_progress=show_progress)
    model.eval()
    return model, info
