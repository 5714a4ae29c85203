"""MoE GGUFs quantized by llama.cpp itself: FreeToken's logits vs transformers on gguf-py's
dequantization of the same file.

Files: tests/data/tiny_<arch>_q4k-mxfp4.gguf, made by scripts/make_moe_quant_gguf.py (random
tiny qwen3-moe, gemma4 and qwen3.5-moe models, converted to BF16 by llama.cpp's converter, then
requantized by llama.cpp's quantizer: layer-0 routed experts Q4_K, layer-1 experts MXFP4, other
matrices Q8_0 / llama.cpp's fallbacks, tied token embedding TQ1_0). The script's docstring says
why these types and sizes; llama.cpp cannot make NVFP4 (the converter does, tested in
test_qwen3_moe_nvfp4.py).

Reference: the same transformers model class holding every tensor of the file as gguf-py's
numpy `gguf.quants` dequantizes it (tiny_moe / tiny_qwen3_5 .gguf_reference), float32 on the
CPU: "dequantize, then float matmul" on identical weights, so only summation order differs.
Tolerance 1e-4 * max |logit|, as the f32/bf16/q8_0 MoE tests state (observed ~1e-6); a
misread Q4_K sub-block scale or MXFP4 E8M0 exponent moves logits by O(1) relative.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tiny_moe as tmoe

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_moe_quant_gguf as mq  # noqa: E402

TOL = 1e-4


def experts_of(model) -> list:
    """The expert bank of every layer (qwen3-moe / qwen3.5: mlp.experts; gemma4: experts)."""
    out = []
    for layer in model.model.layers:
        mod = getattr(layer, "experts", None) or layer.mlp.experts
        out.append(mod.bank)
    return out


@pytest.mark.parametrize("arch", list(mq.MODELS))
def test_quantized_experts_match_reference(arch):
    import gguf

    path = mq.gguf_file(arch)
    model, src = load_model(path, show_progress=False)
    assert src.kind == "gguf"
    T = gguf.GGMLQuantizationType
    want = [T.Q4_K, T.MXFP4]  # layer 0, layer 1 (the script's recipe)
    for i, bank in enumerate(experts_of(model)):
        for w in (bank.w13, bank.w2):
            assert w.fmt == "gguf" and w.ggml_type == want[i], (arch, i, w.fmt, w.ggml_type)
    seqs = tmoe.prompts()
    ref = tmoe.hf_logits(mq.gguf_reference(arch, path), seqs)
    err = tmoe.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} {path.name}: {err:.2e}")
    assert err <= TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
