"""qwen3.5 / qwen3.5-moe through the engine's offline LLM: greedy tokens equal transformers'
`generate` for 32 tokens (exact equality: greedy is deterministic, and the models' logits
agree to ~3e-6 relative while the top-1 margins are far larger), with three prompts batched,
chunked prefill (16-token budget, 4-token pages: prefills split mid-prompt and mixed with
decodes), state slots handed back at the end, prefix reuse off, and preemption (its request
recomputed from position 0 with fresh state). Quantized layers in float math
(FREETOKEN_CPU_FLOAT=1): the CPU's int8 decode dots move logits by llama.cpp's amounts and are
checked teacher-forced elsewhere (tests/models/test_cpu_decode_path.py).
"""

from __future__ import annotations

import sys

import pytest
import tiny_qwen3_5 as tq
import torch

from freetoken import SamplingParams
from freetoken.engine.kv_cache import NaiveCache
from freetoken.engine.llm import LLM

N = 32
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


@torch.inference_mode()
def hf_greedy(model, seqs: list[list[int]]) -> list[list[int]]:
    return [model.generate(torch.tensor([s]), max_new_tokens=N, min_new_tokens=N,
                           do_sample=False)[0, len(s):].tolist() for s in seqs]


def _check_engine_state(llm: LLM) -> None:
    eng = llm.engine
    assert sorted(eng.runner.free_slots) == list(range(eng.config.max_running_requests))
    assert isinstance(eng.scheduler.cache, NaiveCache)  # radix asked for, reuse is off
    assert eng.pool.num_free == eng.pool.num_pages


@pytest.mark.parametrize("arch", tq.ARCHS)
def test_llm_greedy_matches_transformers(arch):
    seqs = tq.prompts()
    want = hf_greedy(tq.make_hf_model(arch), seqs)
    llm = LLM(str(tq.hf_dir(arch)), show_progress=False, max_prefill_tokens=16, page_size=4,
              cache_type="radix", max_running_requests=4)
    got = [r.token_ids for r in llm.generate(seqs, GREEDY)]
    assert got == want
    _check_engine_state(llm)


def test_gguf_q8_0_greedy_with_preemption(monkeypatch):
    """The q8_0 GGUF (tiled V heads) against transformers on its dequantized weights; too few
    pages for all three at once, so the newest request is preempted and recomputed."""
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")  # exact tokens need transformers' math
    arch = "qwen3_5_moe"
    path = tq.gguf_path(arch, "q8_0")
    seqs = tq.prompts()
    want = hf_greedy(tq.gguf_reference(arch, path), seqs)
    llm = LLM(str(path), show_progress=False, max_prefill_tokens=16, page_size=4,
              num_pages=24)
    preempted = []
    orig = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda r: (preempted.append(r.request_id), orig(r))
    got = [r.token_ids for r in llm.generate(seqs, GREEDY)]
    assert preempted, "the page budget was meant to force a preemption"
    assert got == want
    _check_engine_state(llm)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
