"""Gemma 4 (text; the MoE and the dense models): gemma3's sandwich norms, but plain `w` RMSNorms,
query scale 1, a scale-free RMSNorm on v, and two kinds of attention layers: sliding ("local",
head_dim, rope theta 10k) and full ("global", global_head_dim, "proportional" rotary where only
the first `rope_partial_full` of the frequencies turn). MoE layers run a dense GELU MLP and a
sparse MoE side by side on the same residual:

    h1 = post_ffw_norm_1(mlp(pre_ffw_norm(x)))
    h2 = post_ffw_norm_2(experts(pre_ffw_norm_2(x), router(x)))
    x  = (x + post_ffw_norm(h1 + h2)) * layer_scalar

The router: softmax(proj(rmsnorm(x) * scale / sqrt(H))), top-k, renormalised, times
`per_expert_scale` of each chosen expert. Not covered: per-layer input embeddings (PLE),
KV sharing between layers, k_eq_v (refused at build time)."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.engine.context import ForwardContext
from freetoken.formats.errors import FormatError
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import HF_ACT, GatedMLP
from freetoken.layers.moe import FusedExperts, MoESpec, Vector, route
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding, apply_rotary
from freetoken.models.base import CausalLM
from freetoken.models.config import ModelConfig


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def head_dim_of(cfg: ModelConfig, layer: int) -> int:
    full = cfg.layer_types[layer] == "full"
    return (cfg.global_head_dim or cfg.head_dim) if full else cfg.head_dim


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer
        self.d = d = head_dim_of(cfg, layer)
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, {"q_proj": nq, "k_proj": nkv, "v_proj": nkv})
        self.o_proj = Linear(nq, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.sizes = [nq, nkv, nkv]
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding" else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope) -> torch.Tensor:
        c, d = self.cfg, self.d
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.reshape(-1, c.num_heads, d))  # [T, Hq, d]
        k = self.k_norm(k.reshape(-1, c.num_kv_heads, d))  # [T, Hkv, d]
        v = _rms(v.reshape(-1, c.num_kv_heads, d), c.rms_norm_eps)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = kernels.paged_attention(q, k, v, ctx.kv_caches[self.layer_id], ctx, scale=1.0,
                                    window=self.window, softcap=c.attn_logit_softcap)
        return self.o_proj(o.reshape(-1, c.num_heads * d))


class _RouterScale(Vector):
    def gguf_name(self, src, hf_name: str) -> str | None:
        key = src.key(hf_name.removesuffix(".scale") + ".proj")  # blk.N.ffn_gate_inp
        return f"{key}.scale" if key else None


class _PerExpertScale(Vector):
    def gguf_name(self, src, hf_name: str) -> str | None:
        return ""  # llama.cpp's converter moves it to ffn_down_exps.scale: the bank's s_down


class Gemma4Router(nn.Module):
    """In GGUFs the per-expert scale lives in the down experts' `.scale` (the bank's s_down
    column), so the router keeps ones there: the same product, taken after the expert."""

    def __init__(self, spec: MoESpec, eps: float):
        super().__init__()
        self.spec, self.eps = spec, eps
        self.proj = Linear(spec.hidden_size, spec.num_experts)
        self.scale = _RouterScale(spec.hidden_size)
        self.per_expert_scale = _PerExpertScale(spec.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = _rms(x, self.eps) * self.scale.value.to(x.dtype) * self.spec.hidden_size**-0.5
        ids, w = route(self.proj(h), self.spec)  # softmax, top-k, renormalised
        return ids, w * self.per_expert_scale.value[ids]


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, eps, act = cfg.hidden_size, cfg.rms_norm_eps, HF_ACT[cfg.hidden_act]
        self.self_attn = Gemma4Attention(cfg, layer)
        self.mlp = GatedMLP(h, cfg.intermediate_size, act)
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        self.moe = cfg.num_experts > 0
        if self.moe:
            names += ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                      "post_feedforward_layernorm_2")
            spec = MoESpec(hidden_size=h, num_experts=cfg.num_experts,
                           top_k=cfg.num_experts_per_tok, intermediate=cfg.moe_intermediate_size,
                           activation=act)
            self.router = Gemma4Router(spec, eps)
            self.experts = FusedExperts(spec)
        for n in names:
            setattr(self, n, RMSNorm(h, eps))
        self.layer_scalar = Vector(1)

    def forward(self, x, residual, ctx: ForwardContext, rope):
        x = x if residual is None else x + residual
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx, rope))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            ids, w = self.router(x)
            h2 = self.experts(self.pre_feedforward_layernorm_2(x), ids, w)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(h2)
        x = x + self.post_feedforward_layernorm(h)
        return x * self.layer_scalar.value.to(x.dtype), None


def proportional_inv_freq(head_dim: int, theta: float, partial: float) -> torch.Tensor:
    """HF's "proportional" rope: the first partial * head_dim / 2 frequencies of a full-width
    table, the rest zero (those dims never turn)."""
    angles = int(partial * head_dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
    return torch.cat([inv, torch.zeros(head_dim // 2 - angles)])


class Gemma4ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        if config.attention_k_eq_v:
            raise FormatError("gemma4 with attention_k_eq_v is not supported yet",
                              key="attention_k_eq_v")
        super().__init__(config)
        gd = config.global_head_dim or config.head_dim
        self.rotary = RotaryEmbedding(gd, config.rope_theta)
        if config.rope_partial_full is not None:
            self.rotary.inv_freq = proportional_inv_freq(gd, config.rope_theta,
                                                         config.rope_partial_full)
        self.rotary_local = RotaryEmbedding(config.head_dim, config.rope_local_theta or 1e4)

    def make_layer(self, i: int) -> nn.Module:
        return Gemma4DecoderLayer(self.config, i)

    def rotary_for(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rope = {"full": self.rotary(positions), "sliding": self.rotary_local(positions)}
        return [rope[t] for t in self.config.layer_types]

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        return [(self.config.num_kv_heads, head_dim_of(self.config, i))
                for i in range(self.config.num_layers)]
