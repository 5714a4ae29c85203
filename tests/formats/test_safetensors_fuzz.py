"""Fuzz: a few hundred mutations of a valid sharded ModelOpt NVFP4 directory (shards, index,
config.json, hf_quant_config.json). Each case must either load, with every tensor readable and
every weight assembled and dequantized (or refused with FormatError), or raise FormatError when
opened. No other exception type, no crash, and no case that does more work than its bytes
hold: the elements read and dequantized stay within a small multiple of the files' size (a
wall-clock bound would depend on how busy the machine is). Deterministic seed.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from freetoken.formats.dequant import dequantize
from freetoken.formats.errors import FormatError
from freetoken.formats.safetensors import HFCheckpoint

N_CASES = 200  # per base variant
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
JSONS = ("model.safetensors.index.json", "config.json", "hf_quant_config.json")
JUNK = [-1, 2**64, 2**63 - 1, 1.5, "F32", "U8", "F8_E4M3", None, [], {}, [0], [1, 2, 3], True,
        [2**40, 2**40], "\u00e9", [-4, 4]]


def build_base(d: Path, quant_in: str) -> Path:
    g = torch.Generator().manual_seed(0)
    t1 = {"model.embed_tokens.weight": torch.randn(8, 32, generator=g),
          "model.norm.weight": torch.ones(32),
          "model.layers.0.mlp.up_proj.weight": torch.randint(0, 256, (16, 16), generator=g,
                                                             dtype=torch.uint8),
          "model.layers.0.mlp.up_proj.weight_scale":
              torch.full((16, 2), 2.0).to(torch.float8_e4m3fn),
          "model.layers.0.mlp.up_proj.weight_scale_2": torch.tensor(0.01),
          "model.layers.0.mlp.up_proj.input_scale": torch.tensor(0.1)}
    t2 = {"lm_head.weight": torch.randn(8, 32, generator=g).bfloat16(),
          "model.layers.0.mlp.down_proj.weight": torch.randint(0, 256, (32, 8), generator=g,
                                                               dtype=torch.uint8),
          "model.layers.0.mlp.down_proj.weight_scale":
              torch.full((32, 1), 0.5).to(torch.float8_e4m3fn),
          "model.layers.0.mlp.down_proj.weight_scale_2": torch.tensor(0.02)}
    d.mkdir()
    save_file(t1, d / SHARDS[0], metadata={"format": "pt"})
    save_file(t2, d / SHARDS[1], metadata={"format": "pt"})
    wm = {**{n: SHARDS[0] for n in t1}, **{n: SHARDS[1] for n in t2}}
    (d / JSONS[0]).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8}
    if quant_in == "config.json":
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
        cfg["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"weights": fp4, "targets": ["Linear"]}}}
    else:
        (d / JSONS[2]).write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    (d / JSONS[1]).write_text(json.dumps(cfg))
    return d


# -- mutations: each takes (bytes, rng) and returns (bytes, description) ------------------------


def flip(raw: bytes, rng: random.Random, header_only: bool) -> tuple[bytes, str]:
    b = bytearray(raw)
    hi = min(len(b), 8 + struct.unpack("<Q", raw[:8])[0]) if header_only else len(b)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(hi)
        b[i] = rng.randrange(256)
    return bytes(b), "byte flips" + (" (header)" if header_only else "")


def truncate(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    n = rng.randrange(len(raw))
    return raw[:n], f"truncate to {n}"


def length_field(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    (n,) = struct.unpack("<Q", raw[:8])
    new = rng.choice([0, 1, n - 1, n + 1, n + 8, 2**63, 2**64 - 1, len(raw), rng.randrange(2**32)])
    return struct.pack("<Q", new) + raw[8:], f"length field {n} -> {new}"


def edit_header(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    (n,) = struct.unpack("<Q", raw[:8])
    h, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    names = [k for k in h if k != "__metadata__"]
    name = rng.choice(names)
    what = rng.choice(["dtype", "shape", "data_offsets", "swap", "delete", "metadata", "extra"])
    if what == "swap":
        other = rng.choice(names)
        h[name]["data_offsets"], h[other]["data_offsets"] = (h[other]["data_offsets"],
                                                             h[name]["data_offsets"])
    elif what == "delete":
        del h[name]
    elif what == "metadata":
        h["__metadata__"] = rng.choice(JUNK)
    elif what == "extra":
        h[name]["extra"] = 1
    else:
        h[name][what] = rng.choice(JUNK)
    hb = json.dumps(h).encode()
    return struct.pack("<Q", len(hb)) + hb + data, f"header {what} of {name}"


def edit_json(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    doc = json.loads(raw)
    path, node = [], doc
    while isinstance(node, dict) and node and rng.random() < 0.7:
        key = rng.choice(list(node))
        path.append(key)
        if not isinstance(node[key], dict | list) or rng.random() < 0.3:
            break
        node = node[key] if isinstance(node[key], dict) else node
    parent = doc
    for k in path[:-1]:
        parent = parent[k] if isinstance(parent.get(k), dict) else parent
    if path and rng.random() < 0.3:
        parent.pop(path[-1], None)
        return json.dumps(doc).encode(), f"delete {path}"
    if path:
        parent[path[-1]] = rng.choice(JUNK)
    return json.dumps(doc).encode(), f"set {path}"


def mutate(d: Path, rng: random.Random) -> str:
    target = rng.choice([f for f in SHARDS + JSONS if (d / f).exists()])
    f = d / target
    raw = f.read_bytes()
    if target in SHARDS:
        op = rng.choice(["flip_h", "flip_h", "flip", "truncate", "length", "edit", "edit"])
        raw, what = {"flip_h": lambda: flip(raw, rng, True), "flip": lambda: flip(raw, rng, False),
                     "truncate": lambda: truncate(raw, rng),
                     "length": lambda: length_field(raw, rng),
                     "edit": lambda: edit_header(raw, rng)}[op]()
    elif rng.random() < 0.5:
        raw, what = edit_json(raw, rng)
    elif rng.random() < 0.5:
        raw, what = flip(struct.pack("<Q", len(raw)) + raw, rng, True)
        raw = raw[8:]
    elif rng.random() < 0.5:
        raw, what = truncate(raw, rng)
    else:
        f.unlink()
        return f"delete {target}"
    f.write_bytes(raw)
    return f"{target}: {what}"


# Elements produced per byte of the files: a stored tensor yields at most one element per byte,
# NVFP4 dequantizes to two per code byte; anything far beyond means a header made the loader
# invent work (a shape not backed by data).
WORK_PER_BYTE = 4


def exercise(d: Path) -> tuple[str, int]:
    """Open and use everything: ('loaded' or 'refused' (FormatError at open), elements made)."""
    try:
        ck = HFCheckpoint(d)
    except FormatError:
        return "refused", 0
    work = 0
    for name in ck.tensor_names():
        work += ck.tensor(name).numel()
    for p in ck.weight_prefixes():
        try:
            work += dequantize(ck.weight(p), apply_scale2=True).numel()
        except FormatError:
            pass
    ck.metadata_summary()
    return "loaded", work


@pytest.mark.parametrize("quant_in", ["hf_quant_config.json", "config.json"])
def test_fuzz(tmp_path, quant_in):
    base = build_base(tmp_path / "base", quant_in)
    assert exercise(base)[0] == "loaded"
    rng = random.Random(f"20261129-{quant_in}")
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(N_CASES):
        d = tmp_path / f"c{i}"
        shutil.copytree(base, d)
        what = mutate(d, rng)
        size = sum(f.stat().st_size for f in d.iterdir())
        try:
            outcome, work = exercise(d)
        except Exception as e:  # noqa: BLE001 - the point: nothing but FormatError may escape
            pytest.fail(f"case {i} ({what}): {type(e).__name__}: {e}")
        outcomes[outcome] += 1
        assert work <= WORK_PER_BYTE * size, f"case {i} ({what}): {work} elements from {size} B"
        shutil.rmtree(d)
    # Both outcomes must occur, or the mutations are not exercising anything.
    print(quant_in, outcomes)
    assert outcomes["refused"] > N_CASES // 3 and outcomes["loaded"] > 10, outcomes


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
