"""Sparse MoE blocks: router scoring as each architecture defines it, routed experts in an
`ExpertBank` run by a MoE backend, optional shared experts.

Scoring (logits are computed in fp32 from the router's float weight):
- `softmax`: p = softmax(logits), top-k of p, optionally renormalised to sum 1 (qwen3-moe
  `norm_topk_prob`, qwen3.5-moe);
- `sigmoid`: p = sigmoid(logits), experts chosen by top-k of p + correction bias, weights are
  p of the chosen experts (without the bias), renormalised (minimax-m2, llama.cpp's
  `exp_probs_b`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight
from freetoken.kernels.norm import take_fold
from freetoken.kernels.route import Router, gate_topk, routes_of
from freetoken.layers.linear import Linear
from freetoken.layers.mlp import GatedMLP
from freetoken.moe.backends import get_backend
from freetoken.moe.banks import ExpertBank, bank_from_merged, build_bank


@dataclass(frozen=True)
class MoESpec:
    """One sparse MoE layer's hyperparameters."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate: int  # per expert
    activation: str = "silu"  # GLU of the experts: silu | gelu_tanh
    scoring: str = "softmax"  # softmax | sigmoid
    renormalize: bool = True
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # qwen: sigmoid(x @ w) gates the shared expert's output
    backend: str = "fused"


