"""Llama (also SmolLM2): pre-norm decoder, GQA attention with rotary (llama3 scaling from
config), SiLU gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.engine.context import ForwardContext
from freetoken.layers.attention import Attention
from freetoken.layers.mlp import HF_ACT, GatedMLP
from freetoken.layers.norm import RMSNorm
from freetoken.models.base import CausalLM, attention_spec
from freetoken.models.config import ModelConfig


class LlamaDecoderLayer(nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)), carrying the residual separately."""

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool = False):
        super().__init__()
        self.self_attn = Attention(attention_spec(cfg, layer, qk_norm=qk_norm), layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, HF_ACT[cfg.hidden_act])
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else x + residual
        x = self.self_attn(self.input_layernorm(residual), ctx, rope)
        residual = x + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, i)
