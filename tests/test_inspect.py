"""`ft inspect` on the real packaged models (cross-checked with gguf's own GGUFReader), on a small
scaled NVFP4 GGUF, on a damaged file and on an HF directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from freetoken import assets
from freetoken.cli import main

sys.path.insert(0, str(Path(__file__).parent / "formats"))
from gguf_fixtures import write_small_gguf  # noqa: E402


def inspect_json(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["inspect", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def reference_facts(path: Path) -> dict:
    """The same facts read through gguf.GGUFReader, independently of FreeToken."""
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    return {
        "architecture": arch,
        "parameters": sum(int(t.n_elements) for t in r.tensors),
        "context_length": r.fields[f"{arch}.context_length"].contents(),
        "vocab_size": int(emb.shape[1]),  # ggml order: ne[1] = rows = vocabulary
        "tensors": len(r.tensors),
        "chat_template": "tokenizer.chat_template" in r.fields,
    }


@pytest.mark.parametrize("model,template,arch", [(assets.GEMMA3_270M, False, "gemma3"),
                                                 (assets.SMOLLM2, True, "llama")])
def test_real_models(capsys, model: str, template: bool, arch: str):
    rc, s = inspect_json(capsys, model)
    ref = reference_facts(assets.resolve_model(model))
    assert rc == 0 and s["validation"] == "ok"
    for k, v in ref.items():
        assert s[k] == v, k
    assert s["architecture"] == arch and s["chat_template"] is template
    assert s["second_level_scales"] == []


def test_default_model_text(capsys):
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "llama" in out and "chat template        yes" in out and "validation           ok" in out


def test_scaled_nvfp4_and_verdict(tmp_path: Path, capsys):
    p = write_small_gguf(tmp_path / "s.gguf")
    rc, s = inspect_json(capsys, str(p))
    assert rc == 0 and "NVFP4" in s["quantization"]
    assert s["second_level_scales"] == ["blk.0.ffn_down.weight"]
    # the scale tensors are not parameters
    assert s["parameters"] == 4 * 64 + 64 + 3 * 8 * 64 + 8 * 256 + 8 * 128
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 8), np.float32))
    w.add_tensor("blk.0.attn_q.scale", np.ones(1, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    rc, s = inspect_json(capsys, str(bad))
    assert rc == 1 and "blk.0.attn_q.scale" in s["validation"]


def test_unreadable_file_is_a_clean_error(tmp_path: Path, capsys):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"not a model at all, just words" * 4)
    assert main(["inspect", str(p)]) == 1
    assert "junk.gguf" in capsys.readouterr().err


def test_hf_directory(tmp_path: Path, capsys):
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "max_position_embeddings": 256, "vocab_size": 32}))
    save_file({"model.embed_tokens.weight": torch.zeros(32, 16),
               "model.norm.weight": torch.ones(16)}, str(d / "model.safetensors"))
    rc, s = inspect_json(capsys, str(d))
    assert rc == 0 and s["validation"] == "ok"
    assert s["architecture"] == "LlamaForCausalLM" and s["parameters"] == 32 * 16 + 16
    assert s["context_length"] == 256 and s["vocab_size"] == 32 and s["chat_template"] is False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
