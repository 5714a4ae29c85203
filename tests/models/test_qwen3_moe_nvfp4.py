"""qwen3-moe in NVFP4 with second-level scales on every matrix and every expert.

Our ModelOpt quantizer writes the small random qwen3-moe (tiny_moe) with its own
weight_scale_2 per matrix and per expert (~1.1e-4, so a dropped scale shows); llama.cpp's
converter turns it into an NVFP4 GGUF whose experts carry `ffn_*_exps.scale` [E] tensors.

- Both FreeToken paths (HF ModelOpt directory, GGUF) match transformers holding the GGUF's
  weights as gguf-py's numpy `gguf.quants` dequantizes them with the `.scale`s folded in (the
  two files hold identical values: tests/formats/test_nvfp4_hf_gguf_parity.py). Tolerance
  1e-4 * max |logit| as for float models: FreeToken multiplies results by the scales instead of
  the weights, which differs by float32 rounding only.
- With the scales dropped (the banks set to ones) the same comparison fails by O(1).
- Greedy decoding gives identical tokens on both paths for 64 tokens, by a plain loop over the
  model and by the engine's offline `LLM`.
- An NVFP4 `token_embd` with its `.scale` (which the reference system refuses) loads and
  matches on both paths.
- Refused at start-up: --dtype float16 with scaled NVFP4 weights; per-expert scales on a
  merged `ffn_gate_up_exps` tensor.
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import tiny_moe as tmoe
import torch

from freetoken.formats.errors import FormatError
from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

TOL = 1e-4
ARCH = "qwen3_moe"
N_TOKENS = 64


@pytest.fixture(scope="module")
def paths():
    return tmoe.nvfp4_paths(ARCH)


@pytest.fixture(scope="module")
def reference(paths):
    return tmoe.nvfp4_gguf_reference(ARCH, paths)


def _banks(model):
    return [layer.mlp.experts.bank for layer in model.model.layers]


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_logits_match_dequantized_reference(paths, reference, kind):
    model, src = load_model(paths[kind], show_progress=False)
    assert src.kind == kind
    for bank in _banks(model):
        assert bank.w13.fmt == "nvfp4" and bank.w2.fmt == "nvfp4"
        s = bank.scales
        assert bool((s[:, :3] < 1e-3).all()) and bool((s[:, 3] == 1).all())
        assert len(set(s[:, 0].tolist())) == 8, "one gate scale per expert"
    seqs, ref = reference
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} nvfp4 {kind}: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_dropped_expert_scales_fail(paths, reference, kind):
    model, _ = load_model(paths[kind], show_progress=False)
    for bank in _banks(model):
        bank.scales.fill_(1.0)
    seqs, ref = reference
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} nvfp4 {kind}, scales dropped: {err:.2e}")
    assert err > 100 * TOL


def test_greedy_hf_and_gguf_identical(paths):
    """A plain greedy loop over each model, and the engine's offline LLM on each file."""
    prompt = tmoe.prompts(1)[0]
    tmoe.assert_greedy_hf_gguf_identical(ARCH, paths, prompt, N_TOKENS)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_nvfp4_token_embd_with_scale(kind):
    hf = tmoe.nvfp4_dir(ARCH, embed=True)
    path = {"hf": hf, "gguf": tmoe.gguf_path(ARCH, "f32", src=hf)}[kind]
    model, _ = load_model(path, show_progress=False)
    emb = model.model.embed_tokens.weight
    assert emb.fmt == "nvfp4" and emb.scale2 is not None and float(emb.scale2) < 1e-3
    seqs = tmoe.prompts()
    ref = tmoe.hf_logits(tmoe.gguf_reference(ARCH, tmoe.gguf_path(ARCH, "f32", src=hf)), seqs)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} nvfp4 with NVFP4 token_embd, {kind}: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_float16_refused(paths, kind):
    with pytest.raises(FormatError, match="float16"):
        load_model(paths[kind], dtype=torch.float16, show_progress=False)


def _merge_gate_up(src, dst, layer: int = 0) -> None:
    """Copy a GGUF, replacing one layer's ffn_gate_exps / ffn_up_exps (and their per-expert
    `.scale`s) by a merged `ffn_gate_up_exps` with one `[E]` scale."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch=r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    t = {x.name: x for x in r.tensors}
    g, u = f"blk.{layer}.ffn_gate_exps", f"blk.{layer}.ffn_up_exps"
    for name, x in t.items():
        if name.startswith((g, u)):
            continue
        w.add_tensor(name, np.array(x.data), raw_dtype=x.tensor_type)
    merged = np.concatenate([np.array(t[g + ".weight"].data), np.array(t[u + ".weight"].data)],
                            axis=1)
    w.add_tensor(f"blk.{layer}.ffn_gate_up_exps.weight", merged,
                 raw_dtype=gguf.GGMLQuantizationType.NVFP4)
    w.add_tensor(f"blk.{layer}.ffn_gate_up_exps.scale", np.array(t[g + ".scale"].data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_merged_gate_up_with_expert_scales_refused(paths, tmp_path):
    bad = tmp_path / "merged.gguf"
    _merge_gate_up(paths["gguf"], bad)
    with pytest.raises(FormatError, match="merged gate.up") as e:
        load_model(bad, show_progress=False)
    assert "blk.0.ffn_gate_up_exps.scale" in str(e.value)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
