"""HF quantized weights against float64 math written from each format's definition.

Definitions used (not our code): E2M1 = sign, 2 exponent bits (bias 1), 1 mantissa bit, exponent 0
subnormal (m * 0.5); E4M3 (fn) = sign, 4 exponent bits (bias 7), 3 mantissa bits, S.1111.111 NaN,
exponent 0 subnormal (m/8 * 2^-6); E8M0 = 2^(e - 127), 255 NaN (OCP MX v1.0). ModelOpt NVFP4 value
= E2M1(code) * E4M3(block scale) * weight_scale_2, value 2i in the low nibble of byte i.
Exactness: an E2M1 x E4M3 x 2^k product has at most 6 significant bits, and one more fp32 factor
makes at most 30, so the float64 product is exact and its cast to fp32 is the single rounding
fp32 math also makes: equality is expected bit for bit (torch.equal, NaN where NaN).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from freetoken.formats.dequant import dequantize
from freetoken.formats.errors import FormatError
from freetoken.formats.hf_quant import dequant_fp8_block, dequant_mxfp4
from freetoken.formats.safetensors import HFCheckpoint

G = torch.Generator().manual_seed(1234)


def e2m1_f64(c: torch.Tensor) -> torch.Tensor:
    c = c.long()
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    mag = torch.where(e == 0, m * 0.5, (1 + m / 2) * torch.pow(2.0, (e - 1).double()))
    return torch.where(s == 1, -mag, mag).double()


def e4m3_f64(b: torch.Tensor) -> torch.Tensor:
    b = b.long()
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    e_ = e.double()
    mag = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, e_ - 7))
    mag = torch.where((e == 15) & (m == 7), torch.nan, mag)
    return torch.where(s == 1, -mag, mag).double()


def e8m0_f64(b: torch.Tensor) -> torch.Tensor:
    v = torch.pow(2.0, b.double() - 127)
    return torch.where(b == 255, torch.nan, v)


def unpack_lo_first(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] nibbles, value 2i from byte i's low nibble."""
    return torch.stack([packed & 15, packed >> 4], -1).flatten(-2)


def rand_u8(*shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=G, dtype=torch.uint8)


def assert_same(a: torch.Tensor, ref64: torch.Tensor) -> None:
    torch.testing.assert_close(a, ref64.float(), rtol=0, atol=0, equal_nan=True)


# -- the torch references ------------------------------------------------------------------


def test_mxfp4_against_definition():
    blocks, scales = rand_u8(3, 7, 64), rand_u8(3, 7, 4)  # K = 128
    scales[0, 0, :4] = torch.tensor([0, 1, 254, 255], dtype=torch.uint8)  # range ends and NaN
    ref = e2m1_f64(unpack_lo_first(blocks)).unflatten(-1, (4, 32)) * e8m0_f64(scales)[..., None]
    out = dequant_mxfp4(blocks, scales)
    assert out.dtype == torch.float32 and out.shape == (3, 7, 128)
    assert_same(out, ref.flatten(-2))
    # gpt-oss's 4-D layout [..., N, K/32, 16] gives the same numbers
    assert_same(dequant_mxfp4(blocks.unflatten(-1, (4, 16)), scales), ref.flatten(-2))
    with pytest.raises(ValueError, match="MXFP4 scales"):
        dequant_mxfp4(blocks, scales[..., :3])


def test_fp8_block_against_definition():
    data = rand_u8(2, 200, 300)  # partial 128-tiles on both axes
    scale = torch.rand(2, 2, 3, generator=G) * 4 + 0.01
    ref = e4m3_f64(data) * scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[
        :, :200, :300]
    out = dequant_fp8_block(data.view(torch.float8_e4m3fn), scale)
    assert_same(out, ref)
    with pytest.raises(ValueError, match="FP8 block scales"):
        dequant_fp8_block(data.view(torch.float8_e4m3fn), scale[:, :1])


# -- whole weights through HFCheckpoint ------------------------------------------------------


