"""Loading from files: the HF directory and the GGUFs llama.cpp's converter makes of it.

References (float32, CPU): the HF directory against the transformers model itself; each GGUF
against transformers loading that same GGUF (`from_pretrained(dir, gguf_file=...)`, which
dequantizes it to float), so f32, bf16 and q8_0 all compare "dequantize, then float matmul"
with the same weights. Tolerance as in test_parity_hf.py: max |diff| <= 1e-4 * max |logit|.
The GGUF path exercises llama.cpp's conventions (q/k row permutation of llama, gemma norms
stored as 1 + w, tied embeddings without `output.weight`, llama3 `rope_freqs`).
"""

from __future__ import annotations

import sys

import pytest
import tiny_models as tm
import torch

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

TOL = 1e-4
OUTTYPES = ("f32", "bf16", "q8_0")


def _hf_gguf_reference(arch, path):
    """transformers' dequantized weights of the GGUF in a model built from the HF config.

    transformers' GGUF loader reads the weights faithfully but not every hyperparameter (it
    drops llama3 rope scaling, which llama.cpp keeps as `rope_freqs`, and qwen3's explicit
    head_dim), so the reference takes its config from the original HF directory and its
    weights from the GGUF.
    """
    from transformers import AutoModelForCausalLM

    g = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                             config=tm.hf_config(arch), dtype=torch.float32)
    ref = tm.make_hf_model(arch)
    ref.load_state_dict(g.state_dict())
    return ref.eval()


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_hf_dir(arch):
    model, src = load_model(tm.hf_dir(arch), show_progress=False)
    assert src.kind == "hf" and model.config.arch == arch
    seqs = tm.prompts()
    err = tm.rel_err(prefill_logits(model, seqs), tm.hf_logits(tm.make_hf_model(arch), seqs))
    print(f"{arch} hf dir: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("arch", tm.ARCHS)
def test_gguf(arch, outtype):
    path = tm.gguf_path(arch, outtype)
    model, src = load_model(path, show_progress=False)
    assert src.kind == "gguf" and model.config.arch == arch
    seqs = tm.prompts()
    ref = tm.hf_logits(_hf_gguf_reference(arch, path), seqs)
    err = tm.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} gguf {outtype}: {err:.2e}")
    assert err <= TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
