"""The body of the OpenAI completions route: raw text out, no parsers, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from freetoken.engine.outputs import RequestOutput
from freetoken.server.async_engine import RequestStream
from freetoken.server.openai_chat import TokenText, check_error, completion_logprobs, drain
from freetoken.server.protocol_openai import CompletionRequest
from freetoken.server.serving import ServerState, choice_index

_EMPTY = RequestOutput("", [], [], "", "", [])


class CompletionRun:
    """One text completion (no parsers: the raw text is the answer)."""

    def __init__(self, state: ServerState, req: CompletionRequest, ids: list[int], rid: str,
                 prompt_text: str):
        self.state, self.req, self.ids, self.rid = state, req, ids, rid
        self.prompt_text = prompt_text
        self.created = int(time.time())
        self.text = TokenText(state.tokenizer)
        self.texts = [prompt_text if req.echo else "" for _ in range(req.n)]
        self.tokens = [0] * req.n
        self.finish: list[str | None] = [None] * req.n
        self.logprobs: list[dict] = [completion_logprobs(_EMPTY, self.text, 0)
                                     for _ in range(req.n)]
        self.cached = 0

    def _apply(self, out: RequestOutput) -> tuple[int, dict | None]:
        check_error(out)
        i = choice_index(out.request_id)
        lp = None
        if self.req.logprobs is not None:
            lp = completion_logprobs(out, self.text, len(self.texts[i]))
            for k, v in lp.items():
                self.logprobs[i][k] += v
        self.texts[i] += out.new_text
        self.tokens[i] = len(out.output_token_ids)
        self.cached = max(self.cached, out.num_cached_tokens)
        self.finish[i] = out.finish_reason
        return i, lp

    def usage(self) -> dict:
        n, done = len(self.ids), sum(self.tokens)
        return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done,
                "prompt_tokens_details": {"cached_tokens": self.cached}}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        c = {"id": self.rid, "object": "text_completion", "created": self.created,
             "model": self.state.served_model_name, "choices": choices}
        if self.req.stream_options and self.req.stream_options.include_usage:
            c["usage"] = usage
        return c

    async def stream_events(self, stream: RequestStream) -> AsyncIterator[dict]:
        if self.req.echo:
            for i in range(self.req.n):
                yield self._chunk([{"index": i, "text": self.prompt_text, "logprobs": None,
                                    "finish_reason": None}])
        async for out in stream:
            i, lp = self._apply(out)
            if out.new_text or out.finished:
                yield self._chunk([{"index": i, "text": out.new_text, "logprobs": lp,
                                    "finish_reason": out.finish_reason}])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._chunk([], self.usage())

    async def collect(self, stream: RequestStream, request: Request) -> dict:
        await drain(stream, request, self._apply)
        lp = self.req.logprobs is not None
        choices = [{"index": i, "text": t, "logprobs": self.logprobs[i] if lp else None,
                    "finish_reason": self.finish[i]} for i, t in enumerate(self.texts)]
        return {"id": self.rid, "object": "text_completion", "created": self.created,
                "model": self.state.served_model_name, "choices": choices,
                "usage": self.usage()}
