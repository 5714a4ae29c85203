"""Dense NVFP4 with second-level scales: ModelOpt checkpoint and its llama.cpp GGUF.

H2's quantizer writes a ModelOpt NVFP4 copy of the small random llama (every matrix its own
weight_scale_2, ~1e-4..1e-3, "shared" variant: q/k/v and gate/up share one as ModelOpt's export
does); llama.cpp's converter turns it into a GGUF with NVFP4 tensors and `.scale` siblings (and
permutes q/k rows, which the loader undoes on the NVFP4 rows).
- Both paths decode the same 64 greedy tokens (free-running, through the paged cache).
- Both match transformers run on the dequantized weights (W * weight_scale_2, by H1's
  dequantize) within 1e-4 * max |logit|: (x @ W^T) * s and x @ (W s)^T differ by rounding only.
- Dropping the scales is caught; --dtype float16 is refused with the reason.
"""

from __future__ import annotations

import sys

import pytest
import tiny_models as tm
import torch
import util

from freetoken.formats.errors import FormatError
from freetoken.models import load_model
from freetoken.models.testing import SimpleKV, prefill_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def nvfp4_dir():
    from freetoken.formats.modelopt_quantize import quantize_checkpoint

    out = util.test_cache() / "tiny-llama-v2-nvfp4"
    if not (out / "config.json").exists():
        quantize_checkpoint(tm.hf_dir("llama"), out, scale2="shared")
    return out


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int = 64) -> list[int]:
    kv = SimpleKV(model.kv_cache_shapes(), num_pages=16, page_size=8)
    toks, new = list(prompt), list(prompt)
    for _ in range(n):
        ctx = kv.context([(0, len(new))])
        hidden = model(torch.tensor(new), ctx)
        new = [int(model.compute_logits(hidden[ctx.logits_indices]).argmax(-1)[0])]
        toks += new
    return toks[len(prompt):]


def _dequantized_reference(path):
    from freetoken.formats.dequant import dequantize
    from freetoken.formats.safetensors import HFCheckpoint

    ck = HFCheckpoint(path)
    ref = tm.make_hf_model("llama")
    sd = {}
    for name in ref.state_dict():
        prefix = name.removesuffix(".weight")
        sd[name] = dequantize(ck.weight(prefix), apply_scale2=True)
    ref.load_state_dict(sd)
    return ref


def test_hf_and_gguf_nvfp4_agree_and_match_dequantized(nvfp4_dir):
    gguf_file = tm.gguf_path("llama", "f32", src=nvfp4_dir)
    m_hf, _ = load_model(nvfp4_dir, show_progress=False)
    m_gg, _ = load_model(gguf_file, show_progress=False)
    qkv = m_gg.model.layers[0].self_attn.qkv_proj.weights
    assert [w.fmt for w in qkv] == ["nvfp4"] and qkv[0].scale2.shape == (256,)  # per row
    seqs = tm.prompts()
    ref = tm.hf_logits(_dequantized_reference(nvfp4_dir), seqs)
    e_hf, e_gg = tm.rel_err(prefill_logits(m_hf, seqs), ref), tm.rel_err(
        prefill_logits(m_gg, seqs), ref)
    print(f"nvfp4 vs dequantized transformers: hf {e_hf:.2e}, gguf {e_gg:.2e}")
    assert e_hf <= TOL and e_gg <= TOL
    t_hf, t_gg = greedy(m_hf, seqs[1]), greedy(m_gg, seqs[1])
    assert t_hf == t_gg


def test_dropped_scales_are_caught(nvfp4_dir):
    model, _ = load_model(nvfp4_dir, show_progress=False)
    seqs = tm.prompts(1)
    ref = prefill_logits(model, seqs)
    for w in model.model.layers[0].mlp.down_proj.weights:
        w.scale2 = None
    assert tm.rel_err(prefill_logits(model, seqs), ref) > 100 * TOL


def test_float16_refused(nvfp4_dir):
    with pytest.raises(FormatError, match="float16.*scale.*overflow"):
        load_model(nvfp4_dir, dtype=torch.float16, show_progress=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
