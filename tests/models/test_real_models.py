"""The three real GGUFs (freetoken.assets) against HF transformers loading the same files.

Goldens come from scripts/make_goldens_transformers.py (transformers fp32, the GGUF
dequantized): 3 prompts x 64 greedy tokens, top-8 logits at each step. FreeToken runs the
prompts + greedy tokens teacher-forced in one batched float32 forward and must:
- agree on the golden top-8 logit values within 1e-3 * max |logit| (two float32
  implementations of the same dequantize-then-matmul math differ by rounding: ~1e-5 relative
  over 18-30 layers; 1e-3 is the bound the issue states);
- pick the reference's top-1 token at every step, except where the reference's own top-2 margin is
  below the observed logit difference (a near-tie; reported). Teacher-forced agreement at
  every step is the same as identical free-running greedy continuations.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from freetoken import assets
from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

DATA = Path(__file__).resolve().parent.parent / "data"
REL_TOL = 1e-3


def _golden(name: str) -> dict:
    path = DATA / f"golden_transformers_{name}.json"
    if not path.exists():
        pytest.fail(f"{path.name} missing: run scripts/make_goldens_transformers.py")
    return json.loads(path.read_text())


def compare(logits: torch.Tensor, p: dict) -> dict:
    """logits [L, V] of prompt+greedy; steps are positions len(prompt)-1 ... L-2."""
    n = len(p["prompt_ids"])
    ids, ref = torch.tensor(p["top_ids"]), torch.tensor(p["top_logits"])  # [64, 8]
    ours = logits[n - 1 : n - 1 + len(ids)]  # [64, V]
    diff = (ours.gather(1, ids) - ref).abs().max(dim=1).values  # per step
    scale = float(ref.abs().max())
    margin = ref[:, 0] - ref[:, 1]
    # The reference's argmax on the same prefix (the golden greedy token, except where
    # generation suppressed end-of-sequence to run the full 64 steps).
    agree = ours.argmax(dim=1) == ids[:, 0]
    near_tie = margin <= diff
    return {"max_diff": float(diff.max()), "rel": float(diff.max()) / scale,
            "agree": int(agree.sum()), "steps": len(ids),
            "disagree_not_tie": [int(i) for i in torch.nonzero(~agree & ~near_tie)],
            "near_ties": [int(i) for i in torch.nonzero(near_tie)],
            "margin": margin, "agree_mask": agree}


@pytest.mark.parametrize("name", assets.known_models())
def test_real_gguf_matches_transformers(name):
    g = _golden(name)
    model, _ = load_model(name, show_progress=False)
    seqs = [p["prompt_ids"] + p["greedy"] for p in g["prompts"]]
    for p, logits in zip(g["prompts"], prefill_logits(model, seqs)):
        r = compare(logits, p)
        print(f"{name} {p['prompt']!r}: max |diff| {r['max_diff']:.2e} ({r['rel']:.1e} rel), "
              f"top-1 {r['agree']}/{r['steps']}, near ties at {r['near_ties']}")
        assert r["rel"] <= REL_TOL
        assert not r["disagree_not_tie"], f"greedy differs at steps {r['disagree_not_tie']}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
