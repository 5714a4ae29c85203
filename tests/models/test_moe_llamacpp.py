"""The llama.cpp-quantized MoE GGUFs (test_moe_gguf_types.py) against llama.cpp itself,
teacher-forced on llama.cpp's own greedy output, as test_llamacpp.py does for the dense models.

Goldens: scripts/make_moe_quant_gguf.py (llama-cpp-python; CI reads the committed JSON): per
prompt llama.cpp's tokens, 64 greedy tokens, and its top-8 logits at each step. llama.cpp
quantizes activations (8-bit, Q8_K / Q8_0) before its quantized dot products, so its logits
differ from FreeToken's float math: no fixed tolerance on values. Reported: max |logit diff|
over llama.cpp's top-8 ids and top-1 agreement. Asserted: top-1 agrees at every step where
llama.cpp's own top-2 margin exceeds the file's observed max |diff|, and the diff stays
below a quarter of llama.cpp's logit range (a misread expert type or scale gives O(range)).
Random tiny models have flat logits (small top-2 margins), so near-ties are common.

Observed (2 threads): qwen3-moe max |diff| 0.46 of max |logit| 8.2, top-1 174/192; gemma4
1.12 of 13.2, 192/192; qwen3.5-moe 1.10 of 8.2, 171/192. On the F32 conversions of the same
models (`make_moe_quant_gguf.py --f32-check`, not committed: ~55 MB each) the diffs are
0.031 / 0.008 / 0.0007 with top-1 191-192/192 (llama.cpp's f16 KV cache), so the architectures
agree and the quantized files' diffs are llama.cpp's activation quantization.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_real_models import compare

from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_moe_quant_gguf as mq  # noqa: E402


@pytest.mark.parametrize("arch", list(mq.MODELS))
def test_teacher_forced_against_llamacpp(arch):
    g = json.loads(mq.golden_file(arch).read_text())
    assert g["model"] == mq.gguf_file(arch).name
    model, _ = load_model(mq.gguf_file(arch), show_progress=False)
    seqs = [p["prompt_ids"] + p["greedy"] for p in g["prompts"]]
    rs = [compare(lg, p) for p, lg in zip(g["prompts"], prefill_logits(model, seqs))]
    diff = max(r["max_diff"] for r in rs)
    agree, steps = sum(r["agree"] for r in rs), sum(r["steps"] for r in rs)
    margins = [float(m) for r in rs for m in r["margin"]]
    scale = max(abs(v) for p in g["prompts"] for row in p["top_logits"] for v in row)
    tested = sum(m > diff for m in margins)
    print(f"{arch} vs llama.cpp: max |logit diff| {diff:.3f} (max |logit| {scale:.2f}), "
          f"top-1 {agree}/{steps}, {tested} steps with margin > diff")
    for p, r in zip(g["prompts"], rs):
        bad = (~r["agree_mask"] & (r["margin"] > diff)).nonzero().flatten().tolist()
        assert not bad, f"{p['prompt']!r}: top-1 differs at steps {bad} with margin > {diff}"
    assert diff < 0.25 * scale


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
