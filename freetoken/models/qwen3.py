"""Qwen3 (dense): the llama block with a per-head RMSNorm on q and k before the rotary, an
explicit head_dim (which may differ from hidden / heads) and no qkv bias."""

from __future__ import annotations

from torch import nn

from freetoken.models.base import CausalLM
from freetoken.models.llama import LlamaDecoderLayer


class Qwen3ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, i, qk_norm=True)
