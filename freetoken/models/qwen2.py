"""Qwen2 (also Qwen2.5 / Qwen2.5-Coder): the llama block with biases on q, k and v.

The only difference from llama.py is the qkv bias (ModelConfig.attention_bias, true for every
Qwen2 checkpoint); the decoder layer is llama's, reused rather than copied. llama.cpp writes
Qwen2 GGUFs without llama's q/k row permutation (NeoX rotary), which the loader knows.
"""

from __future__ import annotations

from torch import nn

from freetoken.models.base import CausalLM
from freetoken.models.llama import LlamaDecoderLayer


class Qwen2ForCausalLM(CausalLM):
    def make_layer(self, i: int) -> nn.Module:
        assert self.config.attention_bias, "Qwen2 projects q, k, v with biases"
        return LlamaDecoderLayer(self.config, i)
