"""Tool-call parsers: pull function calls out of a model's text output, streamed or not.

- `hermes` (Qwen2.5 / Qwen3 / Hermes templates): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks anywhere in the text.
- `llama3_json` (Llama 3.x templates): the whole output is `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`; several calls separated by `;`).
- `gemma` (Gemma's prompted style): fenced ```` ```tool_code ```` blocks holding Python calls
  `name(arg=value, ...)`.

Each parser's `feed(delta)` returns (content_delta, calls) where calls are complete
`ParsedToolCall`s; text that might still turn into a tag is held back, so `content` never shows
a partial tag. `finish()` flushes: a block that does not parse is returned as content, never
dropped. `prefix` is text the server put at the start of the assistant turn (to force a call);
it is parsed as if the model had written it.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from freetoken.server.parsers.reasoning import safe_prefix_len


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it

    def input(self) -> dict:
        return json.loads(self.arguments)


def _call_from_json(obj: object, args_key: str) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json_call(text: str) -> list[ParsedToolCall] | None:
    try:
        call = _call_from_json(json.loads(text), "arguments")
    except json.JSONDecodeError:
        return None
    return [call] if call else None


def decode_python_calls(text: str) -> list[ParsedToolCall] | None:
    """`f(a=1, b="x")` lines, or a list `[f(a=1), g()]`, with literal keyword arguments only."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        if None in args:
            return None
        calls.append(ParsedToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


class TaggedToolParser:
    """Calls inside `start ... end` blocks; the text between blocks is content."""

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self, prefix: str = "") -> None:
        self.buf = prefix
        self.in_call = False
        self._after_call = False
        self.prefix = prefix

    @staticmethod
    def decode(inner: str) -> list[ParsedToolCall] | None:
        return decode_json_call(inner)

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.buf += text
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while self.buf:
            tag = self.end if self.in_call else self.start
            # NOTE: search for the end after the start tag (gemma's end ``` begins its start).
            i = self.buf.find(tag, len(self.start) if self.in_call else 0)
            if not self.in_call:
                if self._after_call:  # newlines between / after calls are not content
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        break
                    self._after_call = False
                    continue
                n = i if i >= 0 else safe_prefix_len(self.buf, tag)
                content.append(self.buf[:n])
                self.buf = self.buf[n:]
                if i < 0:
                    break
                self.in_call = True  # keep the start tag in buf until the block is complete
                continue
            if i < 0:
                break
            block_end = i + len(tag)
            n_calls = len(calls)
            content.append(self._close(self.buf[:block_end], calls))
            self.buf = self.buf[block_end:]
            self.in_call = False
            self._after_call = len(calls) > n_calls
        return "".join(content), calls

    def _close(self, block: str, calls: list[ParsedToolCall]) -> str:
        """Decode one whole block; return it as content if it does not parse."""
        inner = block[len(self.start) : len(block) - len(self.end)]
        parsed = self.decode(inner)
        if parsed is None:
            return block
        calls.extend(parsed)
        return ""

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        content, calls = self.feed("")
        rest, self.buf = self.buf, ""
        if self.in_call:  # unclosed block (EOS or a stop string cut the end tag): try it
            self.in_call = False
            parsed = self.decode(rest[len(self.start) :])
            if parsed is not None:
                return content, calls + parsed
        return content + rest, calls


class HermesToolParser(TaggedToolParser):
    """`<tool_call>` blocks; also a bare `{"name": ..., "arguments": ...}` answer.

    NOTE: small Qwen2.5 models often answer with the bare JSON object, no tags (seen with
    Qwen2.5-Coder-0.5B-Instruct under greedy decoding), so an output whose first character is
    `{` is held back to the end and parsed whole; if it is not a call, it is the content.
    """

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self, prefix: str = "") -> None:
        super().__init__(prefix)
        self.bare: str | None = None if not prefix else ""  # None: undecided; else the mode
        self.held = ""

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        if self.bare is None:
            self.held += text
            head = self.held.lstrip()
            if not head:
                return "", []
            self.bare = "json" if head.startswith("{") else ""
            text, self.held = self.held, ""
            if self.bare:
                self.held = text
                return "", []
        if self.bare == "json":
            self.held += text
            return "", []
        return super().feed(text)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        if self.bare == "json":
            calls = _bare_calls(self.held.strip(), "arguments")
            if calls:
                return "", calls
            self.bare = ""
            content, calls = super().feed(self.held)
            rest, more = super().finish()
            return content + rest, calls + more
        if self.bare is None:  # only whitespace came
            return self.held, []
        return super().finish()

    @staticmethod
    def forced_prefix(name: str | None) -> str:
        if name is None:
            return '<tool_call>\n{"name": "'
        # The open brace keeps small models from writing a non-object as the arguments.
        return '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments": {'


class GemmaToolParser(TaggedToolParser):
    start, end = "```tool_code", "```"

    @staticmethod
    def decode(inner: str) -> list[ParsedToolCall] | None:
        return decode_python_calls(inner)

    @staticmethod
    def forced_prefix(name: str | None) -> str:
        return "```tool_code\n" + (f"{name}(" if name else "")


class Llama3JsonToolParser:
    """The whole output is one or more JSON calls; anything else is plain content."""

    python_tag = "<|python_tag|>"

    def __init__(self, prefix: str = "") -> None:
        self.buf = prefix
        self.mode: str | None = None  # None: undecided, "json": buffering, "text": content
        self.prefix = prefix

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self.buf += text
        if self.mode is None:
            head = self.buf.lstrip()
            if not head or self.python_tag.startswith(head):
                return "", []  # cannot tell yet
            json_like = head.startswith("{") or head.startswith(self.python_tag)
            self.mode = "json" if json_like else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return out, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest, self.buf = self.buf, ""
        if self.mode == "text" or not rest.strip():
            return rest, []
        calls = _bare_calls(rest.strip().removeprefix(self.python_tag).strip(), "parameters")
        return ("", calls) if calls else (rest, [])

    @staticmethod
    def forced_prefix(name: str | None) -> str:
        if name is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(name) + ', "parameters": {'


def _bare_calls(body: str, args_key: str) -> list[ParsedToolCall] | None:
    """`{call}; {call}` -> the calls, or None if any part is not a call."""
    calls = []
    for part in _split_json_objects(body):
        try:
            call = _call_from_json(json.loads(part), args_key)
        except json.JSONDecodeError:
            call = None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` -> each object's text, using the JSON decoder to find where each ends."""
    dec, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            _, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text[i:]]  # let the caller's json.loads fail and report it as content
        parts.append(text[i:end])
        i = end
        while i < len(text) and text[i] in " \n\t;,":
            i += 1
    return parts


TOOL_PARSERS = {
    "hermes": HermesToolParser,
    "qwen3": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "gemma": GemmaToolParser,
}
