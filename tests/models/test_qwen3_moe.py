"""qwen3-moe: FreeToken float32 logits vs HF transformers on a small random model.

Sources: transformers' in-memory state dict (fused `experts.gate_up_proj`, with and without
`norm_topk_prob`), the saved HF directory (one module per expert, stacked at load time), and
the GGUFs llama.cpp's converter makes of it (f32, bf16, q8_0: stacked `ffn_*_exps`). Each GGUF
is compared with transformers holding that file's weights as gguf-py's numpy `gguf.quants`
dequantizes them (tiny_moe.gguf_reference), so quantized files compare "dequantize, then float
matmul" on identical weights.

Tolerance: max |diff| <= 1e-4 * max |logit|, as for the dense models: both sides run the same
float32 math in different orders (~1e-6 relative after two layers); a wrong routing convention
(no renormalisation, sigmoid for softmax, gate/up swapped) moves logits by O(1) relative, and
the routers are drawn with a spread that keeps top-k margins far above rounding.
"""

from __future__ import annotations

import sys

import pytest
import tiny_moe as tmoe

from freetoken.formats.qweight import QuantWeight
from freetoken.models import load_model
from freetoken.models.config import from_hf
from freetoken.models.loader import load_weights
from freetoken.models.registry import build_model
from freetoken.models.sources import StateDictSource
from freetoken.models.testing import prefill_logits

TOL = 1e-4
ARCH = "qwen3_moe"


def _banks(model) -> list:
    return [m.mlp.experts.bank for m in model.model.layers]


@pytest.mark.parametrize("norm", [True, False])
def test_state_dict(norm):
    hf = tmoe.make_hf_model(ARCH, norm_topk_prob=norm)
    model = build_model(from_hf(hf.config.to_dict()))
    load_weights(model, StateDictSource(hf.state_dict()), show_progress=False)
    seqs = tmoe.prompts()
    err = tmoe.rel_err(prefill_logits(model, seqs), tmoe.hf_logits(hf, seqs))
    print(f"{ARCH} state dict norm_topk_prob={norm}: {err:.2e}")
    assert err <= TOL


def test_hf_dir():
    model, src = load_model(tmoe.hf_dir(ARCH), show_progress=False)
    assert src.kind == "hf" and model.config.arch == ARCH and model.config.num_experts == 8
    for bank in _banks(model):
        assert tuple(bank.w13.shape) == (8, 128, 128) and tuple(bank.w2.shape) == (8, 128, 64)
        assert not bank.has_scales()
    seqs = tmoe.prompts()
    err = tmoe.rel_err(prefill_logits(model, seqs), tmoe.hf_logits(tmoe.make_hf_model(ARCH),
                                                                   seqs))
    print(f"{ARCH} hf dir: {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_gguf(outtype):
    path = tmoe.gguf_path(ARCH, outtype)
    model, src = load_model(path, show_progress=False)
    assert src.kind == "gguf" and model.config.arch == ARCH
    w13: QuantWeight = _banks(model)[0].w13
    assert w13.fmt == {"f32": "f32", "bf16": "f32", "q8_0": "gguf"}[outtype]  # bf16 -> model dtype
    seqs = tmoe.prompts()
    err = tmoe.rel_err(prefill_logits(model, seqs),
                       tmoe.hf_logits(tmoe.gguf_reference(ARCH, path), seqs))
    print(f"{ARCH} gguf {outtype}: {err:.2e}")
    assert err <= TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
