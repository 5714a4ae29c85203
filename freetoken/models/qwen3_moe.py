"""Qwen3-MoE: the qwen3 block (per-head q/k RMSNorm, no qkv bias) with a sparse MoE in place
of the MLP on its sparse layers: softmax router, top-k, renormalised when `norm_topk_prob`
(llama.cpp always renormalises qwen3moe), SiLU experts, no shared expert."""

from __future__ import annotations

from torch import nn

from freetoken.layers.mlp import HF_ACT
from freetoken.layers.moe import MoESpec, SparseMoE
from freetoken.models.base import CausalLM
from freetoken.models.config import ModelConfig
from freetoken.models.llama import LlamaDecoderLayer


def moe_spec(cfg: ModelConfig, **kw) -> MoESpec:
    """The MoE hyperparameters of a config's sparse layers."""
    return MoESpec(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                   top_k=cfg.num_experts_per_tok, intermediate=cfg.moe_intermediate_size,
                   activation=HF_ACT[cfg.hidden_act], renormalize=cfg.norm_topk_prob, **kw)


class Qwen3MoeForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        layer = LlamaDecoderLayer(self.config, i, qk_norm=True)
        if self.config.is_moe_layer(i):
            layer.mlp = SparseMoE(moe_spec(self.config))
        return layer
