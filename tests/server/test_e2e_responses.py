"""The Responses API on a real `ft serve` of Qwen2.5-Coder-0.5B-Instruct (its chat template knows
tools; the server picks the hermes parser from it), driven by the official `openai` client's
`responses.create` and `responses.stream`: text, a function-call round trip, the streaming
events in OpenAI's documented order, bad input answered with a 4xx while the server keeps
serving, and `"n": 1000` refused. One server for the module, greedy decoding, few tokens.
"""

from __future__ import annotations

import json
import sys

import httpx
import openai
import pytest
from helpers import ServeProcess

pytestmark = pytest.mark.slow  # each token costs a full dequantization on the CPU path

MODEL = "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "name": "get_weather",
          "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {
              "city": {"type": "string", "description": "the city name"}},
              "required": ["city"]}}]
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


def test_start_up_banner(server):
    log = server.log.read_text(errors="replace")
    assert f"chat page    {server.base}/" in log and f"API          {server.base}/v1:" in log
    assert "MoE backend  none (a dense model)" in log and "GiB host (resident)" in log
    assert "context      2048 tokens per request" in log and "tool calls hermes" in log


def test_text(oai):
    r = oai.responses.create(model=MODEL, input="Say hello.", instructions="Answer briefly.",
                             temperature=0, max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.output[0].type == "message" and r.usage.output_tokens <= 4
    assert oai.responses.retrieve(r.id).output_text == r.output_text


def test_function_call_round_trip(oai):
    # Named tool_choice: the server starts the call for the model, so few tokens are generated.
    r = oai.responses.create(model=MODEL, input=ASK, tools=TOOLS, temperature=0,
                             tool_choice={"type": "function", "name": "get_weather"},
                             max_output_tokens=16)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r.output
    assert calls[0].name == "get_weather"
    assert "paris" in json.loads(calls[0].arguments)["city"].lower()
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": '{"temp_c": 21, "sky": "sunny"}'}
    follow = ASK + [o.model_dump(exclude_none=True) for o in r.output] + [result]
    r2 = oai.responses.create(model=MODEL, input=follow, tools=TOOLS, temperature=0,
                              max_output_tokens=3)
    assert r2.output_text.strip() and not [o for o in r2.output if o.type == "function_call"]
    assert r2.usage.input_tokens > r.usage.input_tokens  # the call and its result went in
    # the same turn through previous_response_id: the stored conversation plus the result
    r3 = oai.responses.create(model=MODEL, previous_response_id=r.id, tools=TOOLS,
                              temperature=0, max_output_tokens=3, input=[result])
    assert r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.output_text == r2.output_text


def test_stream_events_in_documented_order(oai):
    with oai.responses.stream(model=MODEL, input="Count from 1 to 5.", temperature=0,
                              max_output_tokens=3) as stream:
        kinds = [e.type for e in stream]
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    tail = ["response.output_text.done", "response.content_part.done",
            "response.output_item.done"]
    assert kinds[-4:-1] == tail and kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


BAD = [
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "unsupported tool type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [["not", "an", "item"]]}, "input"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "resp_unknown"),
]


def test_bad_input_is_4xx_and_the_server_keeps_serving(oai, server):
    for kwargs, fragment in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=MODEL, max_output_tokens=4, **kwargs)
        assert fragment in e.value.message, kwargs
    r = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "n": 1000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "limit of 8" in r.json()["error"]["message"]
    r = oai.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=1)
    assert r.usage.output_tokens == 1 and r.output


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
