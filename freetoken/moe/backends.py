"""MoE backends: how a layer's routed experts are computed, chosen by name.

`fused` (every expert resident on the compute device, computed by the kernel entry point
`freetoken.kernels.moe.fused_moe`) is a stateless function, registered here. `offload`,
`hybrid` and `cpu` share state across layers (one slot cache, one CPU executor): they are
built for a loaded model by `freetoken.moe.runtime.configure_moe`, which sets each layer's
backend to a `expert_cache.LayerBackend` of the same signature; `auto` resolves there too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.moe.banks import ExpertBank

# (x [T, H], bank, topk_ids [T, k], topk_weights [T, k], activation) -> y [T, H]
MoEFn = Callable[[torch.Tensor, ExpertBank, torch.Tensor, torch.Tensor, str], torch.Tensor]


def _fused(x, bank, topk_ids, topk_weights, activation):
    from freetoken.kernels.moe import fused_moe
    from freetoken.kernels.norm import take_fold

    # the kernels write the output last: they may compute the residual step after it
    return fused_moe(x, bank, topk_ids, topk_weights, activation, norm_fold=take_fold(x))


BACKENDS: dict[str, MoEFn] = {"fused": _fused}


def get_backend(name: str) -> MoEFn:
    """The backend function registered as `name`, or ValueError listing the known ones."""
    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; available: {', '.join(BACKENDS)}")
    return BACKENDS[name]
