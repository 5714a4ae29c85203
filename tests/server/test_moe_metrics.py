"""A real `ft serve` of a tiny MoE GGUF on the hybrid backend (the CPU standing in as the
device): the expert cache's counters reach /metrics, as the official `openai` client's request
left them, and they add up (hits + misses = distinct experts routed; fetched + CPU = misses).
"""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from helpers import ServeProcess, metric

GGUF = Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3_moe_q4k-mxfp4.gguf"
NAMES = ("hits", "misses", "fetched", "cpu", "ahead", "ahead_hits")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeProcess("--model", str(GGUF), "--device", "cpu", "--moe-backend", "hybrid",
                     "--moe-cache-size", "4", "--moe-fetch-ahead", "1",
                     log_dir=tmp_path_factory.mktemp("serve")).wait()
    yield s
    s.stop()


def _experts(base: str) -> dict[str, float]:
    return {n: metric(base, f"freetoken_moe_expert_{n}") for n in NAMES}


def test_expert_cache_counters_reach_metrics(server):
    before = _experts(server.base)
    assert before["hits"] + before["misses"] == 0  # nothing routed yet (the cache warmed)
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    r = client.completions.create(model=client.models.list().data[0].id, prompt="Hello there",
                                  max_tokens=8, temperature=0)
    assert r.usage.completion_tokens > 0
    c = _experts(server.base)
    # 2 MoE layers, top-2 of 8 experts: every step routes 2-8 distinct experts a layer
    steps = r.usage.completion_tokens  # (the first token's step is the prompt's)
    assert 2 * 2 * steps <= c["hits"] + c["misses"] <= 2 * 8 * steps, c
    assert c["misses"] > 0 and c["fetched"] + c["cpu"] == c["misses"], c
    assert c["ahead"] > 0 and 0 <= c["ahead_hits"] <= c["ahead"], c
    assert metric(server.base, "freetoken_moe_handoff_failures") == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
