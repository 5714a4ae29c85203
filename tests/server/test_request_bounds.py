"""What one request may ask for: every field that could make one request take the whole server
(`n`, logprobs, stop lists, tools, max_tokens past the context, huge prompts and bodies) gets a
400 (413 for the body) that names the field and the limit, on every protocol, and the server
keeps serving. Runs on the scripted engine (fake_engine.py): the check happens before any
generation, so the real model adds nothing here (test_e2e_responses.py repeats `n: 1000` on it).
"""

from __future__ import annotations

import sys

import httpx
import pytest
from fake_engine import DEFAULT_REPLY, FakeEngine
from helpers import ThreadServer

from freetoken import assets
from freetoken.commands.serve import make_app
from freetoken.config import EngineConfig, ServerConfig
from freetoken.tokenizer.tokenizer import Tokenizer

MSGS = [{"role": "user", "content": "hi"}]
FN = {"name": "f", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOLS = [{"type": "function", "function": FN}] * 129
RESP_TOOLS = [{"type": "function", **FN}] * 129
ANTH_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}] * 129
LIMITS = dict(max_n=4, max_logprobs=5, max_stop=3, max_tools=128)


@pytest.fixture(scope="module")
def server():
    tok = Tokenizer.from_path(assets.smollm2_path())
    conf = ServerConfig(engine=EngineConfig(), served_model_name="fake", max_body_mb=1,
                        **LIMITS)
    s = ThreadServer(make_app(conf, lambda _cfg: FakeEngine(tok, max_model_len=512)))
    yield s
    s.stop()


CASES = {
    "chat n=1000": ("/v1/chat/completions", {"messages": MSGS, "n": 1000}, "n", "limit of 4"),
    "chat n just over": ("/v1/chat/completions", {"messages": MSGS, "n": 5}, "n", "limit of 4"),
    "completions n": ("/v1/completions", {"prompt": "hi", "n": 1000}, "n", "limit of 4"),
    "completions best_of": ("/v1/completions", {"prompt": "hi", "n": 1000, "best_of": 1000},
                            "n", "limit of 4"),
    "top_logprobs": ("/v1/chat/completions",
                     {"messages": MSGS, "logprobs": True, "top_logprobs": 6},
                     "top_logprobs", "limit of 5"),
    "completions logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": 6},
                             "logprobs", "limit of 5"),
    "stop list": ("/v1/chat/completions", {"messages": MSGS, "stop": ["a", "b", "c", "d"]},
                  "stop", "limit of 3"),
    "long stop string": ("/v1/chat/completions", {"messages": MSGS, "stop": "x" * 300},
                         "stop", "limit of 256"),
    "stop_token_ids": ("/v1/chat/completions",
                       {"messages": MSGS, "stop_token_ids": list(range(65))},
                       "stop_token_ids", "limit of 64"),
    "chat tools": ("/v1/chat/completions", {"messages": MSGS, "tools": CHAT_TOOLS},
                   "tools", "limit of 128"),
    "max_tokens past the context": ("/v1/chat/completions",
                                    {"messages": MSGS, "max_tokens": 100_000},
                                    None, "maximum context length is 512"),
    "prompt past the context": ("/v1/completions", {"prompt": "word " * 2000},
                                None, "maximum context length is 512"),
    "anthropic stop_sequences": ("/v1/messages", {"messages": MSGS, "max_tokens": 8,
                                                  "stop_sequences": ["a", "b", "c", "d"]},
                                 None, "limit of 3"),
    "anthropic tools": ("/v1/messages", {"messages": MSGS, "max_tokens": 8,
                                         "tools": ANTH_TOOLS}, None, "limit of 128"),
    "responses tools": ("/v1/responses", {"input": "hi", "tools": RESP_TOOLS}, "tools",
                        "limit of 128"),
    "tokenize tools": ("/tokenize", {"messages": MSGS, "tools": CHAT_TOOLS}, "tools",
                       "limit of 128"),
    "responses top_logprobs": ("/v1/responses", {"input": "hi", "top_logprobs": 6},
                               "top_logprobs", "limit of 5"),
}


@pytest.mark.parametrize("path, body, param, limit", CASES.values(), ids=CASES.keys())
def test_bound_is_400_naming_field_and_limit(server, path, body, param, limit):
    r = httpx.post(server.base + path, json={"model": "fake", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert limit in err["message"], err
    if param is not None:  # OpenAI schema: the field is named in `param` and in the message
        # (the context-length errors keep OpenAI's own wording, which names prompt and max_tokens)
        assert err["param"] == param and param in err["message"]
    ok = httpx.post(server.base + "/v1/chat/completions",
                    json={"model": "fake", "messages": MSGS}, timeout=30)
    assert ok.json()["choices"][0]["message"]["content"] == DEFAULT_REPLY


def test_within_the_bounds_is_served(server):
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30, json={
        "model": "fake", "messages": MSGS, "n": 4, "logprobs": True, "top_logprobs": 5,
        "stop": ["a-b-c", "x", "y"], "tools": CHAT_TOOLS[:128]})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4


def test_huge_body_is_413(server):
    r = httpx.post(server.base + "/v1/chat/completions", timeout=30, json={
        "model": "fake", "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    assert r.status_code == 413 and "limit of 1048576 bytes" in r.json()["error"]["message"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
