"""A real `ft serve` process on SmolLM2-135M-Instruct (the embedded default model), driven by
the official `openai` and `anthropic` clients and raw HTTP.

One server per module (started with --api-key, so auth is on here; test_e2e_qwen_tools.py runs
one without). Outputs are greedy and short (the CPU reference path is slow on 2 cores).
References nobody here wrote: HF transformers' tokenizer and chat template for the usage
counts; the same request run alone for the concurrency check.
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
import util
from helpers import ServeProcess, metric

pytestmark = pytest.mark.slow  # each token costs a full dequantization on the CPU path

KEY = "test-key-123"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 8}
GREEDY_BODY = {"temperature": 0}  # anthropic>=2 dropped the argument


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --reasoning-parser think: SmolLM2 does not think on its own (its template has no <think>);
    # test_reasoning_split opens the think block in the prompt to exercise the parser.
    s = ServeProcess("--api-key", KEY, "--max-model-len", "2048", "--reasoning-parser", "think",
                     log_dir=tmp_path_factory.mktemp("serve")).wait()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(util.smollm2_tokenizer_dir())


def test_chat_plain_and_streamed_agree(oai, hf_tok):
    r = oai.chat.completions.create(model="smollm2-135m-instruct", messages=MSGS,
                                    logprobs=True, **GREEDY)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    ref = hf_tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert r.usage.prompt_tokens == len(ref)
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == GREEDY["max_tokens"]
    chunks = list(oai.chat.completions.create(
        model="smollm2-135m-instruct", messages=MSGS, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_plain_and_streamed(oai, hf_tok):
    prompt = "The capital of France is"
    r = oai.completions.create(model="smollm2-135m-instruct", prompt=prompt, **GREEDY)
    assert r.usage.prompt_tokens == len(hf_tok(prompt)["input_ids"])
    chunks = list(oai.completions.create(model="smollm2-135m-instruct", prompt=prompt,
                                         stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_anthropic_messages(server):
    client = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=600)
    m = client.messages.create(model="smollm2-135m-instruct", max_tokens=8, extra_body=GREEDY_BODY,
                               system="Answer in one word.", messages=MSGS)
    assert m.content[0].type == "text" and m.usage.output_tokens >= 1
    with client.messages.stream(model="smollm2-135m-instruct", max_tokens=8, extra_body=GREEDY_BODY,
                                system="Answer in one word.", messages=MSGS) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text and final.stop_reason == m.stop_reason
    n = client.messages.count_tokens(model="smollm2-135m-instruct", messages=MSGS,
                                     system="Answer in one word.")
    assert n.input_tokens == m.usage.input_tokens


def test_auth_required(server):
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(server.base + "/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smollm2-135m-instruct"
    assert httpx.get(server.base + "/health").status_code == 200


def test_reasoning_split_on_the_streamed_path(server, oai):
    """The assistant turn starts with `<think>` (continue_final_message), so the model's output
    begins inside a think block. The split must match the raw completion of the same tokens."""
    msgs = [{"role": "user", "content": "Is 17 a prime number? Think first."},
            {"role": "assistant", "content": "<think>\n"}]
    kw = {"add_generation_prompt": False, "continue_final_message": True}
    ids = _post(server, "/tokenize", json.dumps({"messages": msgs, **kw})).json()["tokens"]
    raw = oai.completions.create(model="smollm2-135m-instruct", prompt=ids,
                                 **GREEDY).choices[0].text
    reasoning, _, content = raw.partition("</think>")
    r = oai.chat.completions.create(model="smollm2-135m-instruct", messages=msgs,
                                    extra_body=kw, **GREEDY)
    msg = r.choices[0].message
    assert msg.reasoning_content == reasoning.lstrip("\n")
    assert (msg.content or "") == content.lstrip("\n")
    chunks = list(oai.chat.completions.create(model="smollm2-135m-instruct", messages=msgs,
                                              extra_body=kw, stream=True, **GREEDY))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (
        msg.reasoning_content)
    assert "".join(d.content or "" for d in deltas) == (msg.content or "")
    assert not any("think>" in (d.content or "") for d in deltas)


PROMPTS = ["Name a color.", "What is 2+2?", "Write one word about the sea, please, now.",
           "Hi"]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str) -> str:
    stream = await client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": prompt}],
        stream=True, **GREEDY)
    return "".join([c.choices[0].delta.content or "" async for c in stream])


def test_16_concurrent_streams_match_solo_runs(server):
    async def run() -> tuple[dict, list[str]]:
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, timeout=900)
        solo = {p: await _stream_text(client, p) for p in PROMPTS}
        together = await asyncio.gather(*[_stream_text(client, PROMPTS[i % 4])
                                          for i in range(16)])
        return solo, together

    solo, together = asyncio.run(run())
    assert all(solo.values())
    for i, text in enumerate(together):
        assert text == solo[PROMPTS[i % 4]], f"request {i} differs from its solo run"


def test_50_disconnects_leave_nothing_behind(server, oai):
    body = {"model": "smollm2-135m-instruct", "messages": MSGS, "stream": True,
            "max_tokens": 200, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(client: httpx.AsyncClient) -> int:
        async with client.stream("POST", server.base + "/v1/chat/completions", json=body,
                                 headers=headers) as r:
            async for line in r.aiter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    return 1  # a generated token arrived: hang up mid-stream
        return 0

    async def run() -> int:
        async with httpx.AsyncClient(timeout=900) as client:
            return sum(await asyncio.gather(*[one(client) for _ in range(50)]))

    finished = {reason: metric(server.base, "freetoken_request_finished_total", 0, reason=reason)
                for reason in ("length", "stop", "abort")}
    assert asyncio.run(run()) == 50
    deadline = time.monotonic() + 300  # an event, bounded generously for a busy machine
    while time.monotonic() < deadline and metric(server.base, "freetoken_num_requests_running"):
        time.sleep(0.2)
    assert metric(server.base, "freetoken_num_requests_running") == 0
    assert metric(server.base, "freetoken_num_requests_waiting") == 0
    assert metric(server.base, "freetoken_kv_cache_pages_used") == 0
    after = {reason: metric(server.base, "freetoken_request_finished_total", 0, reason=reason)
             for reason in finished}
    # every one of the 50 was cut short by its client: none ran to its end
    assert after == {**finished, "abort": finished["abort"] + 50}
    r = oai.chat.completions.create(model="smollm2-135m-instruct", messages=MSGS, **GREEDY)
    assert r.choices[0].message.content


def _post(server, path: str, content: bytes | str, **headers: str) -> httpx.Response:
    h = {"Authorization": f"Bearer {KEY}", "content-type": "application/json", **headers}
    return httpx.post(server.base + path, content=content, headers=h, timeout=60)


def _chat(**fields) -> str:
    return json.dumps({"model": "smollm2-135m-instruct", "messages": MSGS, **fields})


BAD_CHAT = {
    "malformed JSON": '{"messages": [',
    "not an object": "[1, 2, 3]",
    "empty body": "",
    "messages wrong type": json.dumps({"messages": "hello"}),
    "max_tokens wrong type": _chat(max_tokens="ten"),
    "temperature wrong type": _chat(temperature="hot"),
    "negative max_tokens": _chat(max_tokens=-5),
    "zero max_tokens": _chat(max_tokens=0),
    "huge max_tokens": _chat(max_tokens=10**12),
    "negative temperature": _chat(temperature=-1),
    "top_p out of range": _chat(top_p=7),
    "n zero": _chat(n=0),
    "unknown role": json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}),
    "empty messages": json.dumps({"messages": []}),
    "unknown field": _chat(frobnicate=True),
    "stop wrong type": _chat(stop=42),
    "bad tool arguments": json.dumps({"messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
         "function": {"name": "f", "arguments": "{not json"}}]}]}),
    "context overflow": _chat(messages=[{"role": "user", "content": "hello " * 3000}]),
}


@pytest.mark.parametrize("case", list(BAD_CHAT))
def test_bad_chat_input_is_4xx(server, case):
    r = _post(server, "/v1/chat/completions", BAD_CHAT[case])
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])
    assert r.json()["error"]["message"]


def test_bad_input_other_routes(server):
    assert _post(server, "/v1/chat/completions", b'{"messages": "\xff\xfe"}').status_code == 400
    big = b'{"messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}'
    assert _post(server, "/v1/chat/completions", big).status_code == 413
    r = _post(server, "/v1/chat/completions", _chat(model="gpt-9"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(server, "/v1/chat/completions", _chat(messages=[{"role": "user",
                                                             "content": "hello " * 3000}]))
    assert "maximum context length is 2048" in r.json()["error"]["message"]
    r = _post(server, "/v1/messages", json.dumps({"model": "smollm2-135m-instruct",
                                                  "messages": MSGS}))  # no max_tokens
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _post(server, "/v1/messages", json.dumps({"model": "smollm2-135m-instruct",
              "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}))
    assert r.status_code == 400
    r = _post(server, "/v1/completions", json.dumps({"prompt": [10**9]}))
    assert r.status_code == 400
    r = _post(server, "/detokenize", json.dumps({"tokens": [-1]}))
    assert r.status_code == 400
    ok = _post(server, "/tokenize", json.dumps({"prompt": "hello world"}))
    assert ok.json()["count"] == 2
    assert _post(server, "/detokenize", json.dumps({"tokens": ok.json()["tokens"]})).json()[
        "prompt"] == "hello world"
    assert server.alive() and httpx.get(server.base + "/health").status_code == 200
    assert metric(server.base, "freetoken_requests_total", 0, status="500") == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
