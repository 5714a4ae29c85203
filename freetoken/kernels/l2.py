"""Entry points of the L2 read-ahead (`kernels/triton/l2.py`) for layer code: a no-op
returning None on the CPU, in the interpreter, or where FREETOKEN_GPU_L2_AHEAD leaves `what`
off."""

from __future__ import annotations

import torch


def l2_ahead(what: str, x: torch.Tensor, weights) -> object | None:
    """Ask L2 for the data and block scales of `weights` (QuantWeights, or None) beside the
    next kernel on x (the next layer's qkv kept over the MoE's reads: evict_last); the token
    for `l2_join`, None where nothing was asked."""
    if not x.is_cuda or weights is None:
        return None
    from freetoken.kernels.triton import l2  # lazy: needs triton

    if not l2.wants(what, x):  # the switch, the token count, the GPU
        return None
    ts = [t for qw in weights for t in (qw.data, qw.scales) if t is not None and t.is_cuda]
    return l2.ahead(ts, last=what == "qkv") if ts else None


def l2_join(token: object | None) -> None:
    """The current stream waits for `l2_ahead`'s reads (None: nothing to wait for)."""
    if token is not None:
        torch.cuda.current_stream().wait_stream(token)
