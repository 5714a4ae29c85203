"""Second-level scale tensors in GGUF files: which are accepted, which are refused (seed 000).

llama.cpp's converter writes an NVFP4 tensor's `weight_scale_2` as the fp32 tensor
`<base>.scale` (one value, or one per expert for `ffn_*_exps`) and its `input_scale` as
`<base>.input_scale` (llama.cpp never reads it; neither do we). The rules:

- `<base>.scale` / `<base>.input_scale` are accepted only next to an NVFP4 `<base>.weight`, as
  F32 with one value, or one per expert for an expert bank `[E, out, in]`;
- every other tensor whose last name part mentions a scale (`.weight_scale`, `.k_scale`,
  `.scale_inv`, a `.scale` beside a non-NVFP4 weight, ...) is refused: we would not apply it;
- per-expert `.scale` on a merged `ffn_gate_up_exps` NVFP4 tensor is refused: gate and up each
  need their own per-expert scale, which one `[E]` tensor cannot carry (llama.cpp drops it too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType

from freetoken.formats.errors import FormatError

if TYPE_CHECKING:
    from freetoken.formats.gguf import GGUFFile, TensorInfo

ACCEPTED_SUFFIXES = ("scale", "input_scale")
# Tensors llama.cpp's converter names `.scale` that are model parameters, not second-level
# scales, so they may sit beside a weight of any type: Gemma-4's router input scale
# `ffn_gate_inp.scale` [H] and its per-expert output scale `ffn_down_exps.scale` [E] (the
# router's per_expert_scale; for NVFP4 experts it is folded into weight_scale_2).
ARCH_PARAMETERS = {"gemma4": ("ffn_gate_inp.scale", "ffn_down_exps.scale")}


def is_scale_tensor(name: str) -> bool:
    """True when the last dotted part of `name` is a scale (`x.scale`, not `x_scale.weight`)."""
    return "scale" in name.rsplit(".", 1)[-1]


def _check_one(g: GGUFFile, name: str, ti: TensorInfo) -> None:
    base, suffix = name.rsplit(".", 1) if "." in name else ("", name)
    wname = f"{base}.weight"
    w = g.tensors.get(wname)

    def refuse(msg: str) -> FormatError:
        return FormatError(msg, path=g.path, tensor=name)

    if suffix not in ACCEPTED_SUFFIXES:
        raise refuse(f"scale tensor '.{suffix}' is not supported; only '.scale' and "
                     "'.input_scale' next to an NVFP4 weight are")
    if w is None or w.ggml_type != GGMLQuantizationType.NVFP4:
        what = "no weight" if w is None else f"a {w.type_name} weight"
        raise refuse(f"'.{suffix}' is accepted only next to an NVFP4 weight, but {wname!r} is "
                     f"{what}")
    if ti.ggml_type != GGMLQuantizationType.F32:
        raise refuse(f"must be F32, got {ti.type_name}")
    experts = w.shape[0] if len(w.shape) == 3 else 1
    if ti.numel not in (1, experts):
        raise refuse(f"has {ti.numel} values; expected 1 or {experts} (one per expert) for "
                     f"weight {wname!r} of shape {w.shape}")
    if suffix == "scale" and ti.numel > 1 and base.endswith("ffn_gate_up_exps"):
        raise refuse("per-expert scales on a merged gate+up expert tensor are not supported: "
                     "gate and up need one scale each per expert; convert with separate "
                     "ffn_gate_exps / ffn_up_exps")


def check_scales(gguf: GGUFFile) -> None:
    """Raise FormatError naming the first scale tensor that breaks the rules above."""
    params = ARCH_PARAMETERS.get(gguf.arch, ())
    for name, ti in gguf.tensors.items():
        if not is_scale_tensor(name):
            continue
        if name.endswith(params) and ti.ggml_type == GGMLQuantizationType.F32:
            continue
        _check_one(gguf, name, ti)


def scaled_weights(gguf: GGUFFile) -> list[str]:
    """Names of the NVFP4 weights that carry a second-level `.scale`."""
    out = []
    for name in gguf.tensors:
        if name.endswith(".scale") and name.rsplit(".", 1)[-1] == "scale":
            wname = name[: -len(".scale")] + ".weight"
            if wname in gguf.tensors:
                out.append(wname)
    return out
