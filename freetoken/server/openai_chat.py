"""The body of the OpenAI chat route: prompt preparation and response assembly, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from freetoken.engine.outputs import RequestOutput
from freetoken.engine.sampling_params import SamplingParams
from freetoken.server.async_engine import RequestStream
from freetoken.server.errors import APIError, bad_request
from freetoken.server.protocol_openai import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
)
from freetoken.server.serving import (
    OutputParser,
    ServerState,
    check_tools_count,
    choice_index,
    forced_tool_prefix,
    make_params,
    new_id,
    parse_arguments,
    render_chat,
    resolve_max_tokens,
)


def common_sampling(req) -> dict:
    return dict(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens, n=req.n,
    )


def template_message(i: int, m: ChatMessage) -> dict:
    """An OpenAI message as HF chat templates expect it (tool arguments as objects)."""
    role = "system" if m.role == "developer" else m.role
    out: dict = {"role": role, "content": m.text() or ""}
    if m.role in ("user", "system", "developer") and m.content is None:
        raise bad_request(f"messages[{i}].content is required for role {m.role!r}",
                          param=f"messages.{i}.content")
    if m.tool_calls:
        out["tool_calls"] = [
            {"type": "function", "id": c.id, "function": {
                "name": c.function.name,
                "arguments": parse_arguments(
                    c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments"),
            }}
            for j, c in enumerate(m.tool_calls)
        ]
    if m.role == "tool":
        if m.tool_call_id is None:
            raise bad_request(f"messages[{i}] has role 'tool' but no tool_call_id",
                              param=f"messages.{i}.tool_call_id")
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


@dataclass
class ChatPrep:
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    tool_prefix: str = ""


async def prepare(state: ServerState, req: ChatCompletionRequest) -> ChatPrep:
    check_tools_count(state.limits, req.tools)
    messages = [template_message(i, m) for i, m in enumerate(req.messages)]
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools else None
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    text, ids = await render_chat(
        state, messages, tools, add_generation_prompt=req.add_generation_prompt, **kwargs
    )
    prefix = ""
    if req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice):
        named = isinstance(req.tool_choice, NamedToolChoice)
        name = req.tool_choice.function.name if named else None
        prefix = forced_tool_prefix(state, name)
        ids = ids + state.tokenizer.encode(prefix, add_special_tokens=False)
    params = make_params(
        state.limits,
        max_tokens=resolve_max_tokens(state, len(ids), req.completion_limit()),
        **common_sampling(req),
        logprobs=req.num_logprobs(),
        logprobs_param="top_logprobs",
    )
    return ChatPrep(text + prefix, ids, params, prefix)


class TokenText:
    """Token id -> its text (as a logprobs entry shows it), memoised."""

    def __init__(self, tokenizer) -> None:
        self.tok, self.cache = tokenizer, {}

    def __call__(self, tid: int) -> str:
        if tid not in self.cache:
            self.cache[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return self.cache[tid]


def chat_logprobs(out: RequestOutput, text: TokenText) -> list[dict]:
    def entry(tid: int, lp: float) -> dict:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return [
        {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
        for e in out.logprobs or []
    ]


def completion_logprobs(out: RequestOutput, text: TokenText, offset: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    for e in out.logprobs or []:
        s = text(e.token_id)
        tokens.append(s)
        lps.append(e.logprob)
        tops.append({text(t): lp for t, lp in e.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def drain(stream: RequestStream, request: Request, on_output) -> None:
    """Feed every output to on_output; abort (and raise) if the client hangs up meanwhile."""

    async def consume() -> None:
        async for out in stream:
            on_output(out)

    task = asyncio.ensure_future(consume())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            stream.close()
            raise APIError(499, "client closed the request")


def check_error(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise APIError(500, f"generation failed: {out.error or 'engine error'}")


@dataclass
class Choice:
    parser: OutputParser
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None


class ChatRun:
    """One chat completion: engine outputs in, OpenAI chunks or one response out."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest, prep: ChatPrep, rid: str):
        self.state, self.req, self.prep, self.rid = state, req, prep, rid
        self.created = int(time.time())
        self.text = TokenText(state.tokenizer)
        self.cached = 0
        use_tools = bool(req.tools) and req.tool_choice != "none"
        self.choices = [
            Choice(OutputParser(
                state, reasoning=req.include_reasoning, tools=use_tools,
                prompt_text=prep.prompt_text, tool_prefix=prep.tool_prefix,
            ))
            for _ in range(req.n)
        ]

    def _apply(self, out: RequestOutput) -> tuple[int, dict]:
        """Fold one output into its choice; return (index, the delta to stream)."""
        check_error(out)
        i = choice_index(out.request_id)
        ch = self.choices[i]
        self.cached = max(self.cached, out.num_cached_tokens)
        ch.tokens = len(out.output_token_ids)
        first = ch.parser.feed(out.new_text)
        if out.finished:  # flush what the parsers held back (a tag that never completed)
            rest = ch.parser.finish()
            first.reasoning += rest.reasoning
            first.content += rest.content
            first.tool_calls += rest.tool_calls
        delta: dict = {}
        if first.reasoning:
            ch.reasoning.append(first.reasoning)
            delta["reasoning_content"] = first.reasoning
        if first.content:
            ch.content.append(first.content)
            delta["content"] = first.content
        calls = [self._tool_call(ch, c) for c in first.tool_calls]
        if calls:
            delta["tool_calls"] = calls
        if self.req.logprobs and out.logprobs:
            ch.logprobs += chat_logprobs(out, self.text)
        if out.finished:
            ch.finish_reason = "tool_calls" if ch.tool_calls else out.finish_reason
        return i, delta

    def _tool_call(self, ch: Choice, call) -> dict:
        d = {"index": len(ch.tool_calls), "id": new_id("call_"), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
        ch.tool_calls.append(d)
        return d

    def usage(self) -> dict:
        done = sum(c.tokens for c in self.choices)
        n = len(self.prep.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        c = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
             "model": self.state.served_model_name, "choices": choices}
        if self.req.stream_options and self.req.stream_options.include_usage:
            c["usage"] = usage
        return c

    async def stream_events(self, stream: RequestStream) -> AsyncIterator[dict]:
        for i in range(len(self.choices)):
            d = {"index": i, "delta": {"role": "assistant", "content": ""},
                 "logprobs": None, "finish_reason": None}
            yield self._chunk([d])
        async for out in stream:
            n_lp = len(self.choices[choice_index(out.request_id)].logprobs)
            i, delta = self._apply(out)
            ch = self.choices[i]
            lps = {"content": ch.logprobs[n_lp:]} if self.req.logprobs else None
            if delta or out.finished or (lps and lps["content"]):
                yield self._chunk([{"index": i, "delta": delta, "logprobs": lps,
                                    "finish_reason": ch.finish_reason}])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._chunk([], self.usage())

    async def collect(self, stream: RequestStream, request: Request) -> dict:
        await drain(stream, request, self._apply)
        choices = []
        for i, ch in enumerate(self.choices):
            msg: dict = {"role": "assistant", "content": "".join(ch.content) or None}
            if ch.reasoning:
                msg["reasoning_content"] = "".join(ch.reasoning)
            if ch.tool_calls:
                msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"}
                                     for c in ch.tool_calls]
            elif msg["content"] is None:
                msg["content"] = ""
            lps = {"content": ch.logprobs} if self.req.logprobs else None
            choices.append({"index": i, "message": msg, "logprobs": lps,
                            "finish_reason": ch.finish_reason})
        return {"id": self.rid, "object": "chat.completion", "created": self.created,
                "model": self.state.served_model_name, "choices": choices,
                "usage": self.usage()}
