"""The ModelOpt NVFP4 quantizer against float64 math from NVFP4's definition, and its output files.

Reference (float64, brute force, written here from the format's definition):
  weight_scale_2 = amax(|W|) / (6 * 448);
  block scale = the E4M3 value nearest to amax(|block|) / (6 * weight_scale_2) (ties to the even
  mantissa, saturating at 448), found by searching all 127 non-negative finite E4M3 values;
  code = the E2M1 value nearest to w / (block scale * weight_scale_2), ties to the even code.
Our quantizer computes in fp32; the quotients agree with float64 except within ~1e-7 relative
of a rounding boundary, which random normal data hits with probability ~1e-6 per element, so the
codes and scales are compared exactly (a tie case is built separately, where all math is exact).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from freetoken.formats.dequant import dequantize
from freetoken.formats.modelopt_quantize import e2m1_codes, quantize_checkpoint, quantize_nvfp4
from freetoken.formats.quant_config import load_quant_config
from freetoken.formats.safetensors import HFCheckpoint

E2M1_MAGS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def e4m3_values() -> torch.Tensor:
    """All non-negative finite E4M3 values (bytes 0..126) from the definition, float64."""
    b = torch.arange(127)
    e, m = b >> 3, b & 7
    return torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, e.double() - 7))


def nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest table value (ties to the even index), x >= 0, float64."""
    d = (x.unsqueeze(-1) - table).abs()
    best = d.min(-1, keepdim=True).values
    hits = d == best
    first = hits.int().argmax(-1)
    two = hits.sum(-1) > 1
    return torch.where(two & (first % 2 == 1), first + 1, first)


def reference(w: torch.Tensor):
    w = w.double()
    n, k = w.shape
    s2 = (w.abs().max() / 2688).float().double()  # stored as fp32
    blocks = w.reshape(n, k // 16, 16)
    e4 = e4m3_values()
    want = (blocks.abs().amax(-1) / (6 * s2)).clamp(max=448)
    scale = e4[nearest(want, e4)]  # [N, K/16]
    # A zero block scale (all-zero or underflowing block) decodes every code to 0: write 0s.
    den = (scale * s2)[..., None]
    q = torch.where(den > 0, blocks / den, 0.0).clamp(-6, 6)
    mag = nearest(q.abs(), E2M1_MAGS)
    codes = mag + 8 * (q < 0).long()
    return s2, scale, codes.reshape(n, k)


def test_quantize_matches_definition():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g) * 0.02
    w[3, :16] = 0  # an all-zero block: scale 0, codes 0
    w[5, 16:32] *= 1e-6  # a block whose scale underflows E4M3's range
    codes, scales, s2 = quantize_nvfp4(w)
    r_s2, r_scale, r_codes = reference(w)
    assert s2.dtype == torch.float32 and s2.shape == () and s2.item() == r_s2.item()
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (96, 16)
    assert torch.equal(scales.float().double(), r_scale)
    ours = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).long()
    assert torch.equal(ours, r_codes)
    # dequantized error is at most half a step of the coarsest E2M1 gap used (2 -> 6: 1.0)
    deq = (E2M1_MAGS[ours % 8] * (1 - 2 * (ours // 8))) * r_scale.repeat_interleave(16, 1) * r_s2
    assert (deq - w.double()).abs().max() <= 1.0 * r_scale.max() * r_s2


def test_e2m1_ties_go_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -5.0, 0.2499])
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 14, 0], dtype=torch.uint8)
    assert torch.equal(e2m1_codes(x), want)


def test_checkpoint_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05
    src = tmp_path / "src"
    src.mkdir()
    t = {"model.embed_tokens.weight": r(32, 64), "lm_head.weight": r(32, 64),
         "model.norm.weight": torch.ones(64), "model.layers.0.mlp.gate.weight": r(4, 64)}
    for p in ("q", "k", "v"):
        t[f"model.layers.0.self_attn.{p}_proj.weight"] = r(64, 64) * (1 + "qkv".index(p))
    for e in range(4):
        for p in ("gate", "up"):
            t[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] = r(32, 64) * (e + 1)
    save_file(t, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "x"}))
    (src / "tokenizer.json").write_text("{}")
    dst = quantize_checkpoint(src, tmp_path / "dst", calibrate=False, scale2="shared")
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt" and hq["quantization"]["quant_algo"] == "NVFP4"
    assert hq["quantization"]["group_size"] == 16
    excl = hq["quantization"]["exclude_modules"]
    assert excl == ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"]
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == excl
    assert load_quant_config(dst).method == "modelopt_nvfp4"
    assert (dst / "tokenizer.json").is_file()
    ck = HFCheckpoint(dst)
    assert ck.weight("model.embed_tokens").fmt == "f32"
    assert ck.weight("model.layers.0.mlp.gate").fmt == "f32"
    s2 = {p: ck.weight(p).scale2.item() for p in ck.weight_prefixes()
          if ck.weight(p).fmt == "nvfp4"}
    assert len(s2) == 3 + 8
    # "shared": q/k/v share one scale (the largest amax), gate/up of each expert share one,
    # and experts differ from each other (a per-expert scale stays per expert).
    attn = {v for p, v in s2.items() if "self_attn" in p}
    assert len(attn) == 1
    amax_v = t["model.layers.0.self_attn.v_proj.weight"].abs().max()
    assert attn == {(amax_v / 2688).item()}
    per_expert = [{s2[f"model.layers.0.mlp.experts.{e}.{p}_proj"] for p in ("gate", "up")}
                  for e in range(4)]
    assert all(len(s) == 1 for s in per_expert) and len(set.union(*per_expert)) == 4
    # dequantized weights are close to the originals (NVFP4's error: within 1/4 of amax)
    w = t["model.layers.0.mlp.experts.2.up_proj.weight"]
    deq = dequantize(ck.weight("model.layers.0.mlp.experts.2.up_proj"), apply_scale2=True)
    assert (deq - w).abs().max() <= w.abs().max() / 4


def test_tensor_mode_and_refusals(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    a = torch.randn(16, 32)
    save_file({"x.q_proj.weight": a, "x.k_proj.weight": a * 3}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    ck = HFCheckpoint(quantize_checkpoint(src, tmp_path / "dst", calibrate=False))
    assert ck.weight("x.k_proj").scale2.item() == pytest.approx(3 * ck.weight("x.q_proj")
                                                                .scale2.item(), rel=1e-6)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(tmp_path / "dst", tmp_path / "again", calibrate=False)
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(4, 24))


def test_command_line_with_calibration(tmp_path, capsys):
    """`python -m ... SRC DST` on a real transformers model: input_scale = amax(|x|) / 2688."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from freetoken.formats.modelopt_quantize import main

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(tmp_path / "src")
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--max-shard-bytes", "20000"]) == 0
    ck = HFCheckpoint(tmp_path / "dst")
    assert (tmp_path / "dst" / "model.safetensors.index.json").is_file()
    # Recompute the calibration input of down_proj with transformers itself (same seed/tokens).
    seen = {}
    mlp = model.model.layers[0].mlp
    h = mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    want = seen["x"].abs().max() / 2688
    got = ck.tensor("model.layers.0.mlp.down_proj.input_scale")
    assert got.shape == () and got.item() == pytest.approx(want.item(), rel=1e-6)
    assert "wrote" in capsys.readouterr().out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
