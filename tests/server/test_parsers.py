"""Reasoning and tool-call parsers: streamed in every split equals parsed whole, partial tags
never reach content, what does not parse comes back as content (nothing is dropped)."""

from __future__ import annotations

import json
import random
import sys

import pytest

from freetoken.server.parsers import choose_parsers
from freetoken.server.parsers.reasoning import ThinkParser, safe_prefix_len
from freetoken.server.parsers.tool_calls import (
    GemmaToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
)

THINK_CASES = [
    ("<think>\nplan\n</think>\n\nanswer", "plan\n", "answer"),
    ("no tags at all", "", "no tags at all"),
    ("<think>unclosed reasoning", "unclosed reasoning", ""),
    ("a < b and c <thin d", "", "a < b and c <thin d"),  # tag-like text that is not a tag
    ("pre<think>r</think>post", "r", "prepost"),
]


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _run_think(pieces: list[str], **kw) -> tuple[str, str, list[str]]:
    p = ThinkParser(**kw)
    r, c, content_deltas = [], [], []
    for piece in pieces:
        a, b = p.feed(piece)
        r.append(a)
        c.append(b)
        content_deltas.append(b)
    a, b = p.finish()
    return "".join(r) + a, "".join(c) + b, content_deltas


@pytest.mark.parametrize("text,reasoning,content", THINK_CASES)
def test_think_parser_any_split(text, reasoning, content):
    rng = random.Random(0)
    for trial in range(50):
        pieces = list(text) if trial == 0 else _pieces(text, rng)
        r, c, deltas = _run_think(pieces)
        assert (r, c) == (reasoning, content), pieces
        if "<think>" in text:  # no piece of a real tag is ever released as content
            assert not any(d.endswith(("<", "<t", "<th", "</")) for d in deltas)


def test_think_parser_starting_inside_reasoning():
    r, c, _ = _run_think(list("I reason</think>\n\nDone"), starts_in_reasoning=True)
    assert (r, c) == ("I reason", "Done")


def test_safe_prefix_len():
    assert safe_prefix_len("abc<thi", "<think>") == 3
    assert safe_prefix_len("abc", "<think>") == 3
    assert safe_prefix_len("<", "<think>") == 0


CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
HERMES = f"Let me check.<tool_call>\n{json.dumps(CALL)}\n</tool_call>\n<tool_call>" \
         f'{{"name": "f", "arguments": {{}}}}</tool_call>'


def _run_tools(parser, pieces: list[str]):
    content, calls, deltas = [], [], []
    for piece in pieces:
        c, k = parser.feed(piece)
        content.append(c)
        deltas.append(c)
        calls += k
    c, k = parser.finish()
    return "".join(content) + c, calls + k, deltas


def test_hermes_any_split():
    rng = random.Random(1)
    for trial in range(60):
        pieces = list(HERMES) if trial == 0 else _pieces(HERMES, rng)
        content, calls, deltas = _run_tools(HermesToolParser(), pieces)
        assert content == "Let me check."
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", CALL["arguments"]), ("f", {})]
        assert not any("<" in d for d in deltas)


def test_hermes_bad_json_is_kept_as_content():
    text = "<tool_call>{not json}</tool_call> tail"
    content, calls, _ = _run_tools(HermesToolParser(), list(text))
    assert content == text and calls == []


def test_hermes_unclosed_block_at_end_still_parses():
    content, calls, _ = _run_tools(HermesToolParser(), [f"<tool_call>{json.dumps(CALL)}"])
    assert content == "" and calls[0].name == "get_weather"


def test_forced_prefix_completes_a_call():
    prefix = HermesToolParser.forced_prefix("get_weather")
    content, calls, _ = _run_tools(HermesToolParser(prefix=prefix),
                                   ['"city": "Oslo"}}', "\n</tool_call>"])
    assert content == "" and json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_hermes_bare_json_call():
    # What Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, dequantized in transformers) answers greedily
    # to "What is the weather like in Paris right now?" with a get_weather tool: no tags.
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    rng = random.Random(3)
    for trial in range(20):
        pieces = list(text) if trial == 0 else _pieces(text, rng)
        content, calls, _ = _run_tools(HermesToolParser(), pieces)
        assert content == "" and calls[0].name == "get_weather"
    content, calls, _ = _run_tools(HermesToolParser(), list('{"answer": 42}'))
    assert content == '{"answer": 42}' and calls == []
    content, calls, _ = _run_tools(HermesToolParser(), list("  \n"))
    assert content == "  \n" and calls == []


def test_llama3_json():
    text = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    content, calls, _ = _run_tools(Llama3JsonToolParser(), list(text))
    assert content == "" and [c.name for c in calls] == ["f", "g"]
    content, calls, _ = _run_tools(Llama3JsonToolParser(), list("Plain answer."))
    assert content == "Plain answer." and calls == []
    content, calls, _ = _run_tools(Llama3JsonToolParser(), ['{"oops": 1}'])
    assert content == '{"oops": 1}' and calls == []


def test_gemma_tool_code():
    text = 'Sure.\n```tool_code\nget_weather(city="Paris", days=2)\n```\n'
    rng = random.Random(2)
    for trial in range(30):
        pieces = list(text) if trial == 0 else _pieces(text, rng)
        content, calls, _ = _run_tools(GemmaToolParser(), pieces)
        assert content == "Sure.\n"  # the newline after a call is not content
        assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}


def test_choose_parsers_from_real_templates():
    from freetoken import assets
    from freetoken.tokenizer.tokenizer import Tokenizer

    smol = Tokenizer.from_path(assets.smollm2_path())
    assert choose_parsers(smol.model_family, smol.chat_template) == (None, None)
    qwen = Tokenizer.from_path(assets.qwen25_coder_path())
    assert choose_parsers(qwen.model_family, qwen.chat_template) == (None, "hermes")
    assert choose_parsers("qwen3", "", None, None) == ("think", None)
    assert choose_parsers("llama", "<|python_tag|>", "none", None) == (None, "llama3_json")
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        choose_parsers("llama", "", None, "nope")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
