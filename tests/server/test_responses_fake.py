"""`/v1/responses` on the scripted engine (fake_engine.py), driven by the official `openai`
client: text, instructions, streaming events in the documented order, reasoning and
function-call items, previous_response_id, GET / cancel / DELETE by id, the bounded store, and
bad input answered with a 4xx while the server keeps serving. The Response objects and events
are checked against `openai.types.responses` (the client parses them into those types).
test_e2e_responses.py runs the same API on a real model.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import openai
import pytest
from fake_engine import DEFAULT_REPLY, FakeEngine
from helpers import ThreadServer, metric
from openai.types.responses import Response

from freetoken import assets
from freetoken.commands.serve import make_app
from freetoken.config import EngineConfig, ServerConfig
from freetoken.tokenizer.tokenizer import Tokenizer

THINK = "<think>\nI ponder the sky.\n</think>\n\nIt is blue."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
LONG = " ".join(["word"] * 400)


def say(text: str) -> str:
    return f"[[say:{text}:yas]]"


@pytest.fixture(scope="module")
def server():
    tok = Tokenizer.from_path(assets.smollm2_path())
    conf = ServerConfig(engine=EngineConfig(), served_model_name="fake",
                        reasoning_parser="think", tool_call_parser="hermes",
                        max_stored_responses=4)
    s = ThreadServer(make_app(conf, lambda _cfg: FakeEngine(tok)))
    yield s
    s.stop()


@pytest.fixture()
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=60)


def test_text_with_instructions(oai):
    r = oai.responses.create(model="fake", input="hi", instructions="Be brief.")
    assert isinstance(r, Response) and r.status == "completed"
    assert r.output_text == DEFAULT_REPLY
    assert [o.type for o in r.output] == ["message"]
    assert r.instructions == "Be brief." and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_message_items_and_max_output_tokens(oai):
    r = oai.responses.create(model="fake", max_output_tokens=3, input=[
        {"role": "developer", "content": "You answer."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": say("one two three four five")}]}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output_text.strip()


def test_stream_events_in_documented_order(oai):
    with oai.responses.stream(model="fake", input=say(THINK)) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    per_item = ["response.output_item.added", "response.content_part.added"]
    r0 = kinds.index("response.output_item.added")
    assert kinds[r0:r0 + 3] == [*per_item, "response.reasoning_text.delta"]
    m0 = kinds.index("response.output_text.delta")
    assert kinds[m0 - 2:m0] == per_item
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    i = kinds.index("response.reasoning_text.done")  # the reasoning item closes first
    assert kinds[i:i + 3] == ["response.reasoning_text.done", "response.content_part.done",
                              "response.output_item.done"] and i + 3 < m0
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "I ponder the sky.\n"
    assert final.output_text == "It is blue."
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "It is blue."


def test_function_call_round_trip(oai):
    r = oai.responses.create(model="fake", input=say(CALL), tools=TOOLS)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert not r.output_text.strip()
    follow = [{"role": "user", "content": say(CALL)}, *[o.model_dump() for o in r.output],
              {"type": "function_call_output", "call_id": calls[0].call_id,
               "output": '{"temp_c": 21}'}]
    r2 = oai.responses.create(model="fake", input=follow, tools=TOOLS)
    assert r2.output_text == CALL or r2.output  # the script repeats; the point is acceptance
    assert r2.usage.input_tokens > r.usage.input_tokens
    items = oai.responses.input_items.list(r2.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]
    assert items.data[2].call_id == calls[0].call_id and not items.has_more
    assert items.data[0].content[0].text == say(CALL)
    first = oai.responses.input_items.list(r2.id, limit=1)  # newest first by default
    assert first.has_more and first.data[0].type == "function_call_output"
    rest = oai.responses.input_items.list(r2.id, limit=5, after=first.data[0].id)
    assert [i.type for i in rest.data] == ["function_call", "message"]


def test_streamed_function_call(oai):
    with oai.responses.stream(model="fake", input=say(CALL), tools=TOOLS) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    assert [o.type for o in final.output] == ["function_call"]
    assert json.loads(final.output[0].arguments) == {"city": "Paris"}


def test_previous_response_id_continues(oai):
    r1 = oai.responses.create(model="fake", input="My name is Ada. " + say("Noted, Ada."))
    r2 = oai.responses.create(model="fake", input="What is my name?",
                              previous_response_id=r1.id)
    assert r2.previous_response_id == r1.id
    # the fake engine answers the last [[say:...]] of the whole prompt: r1's turn is in it
    assert r2.output_text == "Noted, Ada."
    assert r2.usage.input_tokens > r1.usage.input_tokens


def test_get_delete_and_bounded_store(oai):
    first = oai.responses.create(model="fake", input="hi")
    assert oai.responses.retrieve(first.id).output_text == DEFAULT_REPLY
    for _ in range(4):  # the store holds 4: the oldest goes
        oai.responses.create(model="fake", input="hi")
    with pytest.raises(openai.NotFoundError, match="keeps the last 4"):
        oai.responses.retrieve(first.id)
    last = oai.responses.create(model="fake", input="hi")
    oai.responses.delete(last.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(last.id)
    unstored = oai.responses.create(model="fake", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_background_cancel(oai):
    r = oai.responses.create(model="fake", input=say(LONG), background=True)
    assert r.status == "in_progress"
    time.sleep(0.1)
    c = oai.responses.cancel(r.id)
    assert c.status == "cancelled"
    assert oai.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="only a response in progress"):
        oai.responses.cancel(r.id)
    done = oai.responses.create(model="fake", input="hi", background=True)
    for _ in range(200):
        if oai.responses.retrieve(done.id).status != "in_progress":
            break
        time.sleep(0.02)
    assert oai.responses.retrieve(done.id).output_text == DEFAULT_REPLY


@pytest.mark.parametrize("body, status, fragment", [
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, 400, "unsupported tool type"),
    ({"input": {"role": "user"}}, 400, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user"}]}, 400, "input[0]"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, 400, "resp_nope"),
    ({"input": "hi", "bogus": 1}, 400, "bogus"),
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "maximum context length"),
    ({"input": "hi", "top_logprobs": 50}, 400, "top_logprobs"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
    ({"input": "hi", "model": "other"}, 404, "other"),
])
def test_bad_input_is_4xx_and_the_server_keeps_serving(server, body, status, fragment):
    r = httpx.post(server.base + "/v1/responses", json={"model": "fake", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"]
    ok = httpx.post(server.base + "/v1/responses", json={"model": "fake", "input": "hi"})
    assert ok.status_code == 200 and ok.json()["status"] == "completed"


def test_stream_disconnect_aborts_generation(server):
    body = {"model": "fake", "input": say(LONG), "stream": True}
    aborted = metric(server.base, "freetoken_request_finished_total", 0, reason="abort")
    with httpx.stream("POST", server.base + "/v1/responses", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert any("response.output_text.delta" in line for line in lines)
    deadline = time.monotonic() + 10
    while metric(server.base, "freetoken_http_requests_in_flight") and (
            time.monotonic() < deadline):
        time.sleep(0.05)
    assert metric(server.base, "freetoken_http_requests_in_flight") == 0
    assert metric(server.base, "freetoken_request_finished_total", reason="abort") == aborted + 1


def test_unknown_ids_are_404(server):
    assert httpx.get(server.base + "/v1/responses/resp_nope").status_code == 404
    assert httpx.post(server.base + "/v1/responses/resp_nope/cancel").status_code == 404


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
