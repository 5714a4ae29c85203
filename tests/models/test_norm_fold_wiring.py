"""Folding (kernels/norm.py): each decoder layer whose MoE may compute the next residual step
knows that step's norm (the next layer's input norm, the final norm after the last), without
that norm becoming a module of the layer's (it would appear twice in the module tree, and the
loader would look for its weights under the layer's name). On the CPU no fold is offered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.kernels import norm
from freetoken.models.dummy import load_dummy

DATA = Path(__file__).resolve().parents[1] / "data"


# qwen3-moe (llama's layer) and qwen3.5-moe (its hybrid layers: the shared expert's receive)
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", str(DATA / "tiny_qwen3_5_moe_q4k-mxfp4.gguf")])
def test_layers_know_the_next_norm_and_do_not_own_it(model):
    model = load_dummy(model, "bf16", device="cpu")
    layers = list(model.model.layers)
    want = [n.input_layernorm for n in layers[1:]] + [model.model.norm]
    assert [layer.next_norm for layer in layers] == want
    assert all(layer.next_norm is w for layer, w in zip(layers, want))
    assert not any("next_norm" in name for name, _ in model.named_modules())
    assert not any("next_norm" in name for name in model.state_dict())


def test_no_fold_is_offered_on_the_cpu():
    r, w = torch.randn(2, 64), torch.ones(64)
    with norm.folding(w, 1e-6, True, r):
        assert norm.take_fold(torch.randn(2, 64)) is None
    assert norm.take_fold(r) is None
