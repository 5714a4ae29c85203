"""Strict loading and the engine-facing interface.

- Missing, extra and half-fused names, unknown architectures and bad shapes fail with a
  FormatError naming the tensor / key (and, for architectures, the supported list).
- Chunked prefill + decode through the paged cache, batched with another sequence, gives the
  logits of one full prefill (1e-5 relative: the same float32 math in different batch shapes).
"""

from __future__ import annotations

import sys

import pytest
import tiny_models as tm
import torch

from freetoken.formats.errors import FormatError
from freetoken.models import load_model
from freetoken.models.config import from_gguf, from_hf
from freetoken.models.loader import load_weights
from freetoken.models.registry import build_model
from freetoken.models.sources import GGUFSource, StateDictSource
from freetoken.models.testing import SimpleKV, prefill_logits


def _load_sd(arch: str, edit) -> None:
    hf = tm.make_hf_model(arch)
    sd = dict(hf.state_dict())
    edit(sd)
    load_weights(build_model(from_hf(hf.config.to_dict())), StateDictSource(sd),
                 show_progress=False)


def test_missing_tensor_named():
    with pytest.raises(FormatError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj"):
        _load_sd("llama", lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"))


def test_extra_tensor_named():
    with pytest.raises(FormatError, match=r"unexpected tensors.*model\.layers\.0\.foo\.weight"):
        _load_sd("qwen3", lambda sd: sd.__setitem__("model.layers.0.foo.weight", torch.ones(2)))


def test_half_fused_named():
    def drop_v(sd):
        sd.pop("model.layers.2.self_attn.v_proj.weight")
        sd.pop("model.layers.2.self_attn.v_proj.bias")

    with pytest.raises(FormatError, match=r"half-fused model\.layers\.2\.self_attn\.qkv_proj.*"
                                          r"not model\.layers\.2\.self_attn\.v_proj\.weight"):
        _load_sd("qwen2", drop_v)


def test_missing_bias_and_bad_shape():
    with pytest.raises(FormatError, match=r"missing tensors: model\.layers\.0\.self_attn\.k_proj"
                                          r"\.bias"):
        _load_sd("qwen2", lambda sd: sd.pop("model.layers.0.self_attn.k_proj.bias"))
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*expected"):
        _load_sd("llama", lambda sd: sd.__setitem__("model.layers.0.mlp.up_proj.weight",
                                                    torch.ones(256, 64)))


def test_unknown_architecture():
    with pytest.raises(FormatError, match=r"'mamba'.*supported: llama, qwen2, qwen3, gemma3"):
        from_hf({"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
    with pytest.raises(FormatError, match=r"'rwkv6'.*supported: llama"):
        from_gguf({"general.architecture": "rwkv6"}, vocab_size=10)


class _Hiding:
    """A GGUFFile with one tensor hidden, as if the file lacked it."""

    def __init__(self, gf, hide: str):
        self.gf, self.path, self.arch = gf, gf.path, gf.arch
        self.tensors = {k: v for k, v in gf.tensors.items() if k != hide}

    def weight(self, name):
        return self.gf.weight(name)


def test_gguf_missing_tensor_named():
    from freetoken.formats.gguf import GGUFFile

    path = tm.gguf_path("gemma3", "q8_0")
    model, src = load_model(path, show_progress=False)
    gf = GGUFFile(path)
    fresh = build_model(src.config)
    with pytest.raises(FormatError, match=r"missing tensors: blk\.3\.post_ffw_norm\.weight"):
        load_weights(fresh, GGUFSource(_Hiding(gf, "blk.3.post_ffw_norm.weight"), 6),
                     show_progress=False)


@torch.inference_mode()
def test_chunked_prefill_and_decode_match_full_prefill():
    model, _ = load_model(tm.hf_dir("gemma3"), show_progress=False)  # window 8, pages of 4
    a, b = tm.prompts(2)
    full = prefill_logits(model, [a, b])
    kv = SimpleKV(model.kv_cache_shapes(), num_pages=32, page_size=4)
    got = {0: [], 1: []}
    # a: chunks of 7 then single tokens; b: whole prompt at once, then single tokens.
    plan = [[(0, 7), (1, 5)], [(0, 7), (1, 4)], [(0, 7)], [(0, 1), (1, 0)], [(0, 1)]]
    pos = {0: 0, 1: 0}
    for step in plan:
        step = [(s, n) for s, n in step if n]
        ctx = kv.context(step, all_logits=True)
        ids = torch.tensor([t for s, n in step for t in (a, b)[s][pos[s]: pos[s] + n]])
        logits = model.compute_logits(model(ids, ctx)).split([n for _, n in step])
        for (s, n), lg in zip(step, logits):
            got[s].append(lg)
            pos[s] += n
    for s, ref in ((0, full[0]), (1, full[1])):
        mine = torch.cat(got[s])
        assert mine.shape[0] == pos[s]
        assert float((mine - ref[: pos[s]]).abs().max() / ref.abs().max()) < 1e-5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
