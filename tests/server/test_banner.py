"""The `ft serve` start-up banner: URLs of the chat page and the API, model, MoE backend,
memory and context length. test_e2e_responses.py checks the banner of a real server's log."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from freetoken.server.banner import banner, rss_gib


def _engine(**kw) -> SimpleNamespace:
    base = dict(model=torch.nn.Linear(2, 2), moe=None, device=torch.device("cpu"),
                dtype=torch.float32, max_model_len=4096)
    return SimpleNamespace(**{**base, **kw})


STATE = SimpleNamespace(served_model_name="m", reasoning_parser=None, tool_call_parser="hermes")


@pytest.mark.parametrize("host, url", [("127.0.0.1", "http://127.0.0.1:8000"),
                                       ("0.0.0.0", "http://127.0.0.1:8000"),
                                       ("::", "http://[::1]:8000")])
def test_banner_lines(host, url):
    text = banner(STATE, _engine(), host, 8000, True, "/models/m.gguf")
    lines = text.splitlines()
    assert lines[0] == "FreeToken is serving 'm'"
    assert f"chat page    {url}/" in text and f"API          {url}/v1 (API key required)" in text
    assert "/models/m.gguf on cpu float32" in text and "tool calls hermes" in text
    assert "MoE backend  none (a dense model)" in text
    assert "context      4096 tokens per request" in text
    assert "GiB host (resident)" in text


def test_resident_memory_is_plausible():
    # this test process holds torch: more than 50 MiB, less than the machine
    assert 0.05 < rss_gib() < 1024


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
