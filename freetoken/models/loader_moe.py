"""Loading routed experts into `FusedExperts` banks (called by models/loader.py).

Sources and their expert names (HF prefix `P` = `model.layers.N.mlp.experts`, part names from
the module, e.g. gate_proj / up_proj / down_proj or minimax's w1 / w3 / w2):
- HF safetensors: one module per expert, `P.{e}.{part}` (any format, NVFP4 with its
  `weight_scale_2` per expert): stacked into `[E, ...]` here;
- transformers' in-memory state dicts: `P.gate_up_proj` `[E, 2I, H]` and `P.down_proj`;
- GGUF: `blk.N.ffn_{gate,up,down}_exps` `[E, ...]` with an optional per-expert `.scale`, or a
  merged `ffn_gate_up_exps` (whose per-expert scale is refused, see formats/scales.py).
"""

from __future__ import annotations

from freetoken.models.sources import float_weight
from freetoken.moe.banks import stack_experts


def load_experts(ld, t, names: set[str]) -> None:
    """Fill `t.module` (FusedExperts) from loader `ld`'s source; missing names go to
    `ld.missing`, consumed ones to `ld.used`."""
    if ld.src.kind == "gguf":
        _gguf(ld, t, names)
    elif f"{t.hf_prefix}.gate_up_proj" in names:
        _state_dict(ld, t)
    else:
        _per_expert(ld, t, names)


def _gguf(ld, t, names: set[str]) -> None:
    mod = t.module
    merged = ld.src.key(f"{t.hf_prefix}.gate_up_proj")  # gemma4: HF and GGUF both merged
    if merged and merged + ".weight" in names:
        keys = [merged, ld.expert_key(t.hf_prefix, mod.part_names[2])]
    else:
        keys = [_exps_key(ld, t.hf_prefix, p, merged) for p in mod.part_names]
        merged = keys[0].replace("ffn_gate_exps", "ffn_gate_up_exps")
        if merged != keys[0] and merged + ".weight" in names:
            keys = [merged, keys[2]]
    lack = [k + ".weight" for k in keys if k + ".weight" not in names]
    if lack:
        ld.missing.extend(lack)
        return
    ws = [ld._weight(k) for k in keys]
    down = ws[-1]
    if down.scale2 is None and keys[-1] + ".scale" in names:
        # gemma4's per-expert output scale beside non-NVFP4 experts (formats/scales.py)
        down.scale2 = ld.src.tensor(keys[-1] + ".scale").float().reshape(-1)
    if len(ws) == 2:
        mod.load_merged(*ws)
    else:
        mod.load_parts(*ws)


def _exps_key(ld, hf_prefix: str, part: str, merged: str | None) -> str:
    """`blk.N.ffn_{part}_exps`. gemma4's experts are merged in HF, so gguf-py's map may lack
    separate gate / up names for it, yet llama.cpp's converter writes them for NVFP4 experts
    (one ModelOpt module per expert): name them after the merged tensor."""
    if ld.src.key(f"{hf_prefix}.{part}") is None and merged and part in ("gate_proj", "up_proj"):
        return merged.replace("ffn_gate_up_exps", f"ffn_{part.removesuffix('_proj')}_exps")
    return ld.expert_key(hf_prefix, part)


def _state_dict(ld, t) -> None:
    gu, down = f"{t.hf_prefix}.gate_up_proj", f"{t.hf_prefix}.down_proj"
    ld.used.update((gu, down))
    mod = t.module
    mod.load_merged(float_weight(ld.src.tensor(gu), gu), float_weight(ld.src.tensor(down), down))


def _per_expert(ld, t, names: set[str]) -> None:
    mod = t.module
    parts = []
    for p in mod.part_names:
        keys = [f"{t.hf_prefix}.{e}.{p}" for e in range(mod.spec.num_experts)]
        lack = [k + ".weight" for k in keys if k + ".weight" not in names]
        if lack:
            ld.missing.extend(lack)
            return
        parts.append(stack_experts([ld._weight(k) for k in keys]))
    mod.load_parts(*parts)


def load_vector(ld, t, names: set[str]) -> None:
    """A layers.moe.Vector: HF names it by its module path, GGUF as the module says."""
    name = t.hf_prefix
    if ld.src.kind == "gguf":
        name = t.module.gguf_name(ld.src, name)
        if name == "":  # this source folds the parameter elsewhere: keep the default
            return
        name = name or t.hf_prefix
    if name not in names:
        ld.missing.append(name)
        return
    t.module.load(ld.src.tensor(name), name=name)
    ld.used.add(name)
