"""Gemma 3 (text): sandwich norms around attention and MLP, (1 + w) RMSNorms, q/k norms,
embeddings scaled by sqrt(hidden), GELU-tanh gated MLP, and two kinds of attention layers:
sliding-window ("local", rope theta 10k, no scaling) and global (rope theta 1M, with the
config's scaling). Layer kinds, window and query scale come from ModelConfig (for GGUFs, the
values llama.cpp hard-codes: every 6th layer global, query scale 1/sqrt(head_dim))."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.engine.context import ForwardContext
from freetoken.layers.attention import Attention
from freetoken.layers.mlp import HF_ACT, GatedMLP
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken.models.base import CausalLM, attention_spec
from freetoken.models.config import ModelConfig


class Gemma3DecoderLayer(nn.Module):
    """x -> x + post_attn_norm(attn(in_norm(x))) -> x + post_ffw_norm(mlp(pre_ffw_norm(x)))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        spec = attention_spec(cfg, layer, qk_norm=True, norm_plus_one=True)
        self.self_attn = Attention(spec, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, HF_ACT[cfg.hidden_act])
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, plus_one=True)
        self.post_attention_layernorm = RMSNorm(h, eps, plus_one=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, plus_one=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, plus_one=True)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else x + residual
        x = self.self_attn(self.input_layernorm(residual), ctx, rope)
        residual = self.post_attention_layernorm(x) + residual
        x = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(x), residual


class Gemma3ForCausalLM(CausalLM):
    norm_plus_one = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        # Sliding layers: their own theta, never scaled (HF and llama.cpp agree).
        self.rotary_local = RotaryEmbedding(config.head_dim, config.rope_local_theta or 1e4)

    def make_layer(self, i: int) -> nn.Module:
        return Gemma3DecoderLayer(self.config, i)

    def rotary_for(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rope = {"full": self.rotary(positions), "sliding": self.rotary_local(positions)}
        return [rope[t] for t in self.config.layer_types]
