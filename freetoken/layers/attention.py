"""Self-attention block: fused qkv projection, optional per-head q/k norm, rotary, paged
attention over the KV cache in the forward context, output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetoken import kernels
from freetoken.engine.context import ForwardContext
from freetoken.kernels.cpu_kernels import cpu_decode_attention
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer needs to know (from ModelConfig, per layer)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # multiplies q.k (1/sqrt(head_dim), gemma: query_pre_attn_scalar**-0.5)
    qkv_bias: bool = False
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over each head of q and k, before rotary
    norm_eps: float = 1e-6
    norm_plus_one: bool = False  # gemma's (1 + w) norms
    window: int | None = None  # sliding window (tokens, itself included) or None = global
    softcap: float | None = None


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, layer_id: int):
        super().__init__()
        self.spec, self.layer_id = spec, layer_id
        d = spec.head_dim
        nq, nkv = spec.num_heads * d, spec.num_kv_heads * d
        self.qkv_proj = Linear(
            spec.hidden_size, {"q_proj": nq, "k_proj": nkv, "v_proj": nkv}, bias=spec.qkv_bias
        )
        self.o_proj = Linear(nq, spec.hidden_size)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.norm_eps, spec.norm_plus_one)
            self.k_norm = RMSNorm(d, spec.norm_eps, spec.norm_plus_one)
        self.sizes = [nq, nkv, nkv]

    def forward(
        self, x: torch.Tensor, ctx: ForwardContext, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        s = self.spec
        qkv = self.qkv_proj(x)
        norms = (self.q_norm.weight, self.k_norm.weight) if s.qk_norm else (None, None)
        # a CPU decode step: the whole block below in one call (fp32; None elsewhere)
        o = cpu_decode_attention(qkv, s, ctx.kv_caches[self.layer_id], ctx, rope, *norms)
        if o is not None:
            return self.o_proj(o)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.reshape(-1, s.num_heads, s.head_dim)  # [T, Hq, d]
        k = k.reshape(-1, s.num_kv_heads, s.head_dim)  # [T, Hkv, d]
        v = v.reshape(-1, s.num_kv_heads, s.head_dim)
        # q/k norm, rotary, the KV cache write and attention: at decode on the GPU one launch
        # (kernels/triton/attention.py), else qk-rope's launch, then attention
        # o_proj's rows asked of L2 while attention runs (FREETOKEN_GPU_L2_AHEAD: o)
        ahead = kernels.l2_ahead("o", qkv, self.o_proj.weights)
        o = kernels.qk_rope_attention(
            q, k, v, rope, *norms, s.norm_eps, ctx.kv_caches[self.layer_id], ctx,
            scale=s.scale, window=s.window, softcap=s.softcap,
            quantize=True,  # for o_proj's int8 GEMV, where it runs one
        )
        y = self.o_proj(kernels.xq.view(o.contiguous(), -1, s.num_heads * s.head_dim))
        kernels.l2_join(ahead)
        return y
