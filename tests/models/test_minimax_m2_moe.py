"""minimax-m2: FreeToken float32 logits vs HF transformers on a small random model
(tiny_moe: sigmoid router with a random `e_score_correction_bias`, whole-projection q/k norms,
partial rotary over 16 of 32 head dims, experts w1/w3/w2).

Sources: the saved HF directory (one module per expert under `block_sparse_moe`) and the GGUFs
llama.cpp's converter makes of it (f32, bf16, q8_0; `ffn_*_exps` and `exp_probs_b.bias`), each
GGUF against transformers holding its weights as gguf-py's numpy `gguf.quants` dequantizes them.
Tolerance 1e-4 * max |logit| (test_qwen3_moe.py says why). The correction bias changes which
experts run: a loader that dropped it fails the HF-directory comparison by O(1) (checked).

NVFP4: our quantizer's ModelOpt checkpoint (per-expert weight_scale_2 ~1e-4) loads from the HF
directory and matches transformers holding its weights dequantized from the format's
definition (tiny_moe.nvfp4_reference); dropping the bank scales fails. llama.cpp's converter
cannot convert it (`Can not map tensor ...experts.0.w1.weight`: its NVFP4 expert path expects
gate_proj / up_proj / down_proj names, as the seed notes for MiniMax-M2.5-NVFP4), so there
is no NVFP4 GGUF of minimax-m2 to compare.
"""

from __future__ import annotations

import sys

import pytest
import tiny_moe as tmoe

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

TOL = 1e-4
ARCH = "minimax_m2"


def _layers_moe(model):
    return [layer.block_sparse_moe for layer in model.model.layers]


def test_hf_dir():
    model, src = load_model(tmoe.hf_dir(ARCH), show_progress=False)
    assert src.kind == "hf" and model.config.arch == ARCH and model.config.rotary_dim == 16
    seqs = tmoe.prompts()
    ref = tmoe.hf_logits(tmoe.make_hf_model(ARCH), seqs)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} hf dir: {err:.2e}")
    assert err <= TOL
    for moe in _layers_moe(model):
        moe.e_score_correction_bias.value.zero_()
    dropped = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} hf dir without the correction bias: {dropped:.2e}")
    assert dropped > 100 * TOL


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_gguf(outtype):
    path = tmoe.gguf_path(ARCH, outtype)
    model, src = load_model(path, show_progress=False)
    assert src.kind == "gguf" and model.config.arch == ARCH and model.config.rotary_dim == 16
    seqs = tmoe.prompts()
    err = tmoe.rel_err(prefill_logits(model, seqs),
                       tmoe.hf_logits(tmoe.gguf_reference(ARCH, path), seqs))
    print(f"{ARCH} gguf {outtype}: {err:.2e}")
    assert err <= TOL


def test_hf_nvfp4():
    path = tmoe.nvfp4_dir(ARCH)
    model, _ = load_model(path, show_progress=False)
    banks = [moe.experts.bank for moe in _layers_moe(model)]
    assert all(b.w13.fmt == "nvfp4" and bool((b.scales[:, :3] < 1e-3).all()) for b in banks)
    seqs = tmoe.prompts()
    ref = tmoe.hf_logits(tmoe.nvfp4_reference(ARCH, path), seqs)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{ARCH} hf nvfp4: {err:.2e}")
    assert err <= TOL
    for b in banks:
        b.scales.fill_(1.0)
    assert tmoe.rel_err(prefill_logits(model, seqs), ref) > 100 * TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
