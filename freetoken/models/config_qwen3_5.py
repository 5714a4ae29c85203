"""qwen3.5 / qwen3.5-moe hyperparameters beyond the llama-family ones: which layers are gated
delta-net ("linear") and their head sizes, from an HF text config or llama.cpp's metadata.

HF: `layer_types` lists "linear_attention" / "full_attention" per layer (transformers fills it
from `full_attention_interval` when absent). GGUF: llama.cpp keeps only
`{arch}.full_attention_interval` (layer i is full attention when (i + 1) % interval == 0) and
the `ssm.*` sizes: conv_kernel, state_size (key head dim), group_count (key heads),
time_step_rank (value heads), inner_size (value heads * value head dim). Its converter stores
V heads in tiled order when there are more value than key heads (`v_tiled`).
Text positions only: the multimodal rotary sections (mrope) coincide for text, so the rotary is
plain partial NeoX rotary over `rotary_dim` dims.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from freetoken.formats.errors import FormatError
from freetoken.models.config import ModelConfig


@dataclass(frozen=True)
class LinearAttnConfig:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    v_tiled: bool = False


def qwen3_5_hf(c: dict, cfg: ModelConfig) -> ModelConfig:
    n = cfg.num_layers
    types = c.get("layer_types") or interval_types(n, int(c.get("full_attention_interval", 4)))
    if len(types) != n:
        raise FormatError(f"{len(types)} layer_types for {n} layers", key="layer_types")
    lin = LinearAttnConfig(
        num_k_heads=int(c["linear_num_key_heads"]), num_v_heads=int(c["linear_num_value_heads"]),
        head_k_dim=int(c["linear_key_head_dim"]), head_v_dim=int(c["linear_value_head_dim"]),
        conv_kernel=int(c.get("linear_conv_kernel_dim", 4)))
    lt = tuple("linear" if t == "linear_attention" else "full" for t in types)
    return replace(cfg, layer_types=lt, linear=lin,
                   norm_topk_prob=True)  # qwen3.5-moe always renormalises its top-k


def interval_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n)]


def qwen3_5_gguf(md: dict, a: str, cfg: ModelConfig, path=None) -> ModelConfig:
    def get(key: str) -> int:
        if f"{a}.{key}" not in md:
            raise FormatError("missing metadata (qwen3.5 linear-attention layers need it)",
                              path=path, key=f"{a}.{key}")
        return int(md[f"{a}.{key}"])

    nk, nv = get("ssm.group_count"), get("ssm.time_step_rank")
    lin = LinearAttnConfig(num_k_heads=nk, num_v_heads=nv, head_k_dim=get("ssm.state_size"),
                           head_v_dim=get("ssm.inner_size") // nv,
                           conv_kernel=get("ssm.conv_kernel"), v_tiled=nv != nk)
    types = interval_types(cfg.num_layers, get("full_attention_interval"))
    lt = tuple("linear" if t == "linear_attention" else "full" for t in types)
    return replace(cfg, layer_types=lt, linear=lin, norm_topk_prob=True)
