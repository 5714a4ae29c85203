"""Strict loading by name: every module asks for its tensors, every file tensor must be used.

Targets come from the model's modules (HF naming). A source renames them to its file's names,
returns weights in their stored format (quantized ones stay quantized), and reports the file
tensors it consumed. GGUF conventions handled here: llama.cpp's q/k row permutation for the
llama family (undone), norms stored as 1 + w for gemma, `rope_freqs` (llama3 scaling), an
absent `output` meaning tied embeddings. Any missing, extra or half-fused name: FormatError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight
from freetoken.layers.embedding import Embedding
from freetoken.layers.linear import Linear, take_rows
from freetoken.layers.moe import FusedExperts, Vector
from freetoken.layers.norm import RMSNorm

# Architectures whose GGUF q/k rows llama.cpp's converter permutes (LlamaModel.permute).
PERMUTED_QK = ("llama",)


@dataclass
class Target:
    """One checkpoint module (HF prefix) feeding `module` (a Linear part, norm or embedding)."""

    hf_prefix: str
    module: nn.Module
    part: str = ""


def targets(model: nn.Module) -> list[Target]:
    out = []
    for path, mod in model.named_modules():
        if isinstance(mod, Linear):
            parent = path.rsplit(".", 1)[0]
            out += [Target(f"{parent}.{p}" if p else path, mod, p) for p in mod.parts]
        elif isinstance(mod, (RMSNorm, Embedding, FusedExperts, Vector)):
            out.append(Target(path, mod))
    return out


def qk_inverse_permutation(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row index that undoes llama.cpp's (n, 2, d/2) -> (n, d/2, 2) interleave of q/k rows."""
    return torch.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2).transpose(1, 2) \
        .reshape(-1)


class Loader:
    """Fills a freshly built model from one source; `run()` then checks completeness."""

    def __init__(self, model, source, dtype: torch.dtype, device, show_progress: bool = True):
        self.model, self.src, self.dtype, self.device = model, source, dtype, device
        self.cfg = model.config
        self.show_progress = show_progress
        self.used: set[str] = set()
        self.missing: list[str] = []

    def run(self) -> None:
        names = self.src.names()
        self._check_half_fused(names)
        todo = targets(self.model)
        for t in tqdm(todo, desc="loading", unit="tensor", disable=not self.show_progress):
            if t.hf_prefix == "lm_head":
                continue
            self._load(t, names)
        self._load_lm_head(names)
        self._load_extras(names)
        if self.missing:
            raise FormatError(f"missing tensors: {', '.join(self.missing)}", path=self.src.path)
        extra = sorted(names - self.used)
        if extra:
            raise FormatError(f"unexpected tensors (not used by {self.cfg.arch}): "
                              f"{', '.join(extra[:20])}" + (" ..." if len(extra) > 20 else ""),
                              path=self.src.path)
        for mod in self.model.modules():
            if hasattr(mod, "finalize") and mod is not self.model:
                mod.finalize(self.dtype, self.device)
        self.model.to(self.device)  # buffers: norm weights, rotary tables

    def _file_key(self, hf_prefix: str) -> str:
        key = self.src.key(hf_prefix)
        if key is None:
            raise FormatError(f"no {self.src.kind} name for module {hf_prefix!r}",
                              path=self.src.path)
        return key

    def _check_half_fused(self, names: set[str]) -> None:
        for path, mod in self.model.named_modules():
            if not isinstance(mod, Linear) or len(mod.parts) < 2:
                continue
            parent = path.rsplit(".", 1)[0]
            keys = {p: self._file_key(f"{parent}.{p}") + ".weight" for p in mod.parts}
            have = [k for k in keys.values() if k in names]
            if have and len(have) < len(keys):
                lack = [k for k in keys.values() if k not in names]
                raise FormatError(f"half-fused {path}: has {', '.join(have)} but not "
                                  f"{', '.join(lack)}", path=self.src.path)

    def _weight(self, key: str) -> QuantWeight:
        qw, used = self.src.weight(key)
        self.used.update(used)
        if self.dtype == torch.float16 and qw.fmt == "nvfp4" and qw.scale2 is not None:
            raise FormatError(
                "--dtype float16 is refused with second-level-scaled NVFP4 weights: the scale is "
                "about 1e-4, so unscaled float16 products overflow; use float32 or bfloat16",
                path=self.src.path, tensor=key)
        return qw

    def expert_key(self, hf_prefix: str, part: str) -> str:
        """The file prefix of stacked experts' `part` (GGUF `blk.N.ffn_gate_exps`)."""
        return self._file_key(f"{hf_prefix}.{part}")

    def _load(self, t: Target, names: set[str]) -> None:
        if isinstance(t.module, FusedExperts):
            from freetoken.models.loader_moe import load_experts

            return load_experts(self, t, names)
        if isinstance(t.module, Vector):
            from freetoken.models.loader_moe import load_vector

            return load_vector(self, t, names)
        key = self._file_key(t.hf_prefix)
        if key + ".weight" not in names:
            self.missing.append(key + ".weight")
            return
        mod = t.module
        if isinstance(mod, RMSNorm):
            mod.load(self.src.tensor(key + ".weight"), name=key + ".weight",
                     stored_plus_one=self.src.kind == "gguf")
            self.used.add(key + ".weight")
        elif isinstance(mod, Embedding):
            mod.load(self._weight(key))
        else:
            self._load_linear(t, key, names)

    def _load_linear(self, t: Target, key: str, names: set[str]) -> None:
        qw, bias = self._weight(key), None
        if t.module.has_bias:
            if key + ".bias" not in names:
                self.missing.append(key + ".bias")
                return
            bias = self.src.tensor(key + ".bias").float()
            self.used.add(key + ".bias")
        if self.src.kind == "gguf" and self.cfg.arch in PERMUTED_QK and t.part in ("q_proj",
                                                                                   "k_proj"):
            heads = self.cfg.num_heads if t.part == "q_proj" else self.cfg.num_kv_heads
            idx = qk_inverse_permutation(heads, self.cfg.head_dim)
            qw = take_rows(qw, idx)
            bias = None if bias is None else bias[idx]
        t.module.load(t.part, qw, bias)

    def _load_lm_head(self, names: set[str]) -> None:
        """A file without lm_head means tied embeddings (llama.cpp does the same)."""
        key = self._file_key("lm_head")
        present = key + ".weight" in names
        if present and self.model.lm_head is None:
            self.model.lm_head = Linear(self.cfg.hidden_size, self.cfg.vocab_size)
        if not present and self.model.lm_head is not None:
            if self.src.kind == "gguf":
                self.model.lm_head = None
                return
            self.missing.append(key + ".weight")
            return
        if present:
            self.model.lm_head.load("", self._weight(key))

    def _load_extras(self, names: set[str]) -> None:
        if "rope_freqs.weight" in names and self.src.kind == "gguf":
            self.model.rotary.load_freq_factors(self.src.tensor("rope_freqs.weight"))
            self.used.add("rope_freqs.weight")


def load_weights(model, source, dtype: torch.dtype = torch.float32, device="cpu",
                 show_progress: bool = True) -> None:
    """Load every tensor of `source` into `model` strictly (see module docstring)."""
    Loader(model, source, dtype, device, show_progress).run()
