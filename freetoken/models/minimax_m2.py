"""MiniMax-M2: pre-norm decoder, GQA attention whose q/k RMSNorms span the whole projection
(all heads at once, before the head split), partial rotary (the first `rotary_dim` dims of
each head, NeoX layout), and a sparse MoE on every layer: sigmoid router scores, experts
chosen by score + `e_score_correction_bias`, weighted by the renormalised scores (llama.cpp
`exp_probs_b`), SiLU experts named w1 (gate), w3 (up), w2 (down). No shared expert."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.engine.context import ForwardContext
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import HF_ACT
from freetoken.layers.moe import MoESpec, SparseMoE
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding, apply_rotary
from freetoken.models.base import CausalLM
from freetoken.models.config import ModelConfig


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of each head of x [T, H, d]; the rest pass."""
    rd = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


class MiniMaxM2Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer
        d = cfg.head_dim
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, {"q_proj": nq, "k_proj": nkv, "v_proj": nkv})
        self.o_proj = Linear(nq, cfg.hidden_size)
        self.q_norm = RMSNorm(nq, cfg.rms_norm_eps)  # over all heads of q together
        self.k_norm = RMSNorm(nkv, cfg.rms_norm_eps)
        self.sizes = [nq, nkv, nkv]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope) -> torch.Tensor:
        c = self.cfg
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q).reshape(-1, c.num_heads, c.head_dim)  # [T, Hq, d]
        k = self.k_norm(k).reshape(-1, c.num_kv_heads, c.head_dim)  # [T, Hkv, d]
        v = v.reshape(-1, c.num_kv_heads, c.head_dim)
        q, k = partial_rotary(q, *rope), partial_rotary(k, *rope)
        o = kernels.paged_attention(q, k, v, ctx.kv_caches[self.layer_id], ctx, scale=c.scale)
        return self.o_proj(o.reshape(-1, c.num_heads * c.head_dim))


class MiniMaxM2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = MiniMaxM2Attention(cfg, layer)
        spec = MoESpec(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                       top_k=cfg.num_experts_per_tok, intermediate=cfg.moe_intermediate_size,
                       activation=HF_ACT[cfg.hidden_act], scoring="sigmoid", renormalize=True)
        self.block_sparse_moe = SparseMoE(spec, part_names=("w1", "w3", "w2"))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, ctx: ForwardContext, rope):
        residual = x if residual is None else x + residual
        x = self.self_attn(self.input_layernorm(residual), ctx, rope)
        residual = x + residual
        return self.block_sparse_moe(self.post_attention_layernorm(residual)), residual


class MiniMaxM2ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, config.rope_theta,
                                      config.rope_scaling)

    def make_layer(self, i: int) -> nn.Module:
        return MiniMaxM2DecoderLayer(self.config, i)
