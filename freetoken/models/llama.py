"""Llama (also SmolLM2): pre-norm decoder, GQA attention with rotary (llama3 scaling from
config), SiLU gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
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
        a = self.self_attn(h, ctx, rope)
        # the next layer's qkv rows asked of L2 while the norm + router runs
        # (FREETOKEN_GPU_L2_AHEAD: qkv)
        nxt = self.__dict__.get("_next_qkv")
        ahead = kernels.l2_ahead("qkv", a, None if nxt is None else nxt.weights)
        h, residual = self.post_attention_layernorm.forward_add(
            a, residual, getattr(self.mlp, "router", None))
        out = self.mlp_folding(h, residual)
        kernels.l2_join(ahead)
        return out, residual

    def set_next_qkv(self, qkv) -> None:
        """The next layer's fused qkv Linear (None after the last): its rows are read next.
        Kept out of the module tree, as `set_next_norm`'s norm."""
        self.__dict__["_next_qkv"] = qkv


class LlamaForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, i)
