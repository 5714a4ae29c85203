"""The HTTP layer on a scripted engine (fake_engine.py) with SmolLM2's real tokenizer and chat
template, driven by the official `openai` and `anthropic` clients.

The scripted engine makes the model's output exactly what a test needs (think blocks, tool
calls, long outputs to disconnect from), so parsers, SSE framing, error schemas, auth, metrics
and cancellation are checked on the real server path, quickly. test_e2e_*.py runs real models.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import anthropic
import httpx
import openai
import pytest
from fake_engine import DEFAULT_REPLY, FakeEngine
from helpers import ThreadServer, metric

from freetoken import assets
from freetoken.commands.serve import make_app
from freetoken.config import EngineConfig, ServerConfig
from freetoken.tokenizer.tokenizer import Tokenizer

THINK = "<think>\nI ponder the sky.\n</think>\n\nIt is blue."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(assets.smollm2_path())


def _serve(tok, **cfg) -> ThreadServer:
    conf = ServerConfig(engine=EngineConfig(), served_model_name="fake",
                        reasoning_parser="think", tool_call_parser="hermes", **cfg)
    return ThreadServer(make_app(conf, lambda _cfg: FakeEngine(tok)))


@pytest.fixture(scope="module")
def server(tok):
    s = _serve(tok)
    yield s
    s.stop()


@pytest.fixture()
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": f"[[say:{text}:yas]]"}]


def test_health_and_models(server):
    assert httpx.get(server.base + "/health").status_code == 200
    models = openai.OpenAI(base_url=server.base + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["fake"]


def test_chat_plain_and_usage(oai, tok):
    msgs = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model="fake", messages=msgs)
    assert r.choices[0].message.content == DEFAULT_REPLY
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.encode_chat(msgs))
    # the reply's tokens plus the EOS that ended it
    assert r.usage.completion_tokens == len(tok.encode(DEFAULT_REPLY, False)) + 1


def test_chat_stream_with_usage(oai):
    chunks = list(oai.chat.completions.create(
        model="fake", messages=say("one two three"), stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_reasoning_split_streamed_and_not(oai):
    r = oai.chat.completions.create(model="fake", messages=say(THINK))
    msg = r.choices[0].message
    assert msg.content == "It is blue."
    assert msg.reasoning_content == "I ponder the sky.\n"
    chunks = list(oai.chat.completions.create(model="fake", messages=say(THINK), stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    content = [d.content or "" for d in deltas]
    reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    assert "".join(content) == "It is blue." and "".join(reasoning) == "I ponder the sky.\n"
    assert not any("<" in c or ">" in c for c in content)  # no partial tags leak


def test_tool_call_streamed_and_not(oai):
    r = oai.chat.completions.create(model="fake", messages=say("Let me look. " + CALL),
                                    tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me look. "
    call = ch.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(oai.chat.completions.create(model="fake", messages=say(CALL), tools=TOOLS,
                                              stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    # tool_choice "none": the same text is plain content
    r = oai.chat.completions.create(model="fake", messages=say(CALL), tools=TOOLS,
                                    tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls


def test_completions_and_logprobs(oai):
    r = oai.completions.create(model="fake", prompt="[[say:abc def:yas]]", max_tokens=50,
                               logprobs=2)
    assert r.choices[0].text == "abc def"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) == 2 for t in lp.top_logprobs)
    r = oai.completions.create(model="fake", prompt="[[say:a b c d e f g:yas]]", max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    chunks = list(oai.completions.create(model="fake", prompt="[[say:x y:yas]]", stream=True,
                                         max_tokens=20))
    assert "".join(c.choices[0].text for c in chunks) == "x y"


def test_chat_logprobs_and_n(oai):
    r = oai.chat.completions.create(model="fake", messages=say("hi there"), logprobs=True,
                                    top_logprobs=2, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "hi there" for c in r.choices)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content).startswith("hi there")
    assert all(len(e.top_logprobs) == 2 for e in content)


def test_anthropic_messages(server):
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    m = client.messages.create(model="fake", max_tokens=64, system="Be brief.",
                               messages=say(THINK))
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[1].text == "It is blue." and m.stop_reason == "end_turn"
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    m = client.messages.create(model="fake", max_tokens=64, tools=tools, messages=say(CALL))
    assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Paris"}
    with client.messages.stream(model="fake", max_tokens=64, messages=say(THINK)) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "I ponder the sky.\n"
    n = client.messages.count_tokens(model="fake", messages=say("x"))
    assert n.input_tokens > 5


def test_anthropic_tool_result_round_trip(server, tok):
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    msgs = say(CALL) + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "[[say:Sunny.:yas]]"}]},
    ]
    m = client.messages.create(model="fake", max_tokens=32, messages=msgs,
                               tools=[{"name": "get_weather", "input_schema": {}}])
    assert m.content[0].text == "Sunny."


def test_errors_use_the_schemas(server, oai):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=say("x"))
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="fake", messages=say("x"), max_tokens=10**6)
    assert "maximum context length is 512" in str(e.value)
    r = httpx.post(server.base + "/v1/messages", content=b"{bad json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_auth(tok):
    s = _serve(tok, api_key="sekret")
    try:
        bad = openai.OpenAI(base_url=s.base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="fake", messages=say("x"))
        good = openai.OpenAI(base_url=s.base + "/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="fake", messages=say("ok")).choices
        ac = anthropic.Anthropic(base_url=s.base, api_key="sekret", max_retries=0)
        assert ac.messages.create(model="fake", max_tokens=8, messages=say("ok")).content
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=s.base, api_key="no", max_retries=0).messages.create(
                model="fake", max_tokens=8, messages=say("ok"))
        assert httpx.get(s.base + "/health").status_code == 200  # not behind the key
    finally:
        s.stop()


async def _disconnect_many(base: str, n: int) -> None:
    body = {"model": "fake", "messages": say("long " * 40), "stream": True,
            "ignore_eos": True, "max_tokens": 400}
    async with httpx.AsyncClient(timeout=30) as client:
        async def one():
            async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                got = 0
                async for _ in r.aiter_lines():
                    got += 1
                    if got > 4:
                        break  # leave mid-stream; closing the response drops the connection
        await asyncio.gather(*[one() for _ in range(n)])


def test_disconnect_frees_everything(server, oai):
    aborted = metric(server.base, "freetoken_request_finished_total", 0, reason="abort")
    asyncio.run(_disconnect_many(server.base, 20))
    # The server notices each dropped connection when it next writes to it: wait for that
    # event (bounded generously, for a busy machine), not for a fixed time.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if metric(server.base, "freetoken_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(server.base, "freetoken_num_requests_running") == 0
    assert metric(server.base, "freetoken_num_requests_waiting") == 0
    assert metric(server.base, "freetoken_kv_cache_pages_used") == 0
    assert metric(server.base, "freetoken_request_finished_total", reason="abort") == aborted + 20
    assert oai.chat.completions.create(model="fake", messages=say("still here")).choices[
        0].message.content == "still here"


def test_overload_is_503(tok):
    s = _serve(tok, max_in_flight_requests=1)
    try:
        body = {"model": "fake", "messages": say("x " * 50), "stream": True,
                "ignore_eos": True, "max_tokens": 300}
        with httpx.stream("POST", s.base + "/v1/chat/completions", json=body) as held:
            lines = held.iter_lines()  # NOTE: keep it: a dropped iterator closes the connection
            next(lines)
            assert metric(s.base, "freetoken_http_requests_in_flight") == 1
            r = httpx.post(s.base + "/v1/chat/completions", json={**body, "stream": False})
            assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
            assert next(lines) is not None  # the held stream still runs
    finally:
        s.stop()


def test_health_is_503_while_loading_and_on_load_failure(tok):
    import threading

    gate = threading.Event()

    def slow(_cfg):
        gate.wait(30)
        return FakeEngine(tok)

    conf = ServerConfig(engine=EngineConfig(), served_model_name="fake")
    app = make_app(conf, slow)
    s = ThreadServer(app, wait=False)  # /health must say 503 first
    try:
        _wait_status(s.base, 503)
        r = httpx.get(s.base + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(s.base + "/v1/chat/completions", json={"messages": say("x")})
        assert r.status_code == 503
        gate.set()
        _wait_status(s.base, 200)
    finally:
        gate.set()
        s.stop()

    def broken(_cfg):
        raise ValueError("no such tensor: blk.0.attn_q.weight")

    s = ThreadServer(make_app(conf, broken), wait=False)
    try:
        body = _wait_status(s.base, 503, lambda b: b["status"] == "error")
        assert "blk.0.attn_q.weight" in body["detail"]
    finally:
        s.stop()


def _wait_status(base: str, status: int, ok=lambda body: True) -> dict:
    deadline = time.monotonic() + 120  # an event, bounded generously for a busy machine
    while time.monotonic() < deadline:
        try:
            r = httpx.get(base + "/health")
            if r.status_code == status and ok(r.json()):
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
