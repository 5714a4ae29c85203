"""Small GGUF files for tests: valid ones written by gguf's own GGUFWriter, hostile ones byte by
byte (a tiny encoder independent of FreeToken's parser)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import torch

from freetoken.formats.nvfp4 import modelopt_to_gguf_nvfp4

T = gguf.GGMLQuantizationType


def random_nvfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 (codes [..., N, K/2], positive E4M3 scales [..., N, K/16]) at random."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    codes = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
    # Positive finite E4M3 bytes 0x00..0x7E, as ModelOpt and llama.cpp's converter write them.
    sbytes = torch.randint(0, 0x7F, (*lead, n, k // 16), generator=g, dtype=torch.uint8)
    return codes, sbytes.view(torch.float8_e4m3fn)


def write_small_gguf(path: Path, *, seed: int = 0) -> Path:
    """A valid GGUF with metadata of several types and tensors of several formats."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_block_count(1)
    w.add_string("general.name", "tiny")
    w.add_bool("test.flag", True)
    w.add_float32("test.f32", 0.25)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>", "\u00e9t\u00e9"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.5, 3.0])
    w.add_tensor("token_embd.weight", rng.standard_normal((4, 64)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float16))
    for name, qt in [("blk.0.attn_q.weight", T.Q4_0), ("blk.0.attn_k.weight", T.Q8_0),
                     ("blk.0.attn_v.weight", T.BF16), ("blk.0.ffn_up.weight", T.Q4_K)]:
        cols = 256 if qt == T.Q4_K else 64
        raw = gguf.quants.quantize(rng.standard_normal((8, cols)).astype(np.float32), qt) \
            if qt != T.Q4_K else rng.integers(0, 256, (8, 144), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=qt)
    codes, scales = random_nvfp4((8, 128), seed)
    w.add_tensor("blk.0.ffn_down.weight", modelopt_to_gguf_nvfp4(codes, scales).numpy(),
                 raw_dtype=T.NVFP4)
    w.add_tensor("blk.0.ffn_down.scale", np.array([3e-4], dtype=np.float32))
    w.add_tensor("blk.0.ffn_down.input_scale", np.array([1.0], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- a raw encoder for hand-made (and hostile) files ----------------------------------------------
def s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, v: int) -> bytes:
    return s(key) + struct.pack("<II", gguf.GGUFValueType.UINT32, v)


def kv_str(key: str, v: str) -> bytes:
    return s(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + s(v)


def tinfo(name: str, ne: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return (s(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", qtype, offset))


def raw_gguf(kvs: list[bytes], infos: list[bytes], data: bytes, *, version: int = 3,
             n_tensors: int | None = None, n_kv: int | None = None, align: int = 32,
             magic: bytes = b"GGUF") -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % align)
    return head + data
