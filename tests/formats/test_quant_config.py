"""Quantization configs as real checkpoints write them -> QuantConfig, and what is refused.

The config shapes follow published checkpoints: ModelOpt's hf_quant_config.json and its newer
config.json `quantization_config` (quant_method modelopt, `ignore`), compressed-tensors NVFP4
(`config_groups`, `ignore` with `re:` entries), DeepSeek/Qwen FP8 (`weight_block_size`), gpt-oss
MXFP4 (`modules_to_not_convert`).
"""

from __future__ import annotations

import json
import sys

import pytest

from freetoken.formats.errors import FormatError
from freetoken.formats.quant_config import QuantConfig, load_quant_config


def write(d, config: dict | None = None, hf_quant: dict | None = None):
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["X"]}
    if config is not None:
        cfg["quantization_config"] = config
    (d / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return d


def test_unquantized(tmp_path):
    assert load_quant_config(write(tmp_path)) is None
    (tmp_path / "empty").mkdir()
    assert load_quant_config(tmp_path / "empty") is None  # no config.json: nothing declared
    with pytest.raises(FormatError, match="missing.json"):
        load_quant_config(tmp_path / "missing.json")


def test_modelopt_hf_quant_config(tmp_path):
    q = load_quant_config(write(tmp_path, hf_quant={
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}))
    assert q.method == "modelopt_nvfp4" and q.group_size == 16 and q.block_size is None
    assert q.source.endswith("hf_quant_config.json")
    assert not q.is_quantized("lm_head")
    assert not q.is_quantized("model.layers.3.mlp.gate")
    assert q.is_quantized("model.layers.3.mlp.gate_proj")
    assert q.is_quantized("model.layers.3.mlp.experts.0.gate_proj")


def test_modelopt_config_json(tmp_path):
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    q = load_quant_config(write(tmp_path, {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "producer": {"name": "modelopt"},
        "ignore": ["lm_head", "model.layers.0.self_attn*"],
        "config_groups": {"group_0": {"weights": fp4, "input_activations": fp4,
                                      "targets": ["Linear"]}}}))
    assert q.method == "modelopt_nvfp4" and q.exclude == ("lm_head", "model.layers.0.self_attn*")
    assert not q.is_quantized("model.layers.0.self_attn.q_proj")
    assert q.is_quantized("model.layers.1.self_attn.q_proj")


def test_compressed_tensors_nvfp4(tmp_path):
    w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
    q = load_quant_config(write(tmp_path, {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "ignore": ["lm_head", "re:.*mlp.gate$"],
        "config_groups": {"group_0": {"weights": w, "input_activations": w,
                                      "format": "nvfp4-pack-quantized",
                                      "targets": ["Linear"]}}}))
    assert q.method == "compressed_tensors_nvfp4" and q.group_size == 16
    assert not q.is_quantized("model.layers.5.mlp.gate")
    assert q.is_quantized("model.layers.5.mlp.gate_proj")


def test_fp8_block(tmp_path):
    q = load_quant_config(write(tmp_path, {"quant_method": "fp8", "fmt": "e4m3",
                                           "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]}))
    assert q.method == "fp8_block" and q.block_size == (128, 128) and q.exclude == ()
    assert q.is_quantized("anything")


def test_mxfp4_gpt_oss(tmp_path):
    q = load_quant_config(write(tmp_path, {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}))
    assert q.method == "mxfp4" and q.group_size == 32
    assert not q.is_quantized("model.layers.7.self_attn.q_proj")  # a parent is excluded
    assert not q.is_quantized("model.layers.7.mlp.router")
    assert q.is_quantized("model.layers.7.mlp.experts.gate_up_proj")


REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4}, "quant_method"),
    "modelopt fp8": ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo"),
    "per-tensor fp8": ({"quant_method": "fp8"}, "weight_block_size"),
    "fp8 e5m2": ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
    "ct int4": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {}}, "format"),
    "ct group 32": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                     "config_groups": {"g": {"weights": {"group_size": 32}}}}, "config_groups"),
    "bad ignore": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": "lm_head"},
                   "ignore"),
    "bad regex": ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                   "ignore": ["re:(("]}, "ignore"),
    "not an object": ([1], "quantization_config"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(tmp_path, case):
    qc, key = REFUSED[case]
    with pytest.raises(FormatError, match=f"config.json.*{key}"):
        load_quant_config(write(tmp_path, qc))


def test_refused_hf_quant_config(tmp_path):
    with pytest.raises(FormatError, match="hf_quant_config.json.*quant_algo.*FP8"):
        load_quant_config(write(tmp_path, hf_quant={"quantization": {"quant_algo": "FP8"}}))
    (tmp_path / "hf_quant_config.json").write_text("{nope")
    with pytest.raises(FormatError, match="hf_quant_config.json.*JSON"):
        load_quant_config(tmp_path)
    with pytest.raises(FormatError, match="group_size"):
        load_quant_config(write(tmp_path, hf_quant={"quantization": {
            "quant_algo": "NVFP4", "group_size": 32}}))


def test_dataclass_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown quantization method"):
        QuantConfig("int3", 16)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
