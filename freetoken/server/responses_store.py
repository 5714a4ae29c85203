"""What `/v1/responses` keeps between requests, and how its input becomes chat-template messages.

`ResponseStore` holds the last N responses in memory (oldest dropped first), each with the
conversation that led to it as chat-template messages, so `previous_response_id` continues it
and `GET /v1/responses/{id}` returns it. Nothing is written to disk: a restart forgets them.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import TypeAdapter, ValidationError

from freetoken.server.errors import bad_request, format_validation_error
from freetoken.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputMessage,
    ReasoningItem,
)

_ITEM = TypeAdapter(InputItem)
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ResponseCancelled(Exception):
    """Put into a running response's output queue by `POST /v1/responses/{id}/cancel`."""


@dataclass
class StoredResponse:
    run: object  # its ResponseRun: `run.response()` is the Response object, live while it runs
    messages: list[dict]  # the conversation, this response's output included once it ends
    stream: object | None = None  # the RequestStream while it runs; None once it ended
    task: asyncio.Task | None = None  # a background response's consumer
    input_items: list[dict] = field(default_factory=list)  # for GET .../input_items


class ResponseStore:
    """The last `capacity` responses by id; adding one past capacity drops the oldest."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, rec: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self.items[rid] = rec
        self.items.move_to_end(rid)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        return self.items.get(rid)

    def pop(self, rid: str) -> StoredResponse | None:
        return self.items.pop(rid, None)


def parse_items(raw: str | list[dict]) -> list:
    """`input` as typed items; a bad item is a 400 naming its index and field."""
    if isinstance(raw, str):
        return [InputMessage(role="user", content=raw)]
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            raise bad_request(
                f"input[{i}].type: unsupported input item type {kind!r}; this server takes "
                f"{', '.join(_ITEM_TYPES)}", param=f"input.{i}.type")
        try:
            items.append(_ITEM.validate_python({"type": "message", **item}))
        except ValidationError as e:
            raise bad_request(f"input[{i}]: {format_validation_error(e)}",
                              param=f"input.{i}") from None
    return items


def item_records(items: list) -> list[dict]:
    """Input items as `GET /v1/responses/{id}/input_items` lists them: each with an id."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        if isinstance(item, InputMessage):
            kind = "output_text" if item.role == "assistant" else "input_text"
            d["content"] = [{"type": kind, "text": item.text()}]
            d["status"] = "completed"
        elif isinstance(item, FunctionCallOutputItem):
            d["output"], d["status"] = item.text(), "completed"
        prefix = {"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}.get(
            item.type, "fco_")
        d.setdefault("id", f"{prefix}{secrets.token_hex(12)}")
        out.append(d)
    return out


def _call_names(messages: list[dict]) -> dict[str, str]:
    return {c["id"]: c["function"]["name"]
            for m in messages for c in m.get("tool_calls") or ()}


def append_items(messages: list[dict], items: list, parse_arguments) -> list[dict]:
    """Add input items to a conversation as chat-template messages (a new list).

    A reasoning item goes with the assistant message that follows it; function calls join the
    assistant message just before them (a response's [message, function_call] output is one
    assistant turn); a function_call_output is a `tool` message.
    """
    out, reasoning = list(messages), ""
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning += item.text()
        elif isinstance(item, InputMessage):
            role = "system" if item.role == "developer" else item.role
            msg = {"role": role, "content": item.text()}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            args = parse_arguments(item.arguments, f"input.{i}.arguments")
            call = {"type": "function", "id": item.call_id,
                    "function": {"name": item.name, "arguments": args}}
            if not out or out[-1]["role"] != "assistant" or reasoning:
                out.append({"role": "assistant", "content": ""})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = reasoning, ""
            out[-1] = {**out[-1], "tool_calls": [*(out[-1].get("tool_calls") or []), call]}
        elif isinstance(item, FunctionCallOutputItem):
            msg = {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
            name = _call_names(out).get(item.call_id)
            if name:
                msg["name"] = name
            out.append(msg)
    return out
