"""The three real GGUFs run the engine's way on the CPU (the prompt prefilled, then one token
per sequence per step; the executor's int8 dots throughout) against transformers' goldens,
teacher-forced.

The int8 path quantizes every linear's input per block of 32 (scale = amax / 127), as llama.cpp
does, so its logits are not transformers' to float rounding (that is the float path's test,
test_real_models.py, under FREETOKEN_CPU_FLOAT=1). llama.cpp's logits on these files differ from
the float reference by up to about 1.0 on a range of about 40 (FACTS.md; 2.5%). Asserted:
- the max |logit difference| over the golden's top-8 ids is at most 5% of the largest |golden
  logit| (the same kind of error, up to twice llama.cpp's share). Observed: SmolLM2 1.37 of 45.8
  (3.0%; on llama.cpp's own text our int8 logits are 1.14 from llama.cpp's, median 0.3), Gemma 3
  and Qwen2.5 lower; a wrong scale or block moves logits by their whole range;
- the top-1 token agrees wherever transformers' own top-2 margin exceeds the observed
  difference (elsewhere the two are a near-tie apart).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from freetoken import assets
from freetoken.models import load_model
from freetoken.models.testing import decode_logits

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
def test_int8_path_against_transformers(name, monkeypatch):
    monkeypatch.delenv("FREETOKEN_CPU_FLOAT")  # this directory's conftest sets it
    tf = json.loads((DATA / f"golden_transformers_{name}.json").read_text())["prompts"]
    model, _ = load_model(name, show_progress=False)
    logits = decode_logits(model, [p["prompt_ids"] for p in tf],
                           [p["greedy"][:STEPS] for p in tf])
    diffs = _top8_diff(logits, tf, lambda p: 0)
    diff = max(float(d.max()) for d in diffs)
    scale = max(float(torch.tensor(p["top_logits"])[:STEPS].abs().max()) for p in tf)
    print(f"\n{name}: int8 path vs transformers max |diff| {diff:.3f} of {scale:.1f}")
    assert diff <= 0.05 * scale
    for lg, p in zip(logits, tf):
        ref = torch.tensor(p["top_logits"])[:STEPS]
        margin = ref[:, 0] - ref[:, 1]
        top1 = lg.argmax(dim=1) == torch.tensor(p["top_ids"])[:STEPS, 0]
        bad = (~top1 & (margin > diff)).nonzero().flatten().tolist()
        assert not bad, f"{p['prompt']!r}: top-1 differs at steps {bad} (margin > {diff:.3f})"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
