"""gemma4 (MoE) in NVFP4 with second-level scales on every matrix and every expert.

Our ModelOpt quantizer writes the small random gemma4 (tiny_moe) with one module per expert
(ModelOpt's layout; transformers saves them fused) and its own weight_scale_2 per matrix and
per expert (~1.1e-4); the router's proj stays float (ModelOpt leaves routers alone).
llama.cpp's converter folds `router.per_expert_scale` into the down experts' weight_scale_2,
so the GGUF's `ffn_down_exps.scale` [E] is their product and FreeToken's router keeps ones
there; from the HF directory the router applies per_expert_scale itself.

- Both FreeToken paths match transformers holding the GGUF's weights as gguf-py's numpy
  `gguf.quants` dequantizes them with the `.scale`s folded in (per_expert_scale then ones).
  Tolerance 1e-4 * max |logit| as in test_qwen3_moe_nvfp4.py: results are multiplied by the
  scales instead of the weights, which differs by float32 rounding only.
- With the expert scales dropped (the banks set to ones) the comparison fails by O(1).
- Greedy decoding gives identical tokens on both paths for 64 tokens (plain loop and `LLM`).
"""

from __future__ import annotations

import sys

import pytest
import tiny_moe as tmoe

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

TOL = 1e-4
ARCH = "gemma4"
N_TOKENS = 64


@pytest.fixture(scope="module")
def paths():
    return tmoe.nvfp4_paths(ARCH)


@pytest.fixture(scope="module")
def reference(paths):
    return tmoe.nvfp4_gguf_reference(ARCH, paths)


def _moe_layers(model):
    return [layer for layer in model.model.layers if layer.moe]


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_logits_match_dequantized_reference(paths, reference, kind):
    model, src = load_model(paths[kind], show_progress=False)
    assert src.kind == kind
    for layer in _moe_layers(model):
        bank = layer.experts.bank
        assert bank.w13.fmt == "nvfp4" and bank.w2.fmt == "nvfp4"
        s = bank.scales
        assert bool((s[:, :3] < 1e-3).all()) and bool((s[:, 3] == 1).all())
        assert len(set(s[:, 0].tolist())) == 8, "one gate scale per expert"
        pes = layer.router.per_expert_scale.value
        # GGUF: folded into the down scales by the converter, so the router keeps ones
        assert bool((pes == 1).all()) == (kind == "gguf")
    seqs, ref = reference
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} nvfp4 {kind}: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_dropped_expert_scales_fail(paths, reference, kind):
    model, _ = load_model(paths[kind], show_progress=False)
    for layer in _moe_layers(model):
        layer.experts.bank.scales.fill_(1.0)
    seqs, ref = reference
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} nvfp4 {kind}, scales dropped: {err:.2e}")
    assert err > 100 * TOL


def test_greedy_hf_and_gguf_identical(paths):
    """A plain greedy loop over each model, and the engine's offline LLM on each file."""
    prompt = tmoe.prompts(1)[0]
    tmoe.assert_greedy_hf_gguf_identical(ARCH, paths, prompt, N_TOKENS)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
