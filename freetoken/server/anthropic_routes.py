"""Anthropic `/v1/messages` (streamed events and not) and `/v1/messages/count_tokens`.

Messages are mapped onto the chat template's OpenAI-style roles: `system` -> a system message,
`tool_use` blocks -> assistant `tool_calls`, `tool_result` blocks -> `tool` messages, `thinking`
blocks -> `reasoning_content`. The output goes through the same parsers as the OpenAI route and
comes back as thinking / text / tool_use blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from freetoken.server.errors import APIError, error_body
from freetoken.server.openai_chat import check_error, drain
from freetoken.server.protocol_anthropic import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from freetoken.server.serving import (
    OutputParser,
    ServerState,
    check_tools_count,
    forced_tool_prefix,
    make_params,
    new_id,
    parse_body,
    render_chat,
    resolve_max_tokens,
    sub_requests,
)

router = APIRouter()
_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def to_template(req: CountTokensRequest | MessagesRequest) -> list[dict]:
    out = [{"role": "system", "content": req.system_text()}] if req.system else []
    for m in req.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        msg: dict = {"role": m.role, "content": ""}
        for b in m.content:
            if isinstance(b, TextBlock):
                msg["content"] += b.text
            elif isinstance(b, ToolUseBlock):
                msg.setdefault("tool_calls", []).append(
                    {"type": "function", "id": b.id,
                     "function": {"name": b.name, "arguments": b.input}})
            elif isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            elif isinstance(b, ThinkingBlock):
                msg["reasoning_content"] = b.thinking
        if msg["content"] or "tool_calls" in msg or "reasoning_content" in msg:
            out.append(msg)
    return out


def template_tools(req) -> list[dict] | None:
    if not req.tools or (req.tool_choice and req.tool_choice.type == "none"):
        return None
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
        for t in req.tools]


async def _render(state: ServerState, req) -> tuple[str, list[int]]:
    check_tools_count(state.limits, req.tools)  # before rendering them: that is the cost
    kwargs = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    return await render_chat(state, to_template(req), template_tools(req), **kwargs)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state: ServerState = request.app.state.server
    req = parse_body(await request.body(), CountTokensRequest)
    state.check_model(req.model)
    state.require_ready()
    _, ids = await _render(state, req)
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(request: Request):
    state: ServerState = request.app.state.server
    req = parse_body(await request.body(), MessagesRequest)
    state.check_model(req.model)
    state.require_ready()
    text, ids = await _render(state, req)
    prefix = ""
    if req.tool_choice is not None and req.tool_choice.type in ("any", "tool"):
        prefix = forced_tool_prefix(state, req.tool_choice.name)
        ids = ids + state.tokenizer.encode(prefix, add_special_tokens=False)
    params = make_params(
        state.limits, stop_param="stop_sequences",
        max_tokens=resolve_max_tokens(state, len(ids), req.max_tokens),
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
    )
    rid = new_id("msg_")
    stream = await state.engine.submit(sub_requests(rid, ids, params))
    run = MessageRun(state, req, rid, len(ids), text + prefix, prefix)
    if req.stream:
        return StreamingResponse(
            _sse(request.url.path, run.events(stream), stream.close),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
        )
    try:
        await drain(stream, request, run.apply)
        return JSONResponse(run.message(run.blocks, final=True))
    finally:
        stream.close()


async def _sse(path: str, events: AsyncIterator[tuple[str, dict]], close) -> AsyncIterator[str]:
    try:
        async for name, data in events:
            yield f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
    except APIError as e:
        yield f"event: error\ndata: {json.dumps(error_body(path, e))}\n\n"
    finally:
        close()  # client gone or done: abort whatever still runs


class MessageRun:
    """Engine outputs -> content blocks (thinking, text, tool_use), with streaming events."""

    def __init__(self, state, req: MessagesRequest, rid: str, n_prompt: int, prompt: str,
                 prefix: str):
        self.state, self.req, self.rid, self.n_prompt = state, req, rid, n_prompt
        thinking = req.thinking is None or req.thinking.type != "disabled"
        self.parser = OutputParser(state, reasoning=thinking, tools=template_tools(req) is not None,
                                   prompt_text=prompt, tool_prefix=prefix)
        self.blocks: list[dict] = []
        self.tokens = 0
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def apply(self, out) -> list[tuple[str, dict]]:
        """Fold one output in; return the stream events it causes."""
        check_error(out)
        self.tokens = len(out.output_token_ids)
        d = self.parser.feed(out.new_text)
        if out.finished:
            rest = self.parser.finish()
            d.reasoning, d.content = d.reasoning + rest.reasoning, d.content + rest.content
            d.tool_calls += rest.tool_calls
        events = self._add("thinking", d.reasoning) + self._add("text", d.content)
        for call in d.tool_calls:
            events += self._tool_use(call)
        if out.finished:
            self._finish(out)
        return events

    def _finish(self, out) -> None:
        if any(b["type"] == "tool_use" for b in self.blocks):
            self.stop_reason = "tool_use"
        elif out.stop_reason in (self.req.stop_sequences or []):
            self.stop_reason, self.stop_sequence = "stop_sequence", out.stop_reason
        else:
            self.stop_reason = _STOP.get(out.finish_reason, "end_turn")

    def _add(self, kind: str, text: str) -> list[tuple[str, dict]]:
        if not text:
            return []
        events = []
        if not self.blocks or self.blocks[-1]["type"] != kind:
            events += self._close_last()
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            self.blocks.append(block)
            events.append(("content_block_start", {
                "type": "content_block_start", "index": len(self.blocks) - 1,
                "content_block": dict(block)}))
        self.blocks[-1][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        events.append(("content_block_delta", {
            "type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}))
        return events

    def _tool_use(self, call) -> list[tuple[str, dict]]:
        events = self._close_last()
        block = {"type": "tool_use", "id": new_id("toolu_"), "name": call.name,
                 "input": call.input()}
        self.blocks.append(block)
        i = len(self.blocks) - 1
        events.append(("content_block_start", {"type": "content_block_start", "index": i,
                       "content_block": {**block, "input": {}}}))
        events.append(("content_block_delta", {"type": "content_block_delta", "index": i,
                       "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
        return events

    def _close_last(self) -> list[tuple[str, dict]]:
        if not self.blocks or self.blocks[-1].get("_closed"):
            return []
        self.blocks[-1]["_closed"] = True
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": len(self.blocks) - 1})]

    def message(self, blocks: list[dict], final: bool) -> dict:
        clean = [{k: v for k, v in b.items() if k != "_closed"} for b in blocks]
        if final and not clean:
            clean = [{"type": "text", "text": ""}]
        return {"id": self.rid, "type": "message", "role": "assistant",
                "model": self.state.served_model_name, "content": clean,
                "stop_reason": self.stop_reason if final else None,
                "stop_sequence": self.stop_sequence if final else None,
                "usage": {"input_tokens": self.n_prompt, "output_tokens": self.tokens}}

    async def events(self, stream) -> AsyncIterator[tuple[str, dict]]:
        yield "message_start", {"type": "message_start", "message": self.message([], False)}
        yield "ping", {"type": "ping"}
        async for out in stream:
            for ev in self.apply(out):
                yield ev
        for ev in self._close_last():
            yield ev
        yield "message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
            "usage": {"output_tokens": self.tokens}}
        yield "message_stop", {"type": "message_stop"}


__all__ = ["APIError", "router"]
