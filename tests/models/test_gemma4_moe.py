"""gemma4 (MoE and dense text models): FreeToken float32 logits vs HF transformers on small
random models (tiny_moe): a sliding layer (window 8 < prompt lengths 9..40, head 32, theta 1e4)
and a full layer (head 64, "proportional" rotary turning a quarter of the frequencies), v norm,
query scale 1, final soft-capping; the MoE model adds the router (norm, scale, per-expert
scale), fused experts in parallel with the dense MLP, and layer_scalar 0.7 on every layer.

Sources: the saved HF directory (transformers 5 writes gemma4's experts fused as
`experts.gate_up_proj` / `experts.down_proj`) and the GGUFs llama.cpp's converter makes of it
(f32, bf16, q8_0; `ffn_gate_up_exps`, the router's input scale as `ffn_gate_inp.scale`, its
per-expert scale moved to `ffn_down_exps.scale` and so into the bank's s_down column while the
router keeps ones, proportional rotary as `rope_freqs`), each against transformers holding the
file's weights as gguf-py's numpy `gguf.quants` dequantizes them (tiny_moe.gguf_reference,
which takes the rotary from the HF config, not from `rope_freqs`). tiny_moe.gguf_path says how
the converter is made to run on transformers 5 configs and SmolLM2's tokenizer.

Tolerance 1e-4 * max |logit| as for the other models (test_qwen3_moe.py says why); dropping
per_expert_scale (HF) or the bank's s_down column (GGUF) fails it by O(1) (checked).

Not covered: NVFP4 gemma4, per-layer input embeddings, KV sharing and attention_k_eq_v.
"""

from __future__ import annotations

import sys

import pytest
import tiny_moe as tmoe

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

TOL = 1e-4


@pytest.mark.parametrize("arch", ["gemma4", "gemma4_dense"])
def test_hf_dir(arch):
    model, src = load_model(tmoe.hf_dir(arch), show_progress=False)
    cfg = model.config
    assert src.kind == "hf" and cfg.arch == "gemma4" and cfg.layer_types == ("sliding", "full")
    assert cfg.num_experts == (8 if arch == "gemma4" else 0) and cfg.global_head_dim == 64
    seqs = tmoe.prompts()
    ref = tmoe.hf_logits(tmoe.make_hf_model(arch), seqs)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} hf dir: {err:.2e}")
    assert err <= TOL
    if arch == "gemma4":
        for layer in model.model.layers:
            layer.router.per_expert_scale.value.fill_(1.0)
        dropped = tmoe.rel_err(prefill_logits(model, seqs), ref)
        print(f"{arch} without per_expert_scale: {dropped:.2e}")
        assert dropped > 100 * TOL


@pytest.mark.parametrize("arch,outtype", [("gemma4", "f32"), ("gemma4", "bf16"),
                                          ("gemma4", "q8_0"), ("gemma4_dense", "q8_0")])
def test_gguf(arch, outtype):
    path = tmoe.gguf_path(arch, outtype)
    model, src = load_model(path, show_progress=False)
    cfg = model.config
    assert src.kind == "gguf" and cfg.layer_types == ("sliding", "full")
    assert (cfg.head_dim, cfg.global_head_dim, cfg.sliding_window) == (32, 64, 8)
    seqs = tmoe.prompts()
    ref = tmoe.hf_logits(tmoe.gguf_reference(arch, path), seqs)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} gguf {outtype}: {err:.2e}")
    assert err <= TOL
    if arch == "gemma4":
        banks = [layer.experts.bank for layer in model.model.layers]
        assert all(bool((b.scales[:, 2] != 1).all()) for b in banks), "per-expert scale"
        for b in banks:
            b.scales[:, 2] = 1.0
        assert tmoe.rel_err(prefill_logits(model, seqs), ref) > 100 * TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
