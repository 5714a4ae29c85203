"""Weight sources: one interface over an HF directory, a GGUF file and an in-memory state dict.

Every source speaks in its own file's tensor names; `key(hf_prefix)` maps a module prefix in
HF naming (our model's module names, e.g. `model.layers.3.self_attn.q_proj`) to the file's
prefix (`blk.3.attn_q` in a GGUF), and `weight(prefix)` also reports which file tensors it
consumed, so the loader can refuse leftovers.
"""

from __future__ import annotations

import torch

from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight

_FLOAT_FMT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def float_weight(t: torch.Tensor, source: str) -> QuantWeight:
    if t.dtype not in _FLOAT_FMT:
        raise FormatError(f"dtype {t.dtype} where a float tensor was expected", tensor=source)
    return QuantWeight(t, _FLOAT_FMT[t.dtype], tuple(t.shape), source=source)


class StateDictSource:
    """An HF-named state dict in memory (tests: a transformers model's `state_dict()`)."""

    kind = "hf"

    def __init__(self, sd: dict[str, torch.Tensor], name: str = "<state dict>"):
        self.sd, self.path = sd, name

    def names(self) -> set[str]:
        return set(self.sd)

    def key(self, hf_prefix: str) -> str | None:
        return hf_prefix

    def tensor(self, name: str) -> torch.Tensor:
        return self.sd[name]

    def weight(self, prefix: str) -> tuple[QuantWeight, list[str]]:
        name = prefix + ".weight"
        return float_weight(self.sd[name], name), [name]


class HFSource:
    """An HF safetensors directory through `HFCheckpoint` (quantized formats included)."""

    kind = "hf"

    def __init__(self, ckpt):
        self.ckpt, self.path = ckpt, ckpt.path
        self._names = set(ckpt.tensor_names())

    def names(self) -> set[str]:
        return self._names

    def key(self, hf_prefix: str) -> str | None:
        return hf_prefix

    def tensor(self, name: str) -> torch.Tensor:
        return self.ckpt.tensor(name)

    def weight(self, prefix: str) -> tuple[QuantWeight, list[str]]:
        return self.ckpt.weight(prefix), list(self.ckpt.weight_tensor_names(prefix))


class GGUFSource:
    """A GGUF file through `GGUFFile`; HF prefixes renamed by gguf-py's tensor name map."""

    kind = "gguf"

    def __init__(self, gf, num_layers: int):
        import gguf

        self.gf, self.path = gf, gf.path
        # By the name llama.cpp writes ("minimax-m2" is MODEL_ARCH.MINIMAXM2).
        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gf.arch]
        self.map = gguf.get_tensor_name_map(arch, num_layers)
        self._names = set(gf.tensors)

    def names(self) -> set[str]:
        return self._names

    def key(self, hf_prefix: str) -> str | None:
        return self.map.get_name(hf_prefix)

    def tensor(self, name: str) -> torch.Tensor:
        qw = self.gf.weight(name)
        if not qw.is_float:
            from freetoken.formats.dequant import dequantize

            return dequantize(qw, apply_scale2=True)
        return qw.data

    def weight(self, prefix: str) -> tuple[QuantWeight, list[str]]:
        name = prefix + ".weight"
        used = [name] + [prefix + s for s in (".scale", ".input_scale") if prefix + s
                         in self._names]
        return self.gf.weight(name), used
