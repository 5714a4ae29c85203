"""The decoder-only causal LM skeleton that every dense architecture file fills in.

An architecture file supplies its decoder layer (`make_layer`) and, where it needs them,
its rotary tables (`rotary_for`); embedding, final norm, lm_head (tied or not), logits and the
KV-cache shapes live here. No loading happens in model files (see models/loader.py).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.engine.context import ForwardContext
from freetoken.kernels.norm import folding
from freetoken.layers.attention import AttentionSpec
from freetoken.layers.embedding import Embedding
from freetoken.layers.linear import Linear
from freetoken.layers.moe import SparseMoE
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import RotaryEmbedding
from freetoken.models.config import ModelConfig, embed_scale


def attention_spec(cfg: ModelConfig, layer: int, **kw) -> AttentionSpec:
    """The attention hyperparameters of one layer (window only on sliding layers)."""
    sliding = cfg.layer_types and cfg.layer_types[layer] == "sliding"
    return AttentionSpec(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, scale=cfg.scale, qkv_bias=cfg.attention_bias,
        norm_eps=cfg.rms_norm_eps, window=cfg.sliding_window if sliding else None,
        softcap=cfg.attn_logit_softcap, **kw,
    )


class FoldsNextNorm:
    """A pre-norm decoder layer whose MoE output goes only into the next residual step: it
    offers that step to the MoE's last kernel (`kernels/norm.py`: folding). `CausalLM` tells
    it the step's norm (`set_next_norm`: the next layer's input norm, the final norm last)."""

    @property
    def next_norm(self) -> RMSNorm | None:
        """The norm whose residual step takes this layer's output, None where unknown."""
        return self.__dict__.get("_next_norm")

    def set_next_norm(self, norm: RMSNorm | None) -> None:
        # in __dict__, not through nn.Module's setattr: not a submodule (the model owns it
        # elsewhere; as a submodule it would also appear twice in the module tree)
        self.__dict__["_next_norm"] = norm

    def mlp_folding(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """self.mlp(h), a MoE offered the residual step of its output with `residual`."""
        nxt = self.next_norm
        if nxt is None or not isinstance(self.mlp, SparseMoE):
            return self.mlp(h)  # an MoE's routes may come with h (one launch fewer)
        with folding(nxt.weight, nxt.eps, nxt.quantize, residual):
            return self.mlp(h)


class CausalLM(nn.Module):
    """embed -> layers -> final norm; `compute_logits` applies lm_head in fp32.

    Module names follow HF checkpoints (`model.layers.N.self_attn...`), so the loader's name
    tables only have to handle fusion and GGUF renames.
    """

    norm_plus_one = False  # gemma: norm weights act as (1 + w)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(config.vocab_size, config.hidden_size,
                                            embed_scale(config))
        self.model.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, self.norm_plus_one)
        # a layer that offers its successor's residual step to its last kernel learns which
        # norm that is (models/llama.py: next_norm): the next layer's input norm, the final
        # norm after the last (the norms' weights are read when a step runs: after loading)
        layers = list(self.model.layers)
        after = [getattr(n, "input_layernorm", None) for n in layers[1:]] + [self.model.norm]
        for layer, nxt in zip(layers, after):
            if hasattr(layer, "set_next_norm"):
                layer.set_next_norm(nxt)
        qkvs = [getattr(getattr(n, "self_attn", None), "qkv_proj", None) for n in layers[1:]]
        for layer, nxt in zip(layers, qkvs + [None]):
            if hasattr(layer, "set_next_qkv"):
                layer.set_next_qkv(nxt)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        # None until loaded: tied models read the embedding table instead.
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size)

    def make_layer(self, i: int) -> nn.Module:
        raise NotImplementedError

    def rotary_for(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin per layer; one shared table unless an arch overrides (gemma3)."""
        rope = self.rotary(positions)
        return [rope] * self.config.num_layers

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] (all sequences flattened) -> normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        ropes = self.rotary_for(ctx.positions)
        residual = None
        for layer, rope in zip(self.model.layers, ropes):
            x, residual = layer(x, residual, ctx, rope)
        if residual is None:
            return self.model.norm(x)
        return self.model.norm.forward_add(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        else:
            logits = kernels.linear(hidden, self.model.embed_tokens.weight).float()
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(n_kv_heads, head_dim) per attention layer; ctx.kv_caches[i] is layer i's."""
        return [(self.config.num_kv_heads, self.config.head_dim)] * self.config.num_layers
