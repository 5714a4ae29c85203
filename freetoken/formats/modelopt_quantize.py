"""Quantize a float HF checkpoint to a ModelOpt NVFP4 checkpoint (as NVIDIA ModelOpt exports it).

For every quantized linear `P` (all 2-D float `P.weight` except the excluded modules):

- `P.weight_scale_2` fp32 [] = amax(|W|) / (6 * 448): the per-tensor (so per-expert) scale;
- `P.weight_scale` float8_e4m3fn [N, K/16] = amax(|block of 16|) / (6 * weight_scale_2);
- `P.weight` uint8 [N, K/2] = E2M1 codes of W / (weight_scale * weight_scale_2), round to
  nearest, ties to even, clamped to +-6; value 2i in the low nibble of byte i, 2i+1 in the high;
- `P.input_scale` fp32 [] = amax(|x|) / (6 * 448) over a short calibration run with random tokens
  (modules transformers runs as nn.Linear; fused expert modules get none, which readers accept).

Embeddings, norms, lm_head and MoE routers stay float and are listed in `exclude_modules`.
Experts that transformers saves fused (gemma4's `P.experts.gate_up_proj` [E, 2I, H], gate rows
first, and `P.experts.down_proj` [E, H, I]) are written as ModelOpt exports them: one module per
expert, `P.experts.{e}.{gate,up,down}_proj`.
The directory gets `hf_quant_config.json` and config.json's `quantization_config` as ModelOpt
0.3x writes them. llama.cpp's converter needs each quantized input size K to be a multiple of 64.

    python -m freetoken.formats.modelopt_quantize SRC DST [--scale2 tensor|shared]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from freetoken.formats.safetensors import HFCheckpoint

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# |x| boundaries between consecutive E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
# Modules ModelOpt leaves in float: embeddings, the output head, routers, tiny gates.
DEFAULT_EXCLUDE = ("*embed_tokens", "*embeddings", "lm_head", "*.mlp.gate", "*.router",
                   "*.router.proj", "*.mlp.router", "*shared_expert_gate", "*vision*", "*visual*")
# Modules that read the same input; ModelOpt's export gives them one weight_scale_2.
_SHARED = (r"(.*\.self_attn)\.(q|k|v)_proj", r"(.*\.mlp(?:\.experts\.\d+)?)\.(gate|up)_proj")
MODELOPT_VERSION = "0.33.0"


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales) -> E2M1 codes uint8, RNE, saturating at 6."""
    a = x.abs().clamp(max=E2M1_MAX)
    idx = torch.searchsorted(_BOUNDS, a.contiguous(), right=False)  # bounds strictly below a
    tie = a == _BOUNDS[idx.clamp(max=len(_BOUNDS) - 1)]
    idx = idx + (tie & (idx % 2 == 1)).long()  # a tie goes to the even code
    return (idx | ((x < 0).long() << 3)).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor, scale2: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] float -> (codes uint8 [N, K/2], scales E4M3 [N, K/16], scale2 fp32 []).

    `scale2` defaults to amax(|W|) / (6 * 448) (1 for an all-zero W).
    """
    n, k = w.shape
    if k % 16:
        raise ValueError(f"NVFP4 needs the input size to be a multiple of 16, got {k}")
    w = w.float()
    if scale2 is None:
        amax = w.abs().max()
        scale2 = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    scale2 = scale2.float().reshape(())
    blocks = w.reshape(n, k // 16, 16)
    bamax = blocks.abs().amax(-1)  # [N, K/16]
    scales = (bamax / (E2M1_MAX * scale2)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scales.float() * scale2).unsqueeze(-1)  # [N, K/16, 1]
    q = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = e2m1_codes(q).reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scales, scale2


def is_excluded(module: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def quantize_checkpoint(src: str | Path, dst: str | Path, *, scale2: str = "tensor",
                        exclude: tuple[str, ...] = DEFAULT_EXCLUDE, calibrate: bool = True,
                        max_shard_bytes: int | None = None, seed: int = 0) -> Path:
    """Write a ModelOpt NVFP4 copy of the float HF checkpoint `src` into `dst`.

    scale2: "tensor" gives every matrix (every expert) its own weight_scale_2; "shared" gives
    q/k/v and gate/up of one block the same one, as ModelOpt's export does for fused inputs.
    max_shard_bytes: split into `model-0000i-of-0000n.safetensors` plus an index.
    """
    src, dst = Path(src), Path(dst)
    ck = _UnfusedExperts(HFCheckpoint(src))
    if ck.quant is not None:
        raise ValueError(f"{src} is already quantized ({ck.quant.method})")
    targets, kept = _plan(ck, exclude)
    s2 = _scale2s(ck, targets, scale2)
    amax_in = _calibrate(src, set(targets), seed) if calibrate else {}
    out: dict[str, torch.Tensor] = {}
    for name in ck.tensor_names():
        prefix = name.removesuffix(".weight")
        if prefix not in targets:
            out[name] = ck.tensor(name).contiguous()
            continue
        codes, scales, s = quantize_nvfp4(ck.tensor(name), s2.get(prefix))
        out[name], out[prefix + ".weight_scale"] = codes, scales
        out[prefix + ".weight_scale_2"] = s.clone()  # shared scales must not share storage
        if prefix in amax_in:
            out[prefix + ".input_scale"] = (amax_in[prefix] / (E2M1_MAX * E4M3_MAX)).reshape(())
    excluded = sorted({"lm_head", *kept})
    ck.close()
    dst.mkdir(parents=True, exist_ok=True)
    _copy_side_files(src, dst)
    _write_configs(src, dst, excluded)
    _write_tensors(dst, out, max_shard_bytes)
    return dst


_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")


class _UnfusedExperts:
    """An HFCheckpoint seen with its fused 3-D expert tensors split per expert (the names
    ModelOpt writes); every other tensor passes through unchanged."""

    def __init__(self, ck: HFCheckpoint) -> None:
        self.ck, self.quant = ck, ck.quant
        self.split: dict[str, tuple[str, int, slice]] = {}  # new name -> (fused, e, rows)
        names = []
        for name in ck.tensor_names():
            m = _FUSED.fullmatch(name)
            if m is None or len(ck.shape_of(name)) != 3:
                names.append(name)
                continue
            n_exp, rows = ck.shape_of(name)[:2]
            parts = ((("gate_proj", slice(0, rows // 2)), ("up_proj", slice(rows // 2, rows)))
                     if m.group(2) == "gate_up_proj" else (("down_proj", slice(0, rows)),))
            for e in range(n_exp):
                for part, sl in parts:
                    new = f"{m.group(1)}.{e}.{part}.weight"
                    self.split[new] = (name, e, sl)
                    names.append(new)
        self.names = names

    def tensor_names(self) -> list[str]:
        return self.names

    def dtype_of(self, name: str) -> str:
        return self.ck.dtype_of(self.split[name][0] if name in self.split else name)

    def shape_of(self, name: str) -> tuple[int, ...]:
        if name not in self.split:
            return self.ck.shape_of(name)
        fused, _, rows = self.split[name]
        return (rows.stop - rows.start, self.ck.shape_of(fused)[2])

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.split:
            return self.ck.tensor(name)
        fused, e, rows = self.split[name]
        return self.ck.tensor(fused)[e, rows]

    def close(self) -> None:
        self.ck.close()


def _plan(ck: HFCheckpoint, exclude: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Split modules with a 2-D float weight into quantized targets and float (excluded) ones."""
    targets, kept = [], []
    for name in ck.tensor_names():
        if not name.endswith(".weight") or len(ck.shape_of(name)) != 2:
            continue
        prefix = name.removesuffix(".weight")
        if ck.dtype_of(name) not in ("F32", "BF16", "F16"):
            raise ValueError(f"{name}: cannot quantize dtype {ck.dtype_of(name)}")
        ok = not is_excluded(prefix, exclude) and ck.shape_of(name)[1] % 16 == 0
        (targets if ok else kept).append(prefix)
    return targets, kept


