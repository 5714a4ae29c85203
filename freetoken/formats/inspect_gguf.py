"""What `ft inspect` reports about a GGUF file (and, through H2's HFCheckpoint, an HF directory)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType, LlamaFileType

from freetoken.formats.errors import FormatError
from freetoken.formats.gguf import FLOAT_TYPES, GGUFFile
from freetoken.formats.scales import check_scales, is_scale_tensor, scaled_weights


def _file_type(meta: dict) -> str | None:
    ft = meta.get("general.file_type")
    try:
        return LlamaFileType(ft).name.removeprefix("MOSTLY_") if isinstance(ft, int) else None
    except ValueError:
        return str(ft)


def _vocab_size(g: GGUFFile) -> int | None:
    v = g.metadata.get(f"{g.arch}.vocab_size")
    if isinstance(v, int):
        return v
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    return len(tokens) if isinstance(tokens, list) else None


def summarize_gguf(g: GGUFFile) -> dict:
    """Architecture, parameter count (second-level scale tensors excluded), type histogram,
    quantization formats, scaled weights, context length, vocabulary, chat template, verdict."""
    weights = {n: t for n, t in g.tensors.items() if not is_scale_tensor(n)}
    hist = Counter(t.type_name for t in g.tensors.values())
    quant = sorted({t.type_name for t in weights.values()
                    if GGMLQuantizationType(t.ggml_type) not in FLOAT_TYPES
                    and GGMLQuantizationType(t.ggml_type) != GGMLQuantizationType.F32})
    try:
        check_scales(g)
        verdict = "ok"
    except FormatError as e:
        verdict = f"invalid: {e}"
    ctx = g.metadata.get(f"{g.arch}.context_length")
    return {
        "format": "gguf",
        "path": str(g.path),
        "gguf_version": g.version,
        "architecture": g.arch,
        "name": g.metadata.get("general.name"),
        "file_type": _file_type(g.metadata),
        "tensors": len(g.tensors),
        "parameters": sum(t.numel for t in weights.values()),
        "bytes": sum(t.nbytes for t in g.tensors.values()),
        "tensor_types": dict(sorted(hist.items())),
        "quantization": quant,
        "second_level_scales": scaled_weights(g),
        "context_length": ctx if isinstance(ctx, int) else None,
        "vocab_size": _vocab_size(g),
        "chat_template": isinstance(g.metadata.get("tokenizer.chat_template"), str),
        "validation": verdict,
    }


def summarize_hf(path: Path) -> dict:
    """An HF directory through H2's HFCheckpoint; the verdict assembles every weight."""
    from freetoken.formats.hf_quant import summarize
    from freetoken.formats.safetensors import HFCheckpoint

    with HFCheckpoint(path) as ck:
        out = {"path": str(path), **summarize(ck)}
        try:
            for prefix in ck.weight_prefixes():
                ck.weight(prefix)
            out["validation"] = "ok"
        except FormatError as e:
            out["validation"] = f"invalid: {e}"
    return out


def summarize_path(path: Path) -> dict:
    """GGUF file or HF directory -> summary dict (FormatError if it cannot be opened at all)."""
    if path.is_dir():
        return summarize_hf(path)
    with GGUFFile(path) as g:
        return summarize_gguf(g)
