"""The three real GGUFs decoded the engine's way on the CPU (one token per sequence per step:
the executor's int8 dots) against transformers' goldens, teacher-forced.

The int8 path quantizes activations per block of 32 (scale = amax / 127), as llama.cpp does, so
its logits are not transformers' to float rounding (that is the prefill path's test,
test_real_models.py). The reference for how far 8-bit activations move these models' logits is
llama.cpp itself: on the same files, teacher-forced on its own greedy text, llama.cpp's top-8
logits differ from FreeToken's float path by `llama_diff` (measured here, from the committed
llama.cpp goldens). Asserted:
- the decode path's max |logit difference| from transformers is at most 1.5 x llama_diff (the
  same kind of error, at most half as large again: the block rules are the same, the order of
  the sums differs);
- the top-1 token agrees wherever transformers' own top-2 margin exceeds the decode path's
  observed difference (elsewhere the two are a near-tie apart).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from freetoken import assets
from freetoken.models import load_model
from freetoken.models.testing import decode_logits, prefill_logits

DATA = Path(__file__).resolve().parent.parent / "data"
STEPS = 24  # of the goldens' 64: enough steps past the first near-ties, a few seconds a model


def _top8_diff(logits: list[torch.Tensor], prompts: list[dict], offset) -> list[torch.Tensor]:
    """Per prompt, per step: max |ours - golden| over the golden's top-8 ids."""
    out = []
    for lg, p in zip(logits, prompts):
        ids, ref = torch.tensor(p["top_ids"]), torch.tensor(p["top_logits"])
        ours = lg[offset(p) : offset(p) + STEPS]
        out.append((ours.gather(1, ids[:STEPS]) - ref[:STEPS]).abs().max(dim=1).values)
    return out


@pytest.mark.parametrize("name", assets.known_models())
def test_decode_path_against_transformers(name):
    tf = json.loads((DATA / f"golden_transformers_{name}.json").read_text())["prompts"]
    lc = json.loads((DATA / f"golden_llamacpp_{name}.json").read_text())["prompts"]
    model, _ = load_model(name, show_progress=False)

    # llama.cpp's distance from float math: our prefill path (float) on llama.cpp's own text
    seqs = [p["prompt_ids"] + p["greedy"] for p in lc]
    float_logits = prefill_logits(model, seqs)
    llama_diff = max(float(d.max()) for d in _top8_diff(
        float_logits, lc, lambda p: len(p["prompt_ids"]) - 1))

    logits = decode_logits(model, [p["prompt_ids"] for p in tf],
                           [p["greedy"][:STEPS] for p in tf])
    diffs = _top8_diff(logits, tf, lambda p: 0)
    diff = max(float(d.max()) for d in diffs)
    print(f"\n{name}: decode path vs transformers max |diff| {diff:.3f}; "
          f"llama.cpp vs float {llama_diff:.3f}")
    assert diff <= 1.5 * llama_diff
    for lg, p in zip(logits, tf):
        ref = torch.tensor(p["top_logits"])[:STEPS]
        margin = ref[:, 0] - ref[:, 1]
        top1 = lg.argmax(dim=1) == torch.tensor(p["top_ids"])[:STEPS, 0]
        bad = (~top1 & (margin > diff)).nonzero().flatten().tolist()
        assert not bad, f"{p['prompt']!r}: top-1 differs at steps {bad} (margin > {diff:.3f})"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
