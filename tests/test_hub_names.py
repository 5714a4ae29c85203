"""Models by hub name: `org/name` and `org/name:file.gguf` resolve through huggingface_hub's
local cache, laid out here by the test itself (refs/main -> snapshots/<commit>/...), never
downloaded. With no cached copy and no network the error is one line naming the folder it
looked in. The GGUF in the fake cache is SmolLM2's packaged file (a symlink, as the hub cache
itself links blobs), so `ft inspect org/name:file.gguf` reads a real model through the name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken import assets
from freetoken.commands.serve import served_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _repo(cache: Path, repo: str, files: dict[str, Path | str]) -> Path:
    """A cached repository as huggingface_hub writes it; files: name -> target or text."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snap = root / "snapshots" / COMMIT
    for name, content in files.items():
        path = snap / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            path.symlink_to(content)
        else:
            path.write_text(content)
    return snap


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf = assets.smollm2_path()
    _repo(hub, "acme/smol-gguf", {"smol-q4_1.gguf": gguf})
    _repo(hub, "acme/many-gguf", {"a-q4.gguf": gguf, "sub/b-q8.gguf": gguf})
    _repo(hub, "acme/smol-hf", {"config.json": json.dumps({"model_type": "llama"}),
                                "model.safetensors": "not read here"})
    return hub


def test_file_of_a_gguf_repository(cache):
    p = assets.resolve_model("acme/many-gguf:sub/b-q8.gguf")
    assert p == cache / "models--acme--many-gguf" / "snapshots" / COMMIT / "sub" / "b-q8.gguf"
    assert p.resolve() == assets.smollm2_path().resolve()


def test_only_gguf_and_hf_directory(cache):
    snap = cache / "models--acme--smol-gguf" / "snapshots" / COMMIT
    assert assets.resolve_model("acme/smol-gguf") == snap / "smol-q4_1.gguf"
    hf = assets.resolve_model("acme/smol-hf")
    assert hf.is_dir() and (hf / "config.json").exists()


def test_ambiguous_or_missing_file_names_the_choices(cache):
    with pytest.raises(assets.AssetMissing, match=r"2 GGUF files.*acme/many-gguf:FILE.*a-q4"):
        assets.resolve_model("acme/many-gguf")
    with pytest.raises(assets.AssetMissing, match="nope.gguf"):
        assets.resolve_model("acme/smol-gguf:nope.gguf")


def test_missing_offline_is_one_line_with_the_path(cache):
    with pytest.raises(assets.AssetMissing) as e:
        assets.resolve_model("acme/not-cached")
    msg = str(e.value)
    assert "\n" not in msg and str(cache / "models--acme--not-cached") in msg
    assert "HF_HUB_OFFLINE" in msg


def test_a_local_path_wins_and_names_are_served_as_given(cache, tmp_path, monkeypatch):
    local = tmp_path / "acme" / "smol-gguf"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # a folder that happens to look like a hub name is a path
    assert assets.resolve_model("acme/smol-gguf") == Path("acme/smol-gguf")
    monkeypatch.chdir(cache)
    assert served_name("acme/smol-gguf:smol-q4_1.gguf") == "acme/smol-gguf"


def _ft(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=300)


def test_cli_through_the_cache_and_no_network(cache):
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    r = _ft("inspect", "acme/smol-gguf:smol-q4_1.gguf", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["architecture"] == "llama"
    # Not cached, online allowed, but the hub is unreachable (a closed port on this machine):
    # the download is tried and fails, in one line that names the cache folder.
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2"}
    r = _ft("inspect", "acme/not-cached", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "could not be downloaded" in lines[0]
    assert str(cache / "models--acme--not-cached") in lines[0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