def route(logits: torch.Tensor, spec: MoESpec, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (expert ids int64 [T, k], routing weights fp32 [T, k]).
    One Triton launch on CUDA; the torch reference elsewhere (freetoken/kernels/route.py)."""
    from freetoken import kernels

    return kernels.route_topk(logits, spec.top_k, spec.scoring, spec.renormalize, bias)


_HOST_BANKS = False  # set by host_banks(): finalize() keeps the banks in host memory


@contextlib.contextmanager
def host_banks(on: bool = True):
    """While loading: keep routed-expert banks in host memory rather than on the device (the
    offload, hybrid and cpu backends put only a slot cache on the device; moe/runtime.py)."""
    global _HOST_BANKS
    old, _HOST_BANKS = _HOST_BANKS, on
    try:
        yield
    finally:
        _HOST_BANKS = old


class FusedExperts(nn.Module):
    """The routed experts of one layer: an ExpertBank filled by the loader.

    `part_names`: the per-expert module names in HF checkpoints (gate, up, down). `backend`
    starts as spec.backend's function; moe/runtime.py replaces it after loading for the
    offload, hybrid and cpu backends (the model file never chooses).
    """

    def __init__(self, spec: MoESpec, part_names: tuple[str, str, str] = (
            "gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.spec, self.part_names = spec, part_names
        self.bank: ExpertBank | None = None
        self.backend = get_backend(spec.backend)

    def _check(self, bank: ExpertBank) -> ExpertBank:
        s = self.spec
        want = (s.num_experts, 2 * s.intermediate, s.hidden_size)
        if tuple(bank.w13.shape) != want:
            raise FormatError(f"expert bank shape {list(bank.w13.shape)}, expected "
                              f"{list(want)}", tensor=bank.w13.source)
        return bank

    def load_parts(self, gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> None:
        """Stacked `[E, I, H]` gate and up, `[E, H, I]` down."""
        self.bank = self._check(build_bank(gate, up, down))

    def load_merged(self, gate_up: QuantWeight, down: QuantWeight) -> None:
        self.bank = self._check(bank_from_merged(gate_up, down))

    def finalize(self, dtype: torch.dtype, device) -> None:
        self.bank = self.bank.to(dtype, "cpu" if _HOST_BANKS else device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, side=None):
        """y; with `side` (the layer's other work, the shared expert, as y -> y + its terms,
        which do not depend on y), side(y): an expert-cache backend runs it on the device's
        partial sum while the CPU computes its misses, then adds the CPU's part."""
        if side is None:
            return self.backend(x, self.bank, ids, w, self.spec.activation)
        with_side = getattr(self.backend, "with_side", None)
        if with_side is not None:
            return with_side(x, ids, w, self.spec.activation, side)
        # the side's add writes the output last: it, not the backend's kernels, may compute
        # the next residual step (kernels/norm.py: folding)
        fold = take_fold(x)
        return side(self.backend(x, self.bank, ids, w, self.spec.activation), fold)


class Vector(nn.Module):
    """A small fp32 parameter vector loaded by its module path (HF tensor name = path):
    gemma4's router `scale` / `per_expert_scale` and `layer_scalar`."""

    def __init__(self, n: int, init: float = 1.0):
        super().__init__()
        self.register_buffer("value", torch.full((n,), init), persistent=False)

    def gguf_name(self, src, hf_name: str) -> str | None:
        """The GGUF tensor name ("" = not stored in GGUFs, keep the default)."""
        key = src.key(hf_name)  # gemma4 layer_scalar -> blk.N.layer_output_scale
        return f"{key}.weight" if key else None

    def load(self, t: torch.Tensor, name: str = "") -> None:
        if t.numel() != self.value.numel():
            raise FormatError(f"shape {list(t.shape)}, expected {list(self.value.shape)}",
                              tensor=name)
        self.value = t.float().reshape(self.value.shape).clone()

    def finalize(self, dtype: torch.dtype, device) -> None:
        self.value = self.value.to(device)


class RouterBias(Vector):
    """fp32 [E] correction bias added to the scores for expert choice only (minimax-m2's
    `e_score_correction_bias`, llama.cpp's `exp_probs_b.bias`)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts, 0.0)

    def gguf_name(self, src, hf_name: str) -> str | None:
        key = src.key(hf_name.removesuffix("_bias"))
        return f"{key}.bias" if key else None


class SparseMoE(nn.Module):
    """y = sum_k w_k expert_k(x) (+ shared expert), HF module names `gate`, `experts`,
    `shared_expert`, `shared_expert_gate` (qwen naming), `e_score_correction_bias` with
    sigmoid scoring (minimax-m2); `part_names` name the per-expert modules."""

    def __init__(self, spec: MoESpec, part_names: tuple[str, str, str] = (
            "gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.spec = spec
        self.gate = Linear(spec.hidden_size, spec.num_experts)
        self.experts = FusedExperts(spec, part_names)
        if spec.scoring == "sigmoid":
            self.e_score_correction_bias = RouterBias(spec.num_experts)
        if spec.shared_intermediate:
            self.shared_expert = GatedMLP(spec.hidden_size, spec.shared_intermediate,
                                          spec.activation)
        if spec.shared_gate:
            self.shared_expert_gate = Linear(spec.hidden_size, 1)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).float()  # in the activation dtype, as HF computes it

    def _gate_row(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert gate's weight row [H] where one kernel can apply it (CUDA, a
        float weight without second-level scale or bias, rows of unit stride), else None."""
        lin = self.shared_expert_gate
        qw = lin.weights[0] if len(lin.weights) == 1 else None
        if (not x.is_cuda or x.stride(-1) != 1 or qw is None or not qw.is_float
                or qw.scale2 is not None or getattr(lin, "bias", None) is not None):
            return None
        return qw.data.reshape(-1)

    @property
    def router(self) -> Router:
        """The router as `gate_topk` and the fused norm + router
        (`kernels.route.add_rms_norm_route`) take it."""
        s = self.spec
        bias = self.e_score_correction_bias.value if s.scoring == "sigmoid" else None
        return Router(self.gate.weights[0], s.top_k, s.scoring, s.renormalize, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # routes computed with x by the norm before (one launch for both), else router GEMV
        # and top-k here: one launch at decode sizes on CUDA
        routed = routes_of(x)
        ids, w = routed if routed is not None else gate_topk(x, *self.router)
        if not self.spec.shared_intermediate:
            return self.experts(x, ids, w)
        # the shared expert as side work: an expert-cache backend overlaps it with the CPU
        return self.experts(x, ids, w, side=SharedSide(self, x))

    def _add_shared(self, y: torch.Tensor, x: torch.Tensor, sh: torch.Tensor,
                    fold=None) -> torch.Tensor:
        """y + the shared expert's output sh, gated by x where the layer has a gate. fold: the
        residual step after it (`kernels/norm.py` NormFold), computed by the gated add's
        kernel where it can (`glu.gate_folds`), else ignored."""
        w_gate = self._gate_row(x) if self.spec.shared_gate else None
        if w_gate is not None:
            from freetoken.kernels.triton.glu import gated_add_triton  # lazy: needs triton

            return gated_add_triton(y, sh, x, w_gate, fold)  # one launch for the gate and sum
        if self.spec.shared_gate:
            sh = torch.sigmoid(self.shared_expert_gate(x).float()).to(sh.dtype) * sh
        return y + sh


class SharedSide:
    """A layer's shared expert as the side work of its routed experts: `side(y)` = y + the
    (gated) shared expert of x. In two phases for a backend that runs it beside other work
    (moe/expert_cache.py: on a second stream while the slot fills copy experts):
    `prepare()` -> the expert's output (depends on x only), `finish(y, sh)` -> y + gate * sh,
    the same kernels and arithmetic as one call."""

    def __init__(self, moe: SparseMoE, x: torch.Tensor):
        self.moe, self.x = moe, x

    def __call__(self, y: torch.Tensor, fold=None) -> torch.Tensor:
        return self.finish(y, self.prepare(), fold)

    def prepare(self) -> torch.Tensor:
        return self.moe.shared_expert(self.x)

    def finish(self, y: torch.Tensor, sh: torch.Tensor, fold=None) -> torch.Tensor:
        """y + gate * sh; fold: the next residual step, for the add's kernel (`_add_shared`)."""
        return self.moe._add_shared(y, self.x, sh, fold)

    def fold(self, sh: torch.Tensor) -> tuple | None:
        """(sh, x, the gate's weight row [H], or None where the layer has no gate) for a kernel
        that adds gate * sh to y in a launch of its own work (moe/handoff.py: the receive of
        the CPU's answer), where one can: on CUDA, sh in x's shape and dtype with rows of unit
        stride, a gate `_gate_row` takes (the kernel's arithmetic is `finish`'s). Else None."""
        x = self.x
        if not x.is_cuda or sh.shape != x.shape or sh.dtype != x.dtype or sh.stride(-1) != 1:
            return None
        if not self.moe.spec.shared_gate:
            return sh, x, None
        w = self.moe._gate_row(x)
        return None if w is None else (sh, x, w)
