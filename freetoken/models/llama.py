"""Llama (also SmolLM2): pre-norm decoder, GQA attention with rotary (llama3 scaling from
config), SiLU gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.engine.context import ForwardContext
from freetoken.layers.attention import Attention
from freetoken.layers.mlp import HF_ACT, GatedMLP
from freetoken.layers.norm import RMSNorm
from freetoken.models.base import CausalLM, FoldsNextNorm, attention_spec
from freetoken.models.config import ModelConfig


class LlamaDecoderLayer(FoldsNextNorm, nn.Module):
    """x -> x + attn(norm(x)) -> x + mlp(norm(x)), carrying the residual separately."""

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool = False):
        super().__init__()
        self.self_attn = Attention(attention_spec(cfg, layer, qk_norm=qk_norm), layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, HF_ACT[cfg.hidden_act])
        # both norms feed linears / the MoE directly: quantized once for their int8 GEMVs
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, quantize=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                quantize=True)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # residual adds fused into the norms (one launch each on the GPU)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h, residual = self.post_attention_layernorm.forward_add(
            self.self_attn(h, ctx, rope), residual, getattr(self.mlp, "router", None))
        return self.mlp_folding(h, residual), residual


class LlamaForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, i)
