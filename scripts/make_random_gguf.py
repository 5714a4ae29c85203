"""Write a random-weight GGUF with Qwen3-30B-A3B's shapes (qwen3moe), for speed comparisons.

    python scripts/make_random_gguf.py OUT.gguf [--expert-type q4_k|nvfp4] [--layers N]

Experts in Q4_K or NVFP4 (the latter with a per-expert fp32 `.scale` tensor beside each of
`ffn_{gate,up,down}_exps`, as llama.cpp's converter writes ModelOpt checkpoints); attention,
embeddings and output in Q8_0; norms and routers F32. The shape flags (`--hidden`, `--vocab`,
...) make small files for tests. A SentencePiece-style vocabulary of placeholder tokens
(`<unk>`, `<s>`, `</s>`, the 256 byte tokens, then `t<id>`) lets llama.cpp load the file;
llama-bench feeds random ids, so no text is ever tokenized.

Fast by construction (the full file is about 18 GB): Q8_0 rows come from a pool of rows that
`gguf.quants` quantized from normal values, drawn in random order per tensor; Q4_K and NVFP4
blocks (which gguf.quants cannot quantize) are random bytes with finite fp16 d / dmin or UE4M3
scales; tensors stream to the file one at a time through `gguf.GGUFWriter`.

Prompts route about uniformly over the experts, as the expert-cache ceilings assume
(`benchmarks/dummy_routing.py --gguf FILE` measures it; tests/test_make_random_gguf.py checks
4 layers). Measured on a 48-layer file of this shape with 256-wide experts: a 128-token
prompt covers 98-100% of each layer's experts, the busiest at most 4.6x the mean share (Q4_K;
NVFP4 4.8x, uniform 2.1x on average). Greedy decoding of the random Q4_K model repeats one
token, so its consecutive decode steps reuse their experts; llama-bench feeds random tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
STD = 0.02
# Routing as the expert-cache ceilings assume it (uniform), as --dummy-weights models do
# (freetoken/models/dummy.py says why): embedding rows of rms 1, so a token's own signal is not
# drowned by what the layers add, and attention's output projection at STD / 8, so its
# prefix average (nearly the same vector for every later token) does not grow layer by layer
# until every token routes alike.
EMBED_RMS = 1.0
OUT_STD = STD / 8
POOL_ROWS = 4096  # distinct Q8_0 rows per row width
SHAPE = dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
             experts=128, top_k=8, expert_ff=768, context=40960)
EXPERT_TYPES = {"q4_k": T.Q4_K, "nvfp4": T.NVFP4}


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order: [..., rows, cols]
    kind: str  # "norm" | "router" | "scale" | "q8_0" | "experts"
    std: float = STD  # spread of a Q8_0 matrix's values


def plan(s: dict) -> list[Tensor]:
    """Every tensor of the file, in llama.cpp's qwen3moe naming."""
    h, q, kv, e, ff = (s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"],
                       s["experts"], s["expert_ff"])
    out = [Tensor("token_embd.weight", (s["vocab"], h), "q8_0", EMBED_RMS)]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [Tensor(b + "attn_norm.weight", (h,), "norm"),
                Tensor(b + "attn_q.weight", (q, h), "q8_0"),
                Tensor(b + "attn_k.weight", (kv, h), "q8_0"),
                Tensor(b + "attn_v.weight", (kv, h), "q8_0"),
                Tensor(b + "attn_output.weight", (h, q), "q8_0", OUT_STD),
                Tensor(b + "attn_q_norm.weight", (s["head_dim"],), "norm"),
                Tensor(b + "attn_k_norm.weight", (s["head_dim"],), "norm"),
                Tensor(b + "ffn_norm.weight", (h,), "norm"),
                Tensor(b + "ffn_gate_inp.weight", (e, h), "router")]
        for part, shape in (("gate", (e, ff, h)), ("up", (e, ff, h)), ("down", (e, h, ff))):
            out.append(Tensor(f"{b}ffn_{part}_exps.weight", shape, "experts"))
            out.append(Tensor(f"{b}ffn_{part}_exps.scale", (e,), "scale"))
    return out + [Tensor("output_norm.weight", (h,), "norm"),
                  Tensor("output.weight", (s["vocab"], h), "q8_0")]