def make_ckpt(d: Path, tensors: dict, quant: dict | None, hf_quant: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["X"], "model_type": "x"}
    if quant is not None:
        cfg["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    save_file(tensors, d / "model.safetensors")
    return d


MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}
HF_QUANT = {"producer": {"name": "modelopt", "version": "0.33.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                             "exclude_modules": ["lm_head"]}}


def nvfp4_tensors(p: str, n: int = 24, k: int = 64, lead: tuple = ()) -> dict:
    scales = torch.randint(0, 0x7F, (*lead, n, k // 16), generator=G, dtype=torch.uint8)
    return {p + ".weight": rand_u8(*lead, n, k // 2),
            p + ".weight_scale": scales.view(torch.float8_e4m3fn),
            p + ".weight_scale_2": torch.rand(lead, generator=G) * 1e-3 + 1e-5,
            p + ".input_scale": torch.tensor(0.01)}


def nvfp4_ref(t: dict, p: str) -> torch.Tensor:
    """float64 E2M1(code) * E4M3(block scale), without the second-level scale."""
    codes = e2m1_f64(unpack_lo_first(t[p + ".weight"]))
    sc = e4m3_f64(t[p + ".weight_scale"].view(torch.uint8))
    return (codes.unflatten(-1, (-1, 16)) * sc[..., None]).flatten(-2)


@pytest.mark.parametrize("where", ["hf_quant_config", "config"])
def test_modelopt_nvfp4(tmp_path, where):
    t = nvfp4_tensors("m.proj")
    ck = HFCheckpoint(make_ckpt(tmp_path, t, MODELOPT if where == "config" else None,
                                HF_QUANT if where != "config" else None))
    qw = ck.weight("m.proj")
    assert qw.fmt == "nvfp4" and qw.shape == (24, 64) and qw.scale2.shape == ()
    assert torch.equal(qw.scale2, t["m.proj.weight_scale_2"])
    ref = nvfp4_ref(t, "m.proj") * t["m.proj.weight_scale_2"].double()
    assert_same(dequantize(qw, apply_scale2=True), ref)
    assert sorted(ck.weight_tensor_names("m.proj")) == sorted(t)


def test_modelopt_nvfp4_per_expert_stack(tmp_path):
    t = nvfp4_tensors("e.w", lead=(3,))
    ck = HFCheckpoint(make_ckpt(tmp_path, t, MODELOPT))
    qw = ck.weight("e.w")
    assert qw.shape == (3, 24, 64) and qw.scale2.shape == (3,)
    ref = nvfp4_ref(t, "e.w") * t["e.w.weight_scale_2"].double()[:, None, None]
    assert_same(dequantize(qw, apply_scale2=True), ref)


def test_compressed_tensors_nvfp4(tmp_path):
    t = nvfp4_tensors("m.proj")
    gs = torch.tensor([1234.5])
    ct = {"m.proj.weight_packed": t["m.proj.weight"], "m.proj.weight_scale":
          t["m.proj.weight_scale"], "m.proj.weight_global_scale": gs,
          "m.proj.input_global_scale": torch.tensor([100.0])}
    q = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore":
         ["lm_head"], "config_groups": {"group_0": {"weights": {"group_size": 16}}}}
    ck = HFCheckpoint(make_ckpt(tmp_path, ct, q))
    qw = ck.weight("m.proj")
    assert qw.fmt == "nvfp4" and torch.equal(qw.scale2, (1.0 / gs).reshape(()))
    # The definition divides by the global scale; we multiply by its fp32 reciprocal (as
    # llama.cpp's converter does): two roundings instead of one, so within 2 ulp.
    ref = nvfp4_ref({"m.proj.weight": ct["m.proj.weight_packed"], **ct}, "m.proj") / gs.double()
    torch.testing.assert_close(dequantize(qw, apply_scale2=True), ref.float(), rtol=2.4e-7,
                               atol=0)
    assert sorted(ck.weight_tensor_names("m.proj")) == sorted(ct)


def test_fp8_block_weight(tmp_path):
    data, s = rand_u8(130, 260), torch.rand(2, 3, generator=G) + 0.5
    data[data & 0x7F == 0x7F] = 0  # no NaN in a real checkpoint
    t = {"m.w.weight": data.view(torch.float8_e4m3fn), "m.w.weight_scale_inv": s}
    q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    qw = HFCheckpoint(make_ckpt(tmp_path, t, q)).weight("m.w")
    assert qw.fmt == "fp8_block" and qw.shape == (130, 260)
    ref = e4m3_f64(data) * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[
        :130, :260]
    assert_same(dequantize(qw), ref)


def test_mxfp4_gpt_oss_weight(tmp_path):
    blocks, scales = rand_u8(2, 6, 4, 16), torch.randint(100, 140, (2, 6, 4), generator=G,
                                                         dtype=torch.uint8)
    p = "model.layers.0.mlp.experts.gate_up_proj"
    t = {p + "_blocks": blocks, p + "_scales": scales, p + "_bias": torch.zeros(2, 6)}
    q = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    ck = HFCheckpoint(make_ckpt(tmp_path, t, q))
    qw = ck.weight(p)
    assert qw.fmt == "mxfp4" and qw.shape == (2, 6, 128)
    ref = e2m1_f64(unpack_lo_first(blocks.flatten(-2))).unflatten(-1, (4, 32)) * e8m0_f64(
        scales)[..., None]
    assert_same(dequantize(qw), ref.flatten(-2))
    assert ck.weight_tensor_names(p) == [p + "_blocks", p + "_scales"]


# -- what a damaged quantized checkpoint gets wrong --------------------------------------------


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


def _replace(key, value):
    return lambda t: {**t, key: value}


BROKEN = {
    "missing block scales": (_drop("m.p.weight_scale"), "m.p.weight_scale'.*missing"),
    "missing weight_scale_2": (_drop("m.p.weight_scale_2"), "weight_scale_2'.*missing"),
    "scale shape": (_replace("m.p.weight_scale", torch.zeros(24, 3, dtype=torch.float8_e4m3fn)),
                    r"m.p.weight_scale'.*shape \[24, 3\].*\[24, 4\]"),
    "scale dtype": (_replace("m.p.weight_scale", torch.zeros(24, 4)), "expected dtype F8_E4M3"),
    "scale2 shape": (_replace("m.p.weight_scale_2", torch.ones(2)), "weight_scale_2'.*shape"),
    "float weight with scales": (_replace("m.p.weight", torch.zeros(24, 64)),
                                 "float weight with quantization scales"),
    "odd dtype": (_replace("m.p.weight", torch.zeros(24, 32, dtype=torch.int16)),
                  "unsupported weight dtype I16"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_nvfp4(tmp_path, case):
    edit, pattern = BROKEN[case]
    ck = HFCheckpoint(make_ckpt(tmp_path, edit(nvfp4_tensors("m.p")), MODELOPT))
    with pytest.raises(FormatError, match=pattern):
        ck.weight("m.p")


def test_quant_tensors_need_a_matching_config(tmp_path):
    t = nvfp4_tensors("m.p")
    with pytest.raises(FormatError, match="quantization config says None"):
        HFCheckpoint(make_ckpt(tmp_path / "a", t, None)).weight("m.p")
    q = {"quant_method": "mxfp4"}
    with pytest.raises(FormatError, match="says 'mxfp4'"):
        HFCheckpoint(make_ckpt(tmp_path / "b", t, q)).weight("m.p")
    fp8 = {"m.w.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)}
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(FormatError, match="weight_scale_inv"):
        HFCheckpoint(make_ckpt(tmp_path / "c", fp8, q)).weight("m.w")
    mx = {"x_blocks": rand_u8(2, 1, 16), "x_scales": rand_u8(2, 2)}
    with pytest.raises(FormatError, match="x_scales"):
        HFCheckpoint(make_ckpt(tmp_path / "d", mx, {"quant_method": "mxfp4"})).weight("x")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
