"""ModelConfig: the hyperparameters a dense model file needs, parsed from an HF config.json or
from GGUF metadata. Unknown architectures fail here with the supported list."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from freetoken.formats.errors import FormatError

if TYPE_CHECKING:
    from freetoken.models.config_qwen3_5 import LinearAttnConfig

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "minimax_m2", "gemma4",
             "qwen3_5", "qwen3_5_moe")
# HF model_type -> our arch name.
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
                  "gemma3": "gemma3", "qwen3_moe": "qwen3_moe",
                  "minimax_m2": "minimax_m2", "gemma4_text": "gemma4",
                  "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# GGUF general.architecture -> our arch name (where they differ).
GGUF_ARCHS = {"qwen3moe": "qwen3_moe", "minimax-m2": "minimax_m2", "qwen35": "qwen3_5",
              "qwen35moe": "qwen3_5_moe"}
# Gemma 3 hyperparameters that llama.cpp hard-codes (not in the GGUF): FACTS.md.
GEMMA3_SWA_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Frozen hyperparameters. layer_types: "full" or "sliding" per layer."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None  # HF rope_parameters / rope_scaling of global layers
    rope_local_theta: float | None = None  # gemma3 sliding layers
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attn_scale: float | None = None  # None = head_dim ** -0.5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    # MoE (0 experts: dense). Layers listed in mlp_only_layers, or not on the sparse step,
    # keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    rotary_dim: int | None = None  # partial rotary: the first rotary_dim dims of each head
    # gemma4: full-attention layers have their own head size and "proportional" rotary (only
    # the first rope_partial_full of the frequencies turn); k_eq_v reuses k as v there.
    global_head_dim: int | None = None
    rope_partial_full: float | None = None
    attention_k_eq_v: bool = False
    # qwen3.5: gated delta-net layers (layer_types "linear"), see config_qwen3_5.py
    linear: LinearAttnConfig | None = None

    def is_moe_layer(self, layer: int) -> bool:
        step = max(1, self.decoder_sparse_step)
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % step == 0)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5


def _ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in (v if isinstance(v, (list, tuple)) else [v]))


def hf_arch(config: dict, path=None) -> str:
    """Our arch name for an HF config, or FormatError naming it and the supported list."""
    mt = config.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise FormatError(
            f"unknown architecture {mt!r} ({config.get('architectures')}); supported: "
            f"{', '.join(SUPPORTED)}", path=path, key="model_type")
    return HF_MODEL_TYPES[mt]


def _hf_rope(c: dict) -> tuple[float, dict | None, float | None]:
    """(global theta, global scaling, local theta) from new `rope_parameters` or old keys."""
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and "full_attention" in rp:  # per layer type (gemma3, tf 5)
        g, loc = rp["full_attention"], rp.get("sliding_attention", {})
        return float(g["rope_theta"]), g, float(loc.get("rope_theta", GEMMA3_LOCAL_THETA))
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"]), rp, c.get("rope_local_base_freq")
    return float(c.get("rope_theta", 10000.0)), c.get("rope_scaling"), c.get("rope_local_base_freq")


def _gemma_layer_types(c: dict, n: int) -> tuple[str, ...]:
    if c.get("layer_types"):
        return tuple("sliding" if t == "sliding_attention" else "full" for t in c["layer_types"])
    p = c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or GEMMA3_SWA_PATTERN
    return tuple("full" if (i + 1) % p == 0 else "sliding" for i in range(n))


def from_hf(config: dict, path=None) -> ModelConfig:
    """Parse an HF config.json dict (text models; gemma3's `text_config` when nested)."""
    arch = hf_arch(config, path)
    c = config.get("text_config", config) if config.get("model_type") == "gemma3" else config
    n, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    theta, scaling, local = _hf_rope(c)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    partial = None
    if arch == "gemma4" and scaling is not None:  # proportional: our model file's business
        partial, scaling = float(scaling.get("partial_rotary_factor", 1.0)), None
    gemma = arch == "gemma3"
    cfg = ModelConfig(
        arch=arch, vocab_size=int(c["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(c.get("intermediate_size") or 0) if arch == "qwen3_5_moe"
        else int(c["intermediate_size"]), num_layers=n, num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads), head_dim=head_dim,
        max_position=int(c.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=float(local or GEMMA3_LOCAL_THETA) if gemma else None,
        sliding_window=c.get("sliding_window") if gemma else None,
        layer_types=_gemma_layer_types(c, n) if gemma else ("full",) * n,
        attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        hidden_act=c.get("hidden_activation") or c.get("hidden_act", "silu"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings",
                                                                          gemma))),
        attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
        bos_token_id=c.get("bos_token_id"), eos_token_ids=_ids(c.get("eos_token_id")),
        final_logit_softcap=c.get("final_logit_softcapping"),
        attn_logit_softcap=c.get("attn_logit_softcapping"),
        rotary_dim=_hf_rotary_dim(c, head_dim),
        **_hf_moe(c),
    )
    if arch in ("qwen3_5", "qwen3_5_moe"):
        from freetoken.models.config_qwen3_5 import qwen3_5_hf

        return qwen3_5_hf(c, cfg)
    return _gemma4(c, cfg, partial) if arch == "gemma4" else cfg


def _gemma4(c: dict, cfg: ModelConfig, partial: float | None) -> ModelConfig:
    """Gemma 4 text: query scale 1, sliding layers, per-layer-type heads and rotary."""
    n = cfg.num_layers
    per_layer = c.get("per_layer_config") or {}
    full = [i for i, t in enumerate(c.get("layer_types") or []) if t == "full_attention"]
    gd = c.get("global_head_dim") or (per_layer.get(str(full[0]), {}).get("head_dim")
                                      if full else None)
    moe = bool(c.get("enable_moe_block"))
    return replace(
        cfg, attn_scale=1.0, sliding_window=c.get("sliding_window"),
        layer_types=_gemma_layer_types(c, n), rope_local_theta=cfg.rope_local_theta or 1e4,
        global_head_dim=int(gd or cfg.head_dim), rope_partial_full=partial,
        attention_k_eq_v=bool(c.get("attention_k_eq_v")),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        num_experts=int(c.get("num_experts") or 0) if moe else 0,
        num_experts_per_tok=int(c.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 0) if moe else 0,
    )


def _hf_rotary_dim(c: dict, head_dim: int) -> int | None:
    rp = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    if c.get("rotary_dim"):
        return int(c["rotary_dim"])
    f = rp.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    return int(head_dim * f) if f and f != 1 else None


def _hf_moe(c: dict) -> dict:
    """MoE fields of an HF text config (empty for dense models)."""
    n = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if not n:
        return {}
    return dict(
        num_experts=n, num_experts_per_tok=int(c.get("num_experts_per_tok")
                                               or c.get("top_k_experts") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or c["intermediate_size"]),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        decoder_sparse_step=int(c.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in c.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0),
    )


def _gguf_moe(md: dict, a: str) -> dict:
    """MoE fields from llama.cpp's metadata; llama.cpp renormalises top-k unless told not to."""
    n = int(md.get(f"{a}.expert_count") or 0)
    if not n:
        return {}
    for k in ("expert_used_count", "expert_feed_forward_length"):
        if f"{a}.{k}" not in md:
            raise FormatError(f"missing metadata ({n} experts need it)", key=f"{a}.{k}")
    return dict(
        num_experts=n, num_experts_per_tok=int(md[f"{a}.expert_used_count"]),
        moe_intermediate_size=int(md[f"{a}.expert_feed_forward_length"]),
        norm_topk_prob=bool(md.get(f"{a}.expert_weights_norm", True)),
        shared_expert_intermediate_size=int(
            md.get(f"{a}.expert_shared_feed_forward_length") or 0),
    )


def _gguf_scaling(md: dict, a: str) -> dict | None:
    kind = md.get(f"{a}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise FormatError(f"rope scaling {kind!r} is not supported", key=f"{a}.rope.scaling.type")
    return {"rope_type": "linear", "factor": float(md[f"{a}.rope.scaling.factor"])}


def from_gguf(md: dict, vocab_size: int, path=None) -> ModelConfig:
    """Parse GGUF metadata (llama.cpp key names). vocab_size: rows of token_embd."""
    a = md.get("general.architecture")
    if GGUF_ARCHS.get(a, a) not in SUPPORTED:
        raise FormatError(f"unknown architecture {a!r}; supported: {', '.join(SUPPORTED)}",
                          path=path, key="general.architecture")

    def get(key: str, default=None):
        v = md.get(f"{a}.{key}", default)
        if v is None:
            raise FormatError("missing metadata", path=path, key=f"{a}.{key}")
        return v

    n, heads, hidden = int(get("block_count")), int(get("attention.head_count")), int(
        get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    gemma = a == "gemma3"
    eos = md.get("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        arch=GGUF_ARCHS.get(a, a), vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", 0 if a == "qwen35moe" else None)),
        num_layers=n, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        max_position=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=_gguf_scaling(md, a),
        rope_local_theta=float(md.get(f"{a}.rope.freq_base_swa", GEMMA3_LOCAL_THETA)) if gemma
        else None,
        sliding_window=int(get("attention.sliding_window")) if gemma else None,
        layer_types=tuple("full" if not gemma or (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding"
                          for i in range(n)),
        attn_scale=head_dim**-0.5, hidden_act="gelu_tanh" if gemma else "silu",
        tie_word_embeddings=False, attention_bias=a == "qwen2",
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_ids=_ids(eos),
        final_logit_softcap=md.get(f"{a}.final_logit_softcapping"),
        attn_logit_softcap=md.get(f"{a}.attn_logit_softcapping"),
        rotary_dim=None if md.get(f"{a}.rope.dimension_count") in (None, head_dim) else int(
            md[f"{a}.rope.dimension_count"]),
        **_gguf_moe(md, a),
    )
    if a in ("qwen35", "qwen35moe"):
        from freetoken.models.config_qwen3_5 import qwen3_5_gguf

        return qwen3_5_gguf(md, a, cfg, path)
    return _gguf_gemma4(md, cfg) if a == "gemma4" else cfg


def _gguf_gemma4(md: dict, cfg: ModelConfig) -> ModelConfig:
    """llama.cpp's gemma4 keys: key_length is the full layers' head size, *_swa the sliding
    layers'; `sliding_window_pattern` is True per sliding layer. Proportional rotary arrives
    as `rope_freqs` (1e30 divisors on the frozen frequencies), which the loader applies."""
    a = "gemma4"
    pattern = md.get(f"{a}.attention.sliding_window_pattern") or [False] * cfg.num_layers
    return replace(
        cfg, head_dim=int(md.get(f"{a}.attention.key_length_swa", cfg.head_dim)),
        global_head_dim=cfg.head_dim, layer_types=tuple("sliding" if p else "full"
                                                        for p in pattern),
        rope_local_theta=float(md.get(f"{a}.rope.freq_base_swa", 1e4)), attn_scale=1.0,
        sliding_window=int(md[f"{a}.attention.sliding_window"]), hidden_act="gelu_tanh",
        rotary_dim=None)


def embed_scale(cfg: ModelConfig) -> float:
    """Gemma multiplies embeddings by sqrt(hidden); the others by 1."""
    return math.sqrt(cfg.hidden_size) if cfg.arch in ("gemma3", "gemma4") else 1.0