class Maker:
    """Random tensor contents, as the bytes GGUF stores."""

    def __init__(self, expert_type: T, seed: int):
        self.rng = np.random.default_rng(seed)
        self.expert_type = expert_type
        self.pools: dict[tuple[int, float], np.ndarray] = {}

    def bytes(self, shape: tuple[int, ...]) -> np.ndarray:
        n = int(np.prod(shape))
        words = self.rng.integers(0, 2**63, size=-(-n // 8), dtype=np.uint64)
        return words.view(np.uint8)[:n].reshape(shape)

    def f32(self, shape: tuple[int, ...], mean: float, std: float) -> np.ndarray:
        return (mean + std * self.rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)

    def q8_0(self, rows: int, cols: int, std: float = STD) -> np.ndarray:
        key = (cols, std)
        if key not in self.pools:
            pool = self.f32((min(rows, POOL_ROWS), cols), 0.0, std)
            self.pools[key] = gguf.quants.quantize(pool, T.Q8_0)
        pool = self.pools[key]
        return pool[self.rng.integers(0, pool.shape[0], size=rows)]

    def experts(self, shape: tuple[int, ...]) -> np.ndarray:
        block, size = gguf.GGML_QUANT_SIZES[self.expert_type]
        b = self.bytes((*shape[:-1], shape[-1] // block, size))
        lead = b.shape[:-1]
        if self.expert_type == T.Q4_K:  # value = d * sc * q - dmin * m (6-bit sc / m, 4-bit q)
            # dmin = 7.5 d and each sub-block's min m equal to its scale sc: values
            # d sc (q - 7.5), zero mean in every sub-block (random mins gave each sub-block an
            # offset larger than its spread, and deep layers routed alike); rms d x 168 (sc
            # uniform in 0..63, q in 0..15): 0.014, as the NVFP4 experts' (at 0.02 the deep
            # layers of a 48-layer file drifted towards routing alike again).
            d = (self.rng.uniform(0.42, 1.26, size=lead) * 1e-4).astype(np.float16)
            b[..., 0:2] = d[..., None].view(np.uint8)
            b[..., 2:4] = (7.5 * d.astype(np.float32)).astype(np.float16)[..., None].view(
                np.uint8)
            # the 12 scale bytes (llama.cpp's get_scale_min_k4): bytes 0-3 hold sc 0-3 and the
            # high bits of sc 4-7, bytes 4-7 the same of m, bytes 8-11 the low nibbles of sc 4-7
            # (low) and m 4-7 (high): m = sc makes 4-7 a copy of 0-3 and 8-11 two equal nibbles
            b[..., 8:12] = b[..., 4:8]
            b[..., 12:16] = (b[..., 12:16] & 15) * 17
        else:  # NVFP4: 4 UE4M3 scales (halved on decode) in [0.25, 2), then 32 code bytes
            b[..., 0:4] = self.rng.integers(0x30, 0x48, size=(*lead, 4), dtype=np.uint8)
        return b.reshape(*shape[:-1], -1)

    def make(self, t: Tensor) -> np.ndarray:
        if t.kind == "norm":
            return self.f32(t.shape, 1.0, 0.1)
        if t.kind == "router":
            return self.f32(t.shape, 0.0, STD)
        if t.kind == "scale":  # doubled E2M1 (rms ~5.8) x halved block scale (~0.9) x this
            return self.rng.uniform(0.002, 0.003, size=t.shape).astype(np.float32)
        if t.kind == "q8_0":
            return self.q8_0(*t.shape, t.std)
        return self.experts(t.shape)


def _ggml_type(t: Tensor, expert_type: T) -> T | None:
    return {"q8_0": T.Q8_0, "experts": expert_type}.get(t.kind)


def _nbytes(t: Tensor, qtype: T | None) -> tuple[tuple[int, ...], int]:
    """(byte shape, byte count) of a tensor as stored."""
    if qtype is None:
        return t.shape, 4 * int(np.prod(t.shape))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (*t.shape[:-1], t.shape[-1] // block * size)
    return shape, int(np.prod(shape))


def _metadata(w: gguf.GGUFWriter, s: dict, name: str) -> None:
    a = "qwen3moe"
    w.add_name(name)
    for key, value in (("block_count", s["layers"]), ("context_length", s["context"]),
                       ("embedding_length", s["hidden"]), ("feed_forward_length", 6144),
                       ("attention.head_count", s["heads"]),
                       ("attention.head_count_kv", s["kv_heads"]),
                       ("attention.key_length", s["head_dim"]),
                       ("attention.value_length", s["head_dim"]),
                       ("expert_count", s["experts"]), ("expert_used_count", s["top_k"]),
                       ("expert_feed_forward_length", s["expert_ff"])):
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", 1e6)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    _vocab(w, s["vocab"])


def _vocab(w: gguf.GGUFWriter, n: int) -> None:
    if n < 259:
        raise ValueError(f"--vocab must be at least 259 (3 specials + 256 byte tokens), got {n}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"t{i}" for i in range(len(tokens), n)]
    types = [2, 3, 3] + [6] * 256 + [1] * (n - 259)  # unknown, control, byte, normal
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write(path: str, s: dict, expert_fmt: str, seed: int = 0, log=print) -> int:
    """Write the file; returns its tensor data size in bytes."""
    expert_type = EXPERT_TYPES[expert_fmt]
    tensors = [t for t in plan(s) if t.kind != "scale" or expert_type == T.NVFP4]
    for t in tensors:
        q = _ggml_type(t, expert_type)
        if q is not None and t.shape[-1] % gguf.GGML_QUANT_SIZES[q][0]:
            raise ValueError(f"{t.name}: row of {t.shape[-1]} values is not a whole number of "
                             f"{q.name} blocks ({gguf.GGML_QUANT_SIZES[q][0]})")
    w = gguf.GGUFWriter(path, "qwen3moe")
    _metadata(w, s, f"random qwen3moe {expert_fmt} experts")
    total = 0
    for t in tensors:
        q = _ggml_type(t, expert_type)
        shape, nbytes = _nbytes(t, q)
        w.add_tensor_info(t.name, shape, np.dtype(np.uint8 if q else np.float32), nbytes, q)
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    maker, t0 = Maker(expert_type, seed), time.perf_counter()
    for t in tensors:
        w.write_tensor_data(maker.make(t))
        if t.kind == "experts" and t.name.endswith("down_exps.weight"):
            log(f"layer {t.name.split('.')[1]} written, {time.perf_counter() - t0:.1f} s")
    w.close()
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--expert-type", dest="expert_fmt", choices=list(EXPERT_TYPES), default="q4_k",
                   help="format of the routed experts (default q4_k)")
    p.add_argument("--seed", type=int, default=0)
    for key, value in SHAPE.items():
        p.add_argument("--" + key.replace("_", "-"), type=int, default=value,
                       help=f"default {value} (Qwen3-30B-A3B)")
    args = p.parse_args(argv)
    shape = {k: getattr(args, k) for k in SHAPE}
    t0 = time.perf_counter()
    try:
        n = write(args.out, shape, args.expert_fmt, args.seed)
    except ValueError as e:
        print(f"make_random_gguf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {n / 1e9:.2f} GB of tensors in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
