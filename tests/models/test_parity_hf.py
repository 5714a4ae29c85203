"""FreeToken vs HF transformers, float32 on the CPU, small random models of each architecture.

Tolerance: max |logit diff| <= 1e-4 * max |logit|. Both sides compute the same float32 math in
different orders (fused vs separate projections, paged vs contiguous attention): rounding
differences are ~1e-6 relative after a few layers; any convention error (rotary layout, gemma's
1 + w norms, window, scaling) moves logits by O(1) relative.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import tiny_models as tm

from freetoken.models.config import from_hf
from freetoken.models.loader import load_weights
from freetoken.models.registry import build_model
from freetoken.models.sources import StateDictSource
from freetoken.models.testing import prefill_logits

TOL = 1e-4


@pytest.mark.parametrize("arch", tm.ARCHS)
def test_state_dict_matches_transformers(arch):
    hf = tm.make_hf_model(arch)
    cfg = from_hf(hf.config.to_dict())
    model = build_model(cfg)
    load_weights(model, StateDictSource(hf.state_dict()), show_progress=False)
    seqs = tm.prompts()
    err = tm.rel_err(prefill_logits(model, seqs), tm.hf_logits(hf, seqs))
    print(f"{arch}: max |diff| / max |logit| = {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("arch,change", [
    ("gemma3", {"attn_scale": 48**-0.5}),  # a query scale other than the checkpoint's
    ("gemma3", {"sliding_window": None}),  # local layers attending globally
    ("llama", {"rope_scaling": None}),  # llama3 rope scaling dropped
])
def test_tolerance_catches_convention_errors(arch, change):
    """The same comparison fails by orders of magnitude when one hyperparameter is wrong."""
    hf = tm.make_hf_model(arch)
    model = build_model(dataclasses.replace(from_hf(hf.config.to_dict()), **change))
    load_weights(model, StateDictSource(hf.state_dict()), show_progress=False)
    seqs = tm.prompts()
    assert tm.rel_err(prefill_logits(model, seqs), tm.hf_logits(hf, seqs)) > 100 * TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
