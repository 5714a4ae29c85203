"""qwen3.5-moe and qwen3.5 (dense) in NVFP4 with second-level scales on every matrix.

Our ModelOpt quantizer writes the small random models of tiny_qwen3_5 with their own
weight_scale_2 per matrix and per expert (~1e-4, so a dropped scale shows): attention, the
gated delta-net's projections, the shared expert and the routed experts; routers, the shared
expert gate, embeddings, the head and conv1d stay float. llama.cpp's converter turns each into
an NVFP4 GGUF (its V-head reorder applied to the packed NVFP4 rows), the experts with
`ffn_*_exps.scale` [E].

- Both FreeToken paths match transformers holding the GGUF's weights as gguf-py's numpy
  `gguf.quants` dequantizes them, the `.scale`s folded in and the converter's transforms undone
  (tiny_qwen3_5.gguf_reference). Tolerance 1e-4 * max |logit| as in test_qwen3_moe_nvfp4.py.
- With the scales dropped (expert banks set to ones; the dense model's MLP second-level scales
  removed) the comparison fails by far more than the tolerance.
- Greedy decoding gives identical tokens on both paths for 64 tokens (plain loop and `LLM`).
"""

from __future__ import annotations

import sys

import pytest
import tiny_moe as tmoe
import tiny_qwen3_5 as tq

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

TOL = 1e-4
N_TOKENS = 64


@pytest.fixture(scope="module", params=tq.ARCHS)
def case(request):
    arch = request.param
    hf = tmoe.nvfp4_dir(arch, src=tq.hf_dir(arch))
    paths = {"hf": hf, "gguf": tq.gguf_path(arch, "f32", src=hf)}
    seqs = tq.prompts()
    return arch, paths, seqs, tq.hf_logits(tq.gguf_reference(arch, paths["gguf"]), seqs)


def _banks(model):
    return [m.bank for m in model.modules() if hasattr(m, "bank")]


def _drop_scales(model) -> None:
    banks = _banks(model)
    for bank in banks:
        bank.scales.fill_(1.0)
    if not banks:  # dense: every MLP's second-level scales
        for layer in model.model.layers:
            for lin in (layer.mlp.gate_up_proj, layer.mlp.down_proj):
                for w in lin.weights:
                    w.scale2 = None


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_logits_match_dequantized_reference(case, kind):
    arch, paths, seqs, ref = case
    model, src = load_model(paths[kind], show_progress=False)
    assert src.kind == kind
    banks = _banks(model)
    assert len(banks) == (4 if arch == "qwen3_5_moe" else 0)
    for bank in banks:
        assert bank.w13.fmt == "nvfp4" and bank.w2.fmt == "nvfp4"
        assert bool((bank.scales[:, :3] < 1e-3).all())
        assert len(set(bank.scales[:, 0].tolist())) == 8, "one gate scale per expert"
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} nvfp4 {kind}: {err:.2e}")
    assert err <= TOL
    _drop_scales(model)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} nvfp4 {kind}, scales dropped: {err:.2e}")
    assert err > 100 * TOL


def test_greedy_hf_and_gguf_identical(case, monkeypatch):
    """A plain greedy loop over each model, and the engine's offline LLM on each file. In
    float math (FREETOKEN_CPU_FLOAT=1): the GGUF orders the V heads its own way, so the CPU's
    int8 decode dots would quantize the out projection's input in other blocks of 32 than on
    the HF side, and a near-tie of this random model could go either way."""
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")
    arch, paths, _, _ = case
    prompt = tq.prompts(1)[0]
    tmoe.assert_greedy_hf_gguf_identical(arch, paths, prompt, N_TOKENS)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
