"""RMSNorm, computed in fp32.

Gemma stores norm weights as `w` and multiplies by `1 + w` (HF); llama.cpp's converter stores
`1 + w` in the GGUF. This module always multiplies by the effective weight; the loader says
whether the stored tensor already includes the +1.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken import kernels
from freetoken.formats.errors import FormatError
from freetoken.kernels.route import Router, add_rms_norm_route


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w over the last dimension.

    plus_one: the architecture defines the scale as `1 + w` (gemma); `load` adds the 1 unless
    the checkpoint stored it already. quantize: the output goes straight into linears / the
    MoE, so the GPU kernel also quantizes it once for their int8 GEMVs (`kernels.xq`).
    """

    def __init__(self, dim: int, eps: float, plus_one: bool = False, quantize: bool = False):
        super().__init__()
        self.dim, self.eps, self.plus_one, self.quantize = dim, eps, plus_one, quantize
        self.register_buffer("weight", torch.ones(dim), persistent=False)

    def load(self, w: torch.Tensor, *, stored_plus_one: bool = False, name: str = "") -> None:
        if tuple(w.shape) != (self.dim,):
            raise FormatError(f"shape {list(w.shape)}, expected [{self.dim}]", tensor=name)
        w = w.float()
        self.weight = w + 1.0 if self.plus_one and not stored_plus_one else w.clone()

    def finalize(self, dtype: torch.dtype, device) -> None:
        self.weight = self.weight.to(device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, self.quantize)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor, router: Router | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm decoder's residual step (one
        launch on the GPU; the sum is rounded to x's dtype first, as `x + residual` is).
        `router`: the MoE that takes the output; where the GPU can, its routes are computed in
        the same launch and carried by the output (`kernels.route.add_rms_norm_route`)."""
        if router is not None:
            return add_rms_norm_route(x, residual, self.weight, self.eps, self.quantize,
                                      router)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, self.quantize)
