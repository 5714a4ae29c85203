"""Expert banks (DESIGN.md): one MoE layer's experts stacked into `[E, ...]` weights.

- `w13`: gate and up rows of every expert, `[E, 2I, H]` (gate rows first, then up), one format;
- `w2`: down, `[E, H, I]`, one format (may differ from w13's: a Q4_K_M GGUF keeps down in Q6_K);
- `scales`: fp32 `[E, 4]` = (gate, up, down, 1), the second-level scales that multiply
  *results* (`g = (x @ Wg^T) * s_gate`, ...); all ones where the checkpoint has none.

The bank's weights carry no `scale2` of their own: it lives in `scales`, so that a slot that
holds one expert holds its scales row with it. Banks are built at load time from per-expert
weights (HF: `experts.{e}.gate_proj`, ...) or from GGUF `ffn_{gate,up,down}_exps` tensors that
are already `[E, ...]` (their per-expert `.scale` arrives as the weights' scale2 `[E]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.formats.errors import FormatError
from freetoken.formats.qweight import QuantWeight

SCALE_COLUMNS = ("gate", "up", "down", "one")


@dataclass(eq=False)
class ExpertBank:
    w13: QuantWeight  # [E, 2I, H]
    w2: QuantWeight  # [E, H, I]
    scales: torch.Tensor  # fp32 [E, 4]

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def hidden(self) -> int:
        return self.w13.shape[2]

    def has_scales(self) -> bool:
        return bool((self.scales[:, :3] != 1).any())

    def to(self, dtype: torch.dtype, device) -> ExpertBank:
        """Float banks take the model dtype; quantized storage moves unchanged."""
        from freetoken.layers.linear import _to

        return ExpertBank(_to(self.w13, dtype, device), _to(self.w2, dtype, device),
                          self.scales.to(device=device, dtype=torch.float32))


def _scale_column(qw: QuantWeight, experts: int) -> torch.Tensor:
    """fp32 [E]: a weight's scale2 (scalar or per expert) as one value per expert."""
    if qw.scale2 is None:
        return torch.ones(experts)
    s = qw.scale2.float().reshape(-1)
    if s.numel() not in (1, experts):
        raise FormatError(f"second-level scale has {s.numel()} values, expected 1 or {experts}",
                          tensor=qw.source)
    return s.expand(experts).clone()


def _strip(qw: QuantWeight, data, scales, shape) -> QuantWeight:
    return QuantWeight(data, qw.fmt, tuple(shape), scales=scales, ggml_type=qw.ggml_type,
                       source=qw.source)


def stack_experts(ws: list[QuantWeight]) -> QuantWeight:
    """Per-expert `[out, in]` weights (one format) -> one `[E, out, in]` weight.

    The experts' scale2 values become an `[E]` scale2 (1 where an expert has none).
    """
    a = ws[0]
    for w in ws:
        if w.fmt != a.fmt or w.ggml_type != a.ggml_type or tuple(w.shape) != tuple(a.shape):
            raise FormatError(f"experts differ: {w.fmt}{list(w.shape)} vs {a.fmt}"
                              f"{list(a.shape)} of {a.source}", tensor=w.source)
    scales = None if a.scales is None else torch.stack([w.scales for w in ws])
    s2 = None
    if any(w.scale2 is not None for w in ws):
        s2 = torch.cat([_scale_column(w, 1) for w in ws])
    out = _strip(a, torch.stack([w.data for w in ws]), scales, (len(ws), *a.shape))
    out.scale2 = s2
    return out


def build_bank(gate: QuantWeight, up: QuantWeight, down: QuantWeight) -> ExpertBank:
    """Stacked gate/up `[E, I, H]` and down `[E, H, I]` -> ExpertBank (scales pulled out)."""
    e, i, h = gate.shape
    if tuple(up.shape) != (e, i, h) or tuple(down.shape) != (e, h, i):
        raise FormatError(f"expert shapes gate {list(gate.shape)}, up {list(up.shape)}, down "
                          f"{list(down.shape)} do not fit [E, I, H] / [E, H, I]",
                          tensor=down.source)
    if gate.fmt != up.fmt or gate.ggml_type != up.ggml_type:
        raise FormatError(f"gate ({gate.fmt}) and up ({up.fmt}) experts must share one format "
                          "to form the w13 bank", tensor=up.source)
    scales = torch.stack([_scale_column(gate, e), _scale_column(up, e),
                          _scale_column(down, e), torch.ones(e)], dim=1)
    w13_scales = None if gate.scales is None else torch.cat([gate.scales, up.scales], dim=1)
    w13 = _strip(gate, torch.cat([gate.data, up.data], dim=1), w13_scales, (e, 2 * i, h))
    w2 = _strip(down, down.data, down.scales, down.shape)
    return ExpertBank(w13, w2, scales.contiguous())


def bank_from_merged(gate_up: QuantWeight, down: QuantWeight) -> ExpertBank:
    """A GGUF `ffn_gate_up_exps` `[E, 2I, H]` (gate rows first) and down `[E, H, I]`.

    A per-expert scale on the merged tensor cannot say which half it belongs to: refused
    (formats/scales.py refuses it for GGUF files first; this guards other sources).
    """
    e = gate_up.shape[0]
    if gate_up.scale2 is not None and gate_up.scale2.numel() > 1:
        raise FormatError("per-expert scales on a merged gate+up expert tensor are not "
                          "supported: gate and up need one scale each per expert",
                          tensor=gate_up.source)
    s = _scale_column(gate_up, e)
    scales = torch.stack([s, s, _scale_column(down, e), torch.ones(e)], dim=1)
    return ExpertBank(_strip(gate_up, gate_up.data, gate_up.scales, gate_up.shape),
                      _strip(down, down.data, down.scales, down.shape), scales.contiguous())


def expert_weight(qw: QuantWeight, e: int) -> QuantWeight:
    """Expert `e` of an `[E, out, in]` bank weight as an `[out, in]` weight (views, no copy)."""
    return QuantWeight(qw.data[e], qw.fmt, tuple(qw.shape[1:]),
                       scales=None if qw.scales is None else qw.scales[e],
                       ggml_type=qw.ggml_type, source=qw.source)
