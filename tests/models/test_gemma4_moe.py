"""gemma4 (MoE and dense text models): FreeToken float32 logits vs HF transformers on small
random models (tiny_moe): a sliding layer (window 8 < prompt lengths 9..40, head 32, theta 1e4)
and a full layer (head 64, "proportional" rotary turning a quarter of the frequencies), v norm,
query scale 1, final soft-capping; the MoE model adds the router (norm, scale, per-expert
scale), fused experts in parallel with the dense MLP, and layer_scalar 0.7 on every layer.

Source: the saved HF directory (transformers 5 writes gemma4's experts fused as
`experts.gate_up_proj` / `experts.down_proj`). Tolerance 1e-4 * max |logit| as for the other
models (test_qwen3_moe.py says why); dropping per_expert_scale fails it by O(1) (checked).

Not covered here: the GGUF path (this converter reads `global_head_dim` from transformers'
config object, which transformers 5 folds into `per_layer_config`, and it writes router and
per-expert scales as `.scale` tensors beside float weights, which formats/scales.py refuses),
NVFP4, per-layer input embeddings, KV sharing and attention_k_eq_v.
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


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