def _scale2s(ck: HFCheckpoint, targets: list[str], mode: str) -> dict[str, torch.Tensor]:
    if mode not in ("tensor", "shared"):
        raise ValueError(f"scale2 mode must be 'tensor' or 'shared', got {mode!r}")
    amax = {p: ck.tensor(p + ".weight").float().abs().max() for p in targets}
    groups: dict[str, list[str]] = {}
    for p in targets:
        key = p
        for i, r in enumerate(_SHARED):
            if mode == "shared" and (m := re.fullmatch(r, p)):
                key = f"{m.group(1)}|{i}"
        groups.setdefault(key, []).append(p)
    out = {}
    for members in groups.values():
        a = max(amax[p] for p in members)
        s = a / (E2M1_MAX * E4M3_MAX) if a > 0 else torch.tensor(1.0)
        out.update({p: s.float() for p in members})
    return out


@torch.no_grad()
def _calibrate(src: Path, targets: set[str], seed: int) -> dict[str, torch.Tensor]:
    """Max |input| of every quantized nn.Linear over a short run on random token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    amax: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def f(_mod, args):
            a = args[0].detach().abs().max().float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n in targets]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 32), generator=g)
    model(input_ids=ids)
    for h in handles:
        h.remove()
    return amax


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "model.safetensors.index.json", "config.json", "hf_quant_config.json"):
            shutil.copy2(f, dst / f.name)


def _write_configs(src: Path, dst: Path, excluded: list[str]) -> None:
    producer = {"name": "modelopt", "version": MODELOPT_VERSION}
    hq = {"producer": producer, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": excluded}}
    (dst / "hf_quant_config.json").write_text(json.dumps(hq, indent=4) + "\n")
    fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": dict(fp4), "weights": dict(fp4),
                                      "targets": ["Linear"]}},
        "ignore": excluded, "quant_algo": "NVFP4", "producer": producer,
        "quant_method": "modelopt"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_tensors(dst: Path, tensors: dict[str, torch.Tensor], max_shard: int | None) -> None:
    for old in [*dst.glob("*.safetensors"), dst / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if max_shard is None:
        save_file(tensors, dst / "model.safetensors", metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > max_shard:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, dst / fname, metadata=meta)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m freetoken.formats.modelopt_quantize",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="float HF checkpoint directory")
    ap.add_argument("dst", help="output directory (ModelOpt NVFP4)")
    ap.add_argument("--scale2", choices=("tensor", "shared"), default="tensor")
    ap.add_argument("--no-calibrate", action="store_true", help="write no input_scale tensors")
    ap.add_argument("--max-shard-bytes", type=int, default=None)
    a = ap.parse_args(argv)
    out = quantize_checkpoint(a.src, a.dst, scale2=a.scale2, calibrate=not a.no_calibrate,
                              max_shard_bytes=a.max_shard_bytes)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
