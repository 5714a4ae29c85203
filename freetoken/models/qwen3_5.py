"""qwen3.5 and qwen3.5-moe (text): a hybrid of gated delta-net layers (layers/gdn.py) and full
attention layers, per `config.layer_types` ("linear" / "full").

Full attention: q_proj emits, per head, the query and an output gate side by side
([q_h | gate_h], 2 * head_dim rows a head); q/k per-head RMSNorm, partial NeoX rotary over
the first `rotary_dim` dims, and the attention output is multiplied by sigmoid(gate) before
o_proj. Every RMSNorm outside the GDN multiplies by (1 + w) (zero-centred weights; llama.cpp's
converter stores 1 + w), the GDN's gated norm by w. The MLP is dense (qwen3.5) or, on every
layer, a softmax top-k MoE renormalised, plus a shared expert gated by sigmoid(x @ w)
(qwen3.5-moe). Only full layers hold KV pages; linear layers hold per-request state slots.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.engine.context import ForwardContext
from freetoken.layers.gdn import GatedDeltaNet, GDNSpec
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import HF_ACT, GatedMLP
from freetoken.layers.moe import MoESpec, SparseMoE
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken.models.base import CausalLM, FoldsNextNorm
from freetoken.models.config import ModelConfig


class Qwen3_5Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_id: int):
        super().__init__()
        self.cfg, self.kv_id = cfg, kv_id  # kv_id: index among the full-attention layers
        d = cfg.head_dim
        nq, nkv = cfg.num_heads * d, cfg.num_kv_heads * d
        self.qkv_proj = Linear(cfg.hidden_size, {"q_proj": 2 * nq, "k_proj": nkv, "v_proj": nkv})
        self.o_proj = Linear(nq, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, plus_one=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, plus_one=True)
        self.sizes = [2 * nq, nkv, nkv]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, rope) -> torch.Tensor:
        c, d = self.cfg, self.cfg.head_dim
        qg, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, gate = qg.reshape(-1, c.num_heads, 2 * d).split(d, dim=-1)  # [T, Hq, d] each
        k = k.reshape(-1, c.num_kv_heads, d)  # [T, Hkv, d]
        v = v.reshape(-1, c.num_kv_heads, d)
        # per-head q/k norms, the partial rotary (rope's tables cover the first rotary_dim
        # values), the KV write and attention: at decode on the GPU one launch
        # (kernels/triton/attention.py), else qk-rope's launch, then attention
        o = kernels.qk_rope_attention(q, k, v, rope, self.q_norm.weight, self.k_norm.weight,
                                      c.rms_norm_eps, ctx.kv_caches[self.kv_id], ctx,
                                      scale=c.scale)
        o = kernels.sigmoid_gate(o.reshape(-1, c.num_heads, d), gate, quantize=True)
        return self.o_proj(o)  # [T, Hq d], with its int8 codes where the GEMV takes them


def gdn_spec(cfg: ModelConfig) -> GDNSpec:
    lin = cfg.linear
    return GDNSpec(hidden_size=cfg.hidden_size, num_k_heads=lin.num_k_heads,
                   num_v_heads=lin.num_v_heads, head_k_dim=lin.head_k_dim,
                   head_v_dim=lin.head_v_dim, conv_kernel=lin.conv_kernel,
                   norm_eps=cfg.rms_norm_eps, v_tiled=lin.v_tiled)


def moe_spec(cfg: ModelConfig) -> MoESpec:
    return MoESpec(hidden_size=cfg.hidden_size, num_experts=cfg.num_experts,
                   top_k=cfg.num_experts_per_tok, intermediate=cfg.moe_intermediate_size,
                   activation=HF_ACT[cfg.hidden_act], renormalize=True,
                   shared_intermediate=cfg.shared_expert_intermediate_size, shared_gate=True)


class Qwen3_5DecoderLayer(FoldsNextNorm, nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.linear = cfg.layer_types[layer] == "linear"
        idx = cfg.layer_types[:layer].count(cfg.layer_types[layer])  # among its own kind
        if self.linear:
            self.linear_attn = GatedDeltaNet(gdn_spec(cfg), idx)
        else:
            self.self_attn = Qwen3_5Attention(cfg, idx)
        if cfg.num_experts:
            self.mlp = SparseMoE(moe_spec(cfg))
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, HF_ACT[cfg.hidden_act])
        # both norms feed linears / the MoE directly: quantized once for their int8 GEMVs
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, plus_one=True,
                                       quantize=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                plus_one=True, quantize=True)

    def forward(self, x, residual, ctx: ForwardContext, rope):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:  # the residual sum and the norm in one launch on the GPU
            h, residual = self.input_layernorm.forward_add(x, residual)
        x = self.linear_attn(h, ctx) if self.linear else self.self_attn(h, ctx, rope)
        h, residual = self.post_attention_layernorm.forward_add(
            x, residual, getattr(self.mlp, "router", None))
        return self.mlp_folding(h, residual), residual


class Qwen3_5ForCausalLM(CausalLM):
    """Both variants (dense and MoE): the config's num_experts decides the MLP."""

    norm_plus_one = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, config.rope_theta,
                                      config.rope_scaling)

    def make_layer(self, i: int) -> nn.Module:
        return Qwen3_5DecoderLayer(self.config, i)

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """Full-attention layers only, in layer order (their kv_id)."""
        n = self.config.layer_types.count("full")
        return [(self.config.num_kv_heads, self.config.head_dim)] * n

    def state_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per linear-attention layer, per slot: (conv state, recurrent state) shapes."""
        n = self.config.layer_types.count("linear")
        return [gdn_spec(self.config).state_shapes()] * n
