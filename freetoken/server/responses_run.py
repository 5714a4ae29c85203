"""One `/v1/responses` generation: engine outputs in, output items and streaming events out.

Streaming and non-streaming share one path: every engine output is folded into the output items
(`reasoning`, `message`, `function_call`) and yields the events OpenAI documents, in its order:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta...,
                 response.output_text.done, response.content_part.done
      function:  response.function_call_arguments.delta, response.function_call_arguments.done
    response.output_item.done,
    then response.completed (or response.incomplete when max_output_tokens cut it short,
    response.failed on an engine error).

The non-streaming route drops the events and returns `response()`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from freetoken.engine.outputs import RequestOutput
from freetoken.server.openai_chat import TokenText, chat_logprobs, check_error
from freetoken.server.protocol_responses import ResponseCreateRequest
from freetoken.server.serving import OutputParser, ServerState, new_id


@dataclass
class _Open:
    """The output item being streamed: its index in `output`, kind and text so far."""

    index: int
    kind: str  # "reasoning" or "message"
    id: str
    text: str = ""


class ResponseRun:
    def __init__(self, state: ServerState, req: ResponseCreateRequest, rid: str, *,
                 prompt_text: str, prompt_len: int, tool_prefix: str, use_tools: bool) -> None:
        self.state, self.req, self.rid = state, req, rid
        self.created = int(time.time())
        self.prompt_len = prompt_len
        self.parser = OutputParser(state, reasoning=True, tools=use_tools,
                                   prompt_text=prompt_text, tool_prefix=tool_prefix)
        self.text = TokenText(state.tokenizer)
        self.output: list[dict] = []
        self.open: _Open | None = None
        self.pending_ws = ""  # whitespace-only content held back (often all before a tool call)
        self.logprobs: list[dict] = []
        self.seq = 0
        self.status = "in_progress"
        self.incomplete: dict | None = None
        self.error: dict | None = None
        self.tokens = self.cached = 0

    # -- events ---------------------------------------------------------------------------
    def _ev(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start_events(self) -> list[dict]:
        return [self._ev("response.created", response=self.response()),
                self._ev("response.in_progress", response=self.response())]

    def apply(self, out: RequestOutput) -> list[dict]:
        """Fold one engine output in; return the events it makes."""
        if self.status != "in_progress":
            return []  # cancelled: outputs already queued are dropped
        check_error(out)
        self.tokens = len(out.output_token_ids)
        self.cached = max(self.cached, out.num_cached_tokens)
        lps = chat_logprobs(out, self.text) if self.req.top_logprobs is not None else []
        d = self.parser.feed(out.new_text)
        if out.finished:
            rest = self.parser.finish()
            d.reasoning += rest.reasoning
            d.content += rest.content
            d.tool_calls += rest.tool_calls
        events = self._text("reasoning", d.reasoning, []) + self._content(d.content, lps)
        for call in d.tool_calls:
            events += self._close() + self._function_call(call.name, call.arguments)
        if out.finished:
            events += self._close() + self._finish(out.finish_reason)
        return events

    def _content(self, text: str, lps: list[dict]) -> list[dict]:
        text, self.pending_ws = self.pending_ws + text, ""
        if text and not text.strip() and (self.open is None or self.open.kind != "message"):
            self.pending_ws = text  # nothing to show yet: maybe only space before a tool call
            return []
        return self._text("message", text, lps)

    def _text(self, kind: str, text: str, lps: list[dict]) -> list[dict]:
        if not text:
            return []
        events = [] if self.open and self.open.kind == kind else self._close() + self._add(kind)
        self.open.text += text
        if kind == "reasoning":
            return events + [self._ev("response.reasoning_text.delta", **self._where(),
                                      delta=text)]
        self.logprobs += lps
        return events + [self._ev("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=lps)]

    def _where(self) -> dict:
        return {"item_id": self.open.id, "output_index": self.open.index, "content_index": 0}

    def _add(self, kind: str) -> list[dict]:
        prefix = "rs_" if kind == "reasoning" else "msg_"
        self.open = _Open(len(self.output), kind, new_id(prefix))
        item = self._item(self.open, "in_progress", with_text=False)
        self.output.append(item)
        part = self._part(kind, "")
        return [self._ev("response.output_item.added", output_index=self.open.index, item=item),
                self._ev("response.content_part.added", **self._where(), part=part)]

    def _part(self, kind: str, text: str) -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        lps = self.logprobs if self.req.top_logprobs is not None else []
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}

    def _item(self, o: _Open, status: str, with_text: bool = True) -> dict:
        parts = [self._part(o.kind, o.text)] if with_text else []
        if o.kind == "reasoning":
            return {"type": "reasoning", "id": o.id, "summary": [], "content": parts,
                    "status": status}
        return {"type": "message", "id": o.id, "role": "assistant", "status": status,
                "content": parts}

    def _close(self, status: str = "completed") -> list[dict]:
        o = self.open
        if o is None:
            return []
        self.open = None
        where = {"item_id": o.id, "output_index": o.index, "content_index": 0}
        done = "response.reasoning_text.done" if o.kind == "reasoning" else (
            "response.output_text.done")
        extra = {} if o.kind == "reasoning" else {"logprobs": self._part(o.kind, "")["logprobs"]}
        item = self.output[o.index] = self._item(o, status)
        return [self._ev(done, **where, text=o.text, **extra),
                self._ev("response.content_part.done", **where, part=self._part(o.kind, o.text)),
                self._ev("response.output_item.done", output_index=o.index, item=item)]

    def _function_call(self, name: str, arguments: str) -> list[dict]:
        index, fid = len(self.output), new_id("fc_")
        item = {"type": "function_call", "id": fid, "call_id": new_id("call_"), "name": name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        where = {"item_id": fid, "output_index": index}
        done = self.output[index] = {**item, "arguments": arguments, "status": "completed"}
        return [self._ev("response.output_item.added", output_index=index, item=item),
                self._ev("response.function_call_arguments.delta", **where, delta=arguments),
                self._ev("response.function_call_arguments.done", **where, name=name,
                         arguments=arguments),
                self._ev("response.output_item.done", output_index=index, item=done)]

    def _finish(self, reason: str | None) -> list[dict]:
        if reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
            return [self._ev("response.incomplete", response=self.response())]
        self.status = "completed"
        return [self._ev("response.completed", response=self.response())]

    def fail(self, message: str, code: str = "server_error") -> list[dict]:
        events = self._close("incomplete")
        self.status, self.error = "failed", {"code": code, "message": message}
        return events + [self._ev("response.failed", response=self.response())]

    def cancel(self) -> None:
        self._close("incomplete")
        self.status = "cancelled"

    # -- the Response object ----------------------------------------------------------------
    def usage(self) -> dict:
        reasoning = "".join(o["content"][0]["text"] for o in self.output
                            if o["type"] == "reasoning" and o["content"])
        n_reason = len(self.state.tokenizer.encode(reasoning, False)) if reasoning else 0
        return {"input_tokens": self.prompt_len,
                "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.tokens,
                "output_tokens_details": {"reasoning_tokens": min(n_reason, self.tokens)},
                "total_tokens": self.prompt_len + self.tokens}

    def response(self) -> dict:
        r = self.req
        done = self.status not in ("in_progress", "queued")
        return {
            "id": self.rid, "object": "response", "created_at": self.created,
            "status": self.status, "background": r.background, "error": self.error,
            "incomplete_details": self.incomplete, "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens, "model": self.state.served_model_name,
            "output": list(self.output),
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": (r.tool_choice.model_dump() if hasattr(r.tool_choice, "model_dump")
                            else r.tool_choice or "auto"),
            "tools": list(r.tools or []), "top_p": 1.0 if r.top_p is None else r.top_p,
            "top_logprobs": r.top_logprobs or 0, "truncation": r.truncation or "disabled",
            "usage": self.usage() if done else None, "user": r.user,
            "metadata": r.metadata or {},
        }

    def assistant_message(self) -> dict:
        """This response's output as one chat-template assistant turn (for the next turn)."""
        msg: dict = {"role": "assistant", "content": ""}
        for item in self.output:
            if item["type"] == "reasoning" and item["content"]:
                msg["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message" and item["content"]:
                msg["content"] += item["content"][0]["text"]
            elif item["type"] == "function_call":
                call = {"type": "function", "id": item["call_id"],
                        "function": {"name": item["name"], "arguments": _args(item)}}
                msg.setdefault("tool_calls", []).append(call)
        return msg


def _args(item: dict) -> dict | str:
    """Templates render arguments as an object; text that is not JSON stays as it was."""
    try:
        return json.loads(item["arguments"])
    except json.JSONDecodeError:
        return item["arguments"]
