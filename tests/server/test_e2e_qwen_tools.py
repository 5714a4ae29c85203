"""A tool-call round trip on a real `ft serve` of Qwen2.5-Coder-0.5B-Instruct (its chat template
knows tools; the server picks the hermes `<tool_call>` parser from it), without an API key
(auth off), driven by the official `openai` and `anthropic` clients. Greedy decoding.
"""

from __future__ import annotations

import json
import sys

import anthropic
import httpx
import openai
import pytest
from helpers import ServeProcess

pytestmark = pytest.mark.slow  # each token costs a full dequantization on the CPU path

MODEL = "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServeProcess("--model", MODEL, "--max-model-len", "2048",
                     log_dir=tmp_path_factory.mktemp("serve")).wait()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                         timeout=900)


def test_auth_off(server):
    r = httpx.get(server.base + "/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL


def test_named_tool_choice_forces_the_call(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=32)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_openai_tool_call_round_trip(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0,
                                    max_tokens=24)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert "<tool_call>" not in (choice.message.content or "")
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "sunny"}'},
    ]
    r2 = oai.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, temperature=0,
                                     max_tokens=12)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens  # the call and its result went in


def test_streamed_tool_call_matches(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              temperature=0, max_tokens=24, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_anthropic_tool_use(server):
    client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0,
                                 timeout=900)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    greedy = {"temperature": 0}  # anthropic>=2 clients only send it through extra_body
    m = client.messages.create(model=MODEL, max_tokens=24, extra_body=greedy, tools=tools,
                               messages=ASK)
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and "paris" in use.input["city"].lower()
    m2 = client.messages.create(
        model=MODEL, max_tokens=12, extra_body=greedy, tools=tools,
        messages=ASK + [
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "21 C and sunny"}]}])
    assert m2.content and m2.content[0].type == "text" and m2.content[0].text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
