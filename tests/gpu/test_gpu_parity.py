"""The GPU adds speed, never behaviour: the MoE GGUFs in tests/data (qwen3-moe, gemma4,
qwen3.5-moe; Q4_K and MXFP4 experts, made by llama.cpp's quantizer) give the same greedy tokens on
CUDA as on the CPU, both float32: the GPU's Triton kernels decode the weights and multiply in
fp32 (no int8 dots for fp32 activations), and the CPU runs its float path
(FREETOKEN_CPU_FLOAT=1: dequantized tiles and fp32 GEMMs; by default the CPU executor's decode
multiplies in int8 as llama.cpp does, another computation that greedy tokens of a random tiny
model need not follow). Skipped without CUDA
(conftest marks `gpu` tests). These files travel with the tree to a GPU host; the packaged real
models do not.

Also prints decode tokens/s on each device, for the notes (not asserted).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import transformers

from freetoken import LLM, SamplingParams
from freetoken.formats.errors import FormatError

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
DATA = Path(__file__).resolve().parent.parent / "data"
MODELS = sorted(DATA.glob("tiny_*_q4k-mxfp4.gguf"))
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _tokens(device: str, model: str) -> tuple[list[list[int]], float]:
    try:
        llm = LLM(model, device=device, dtype="float32", show_progress=False)
    except FormatError as e:
        if "cannot build a tokenizer" not in str(e):
            raise
        # The GGUF tokenizer comes from transformers' GGUF support, which older releases lack
        # for newer architectures (transformers 5.17 on the GPU host: qwen35moe, gemma4).
        pytest.skip(f"transformers {transformers.__version__} on this host: {e}")
    t = time.perf_counter()
    outs = llm.generate(PROMPTS, GREEDY)
    dt = time.perf_counter() - t
    return [o.token_ids for o in outs], len(PROMPTS) * GREEDY.max_tokens / dt


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_cuda_matches_cpu_greedy(path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")
    model = str(path)
    cpu, cpu_tps = _tokens("cpu", model)
    gpu, gpu_tps = _tokens("cuda", model)
    print(f"{model}: cpu {cpu_tps:.1f} tok/s, cuda {gpu_tps:.1f} tok/s (batch {len(PROMPTS)})")
    for p, a, b in zip(PROMPTS, cpu, gpu):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        print(f"  {p!r}: identical for {same}/{len(a)} tokens")
    assert cpu == gpu


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
