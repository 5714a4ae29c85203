"""What the OpenAI and Anthropic routes share: the served model, prompts, limits, parsing.

`ServerState` holds the async engine and the server's choices (served name, parsers).
`OutputParser` runs one choice's text through the reasoning parser, then the tool-call parser,
so both protocols stream the same split of reasoning / content / tool calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from dataclasses import dataclass, field

from pydantic import BaseModel, ValidationError

from freetoken.engine.sampling_params import SamplingParams
from freetoken.server.async_engine import AsyncEngine, SubRequest
from freetoken.server.errors import (
    APIError,
    bad_request,
    context_overflow,
    first_param,
    format_validation_error,
)
from freetoken.server.parsers import REASONING_PARSERS, TOOL_PARSERS, ParsedToolCall
from freetoken.server.responses_store import ResponseStore


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, so that no single request can take the whole server.

    Each is checked before anything reaches the engine; going over is a 400 that names the field
    and the limit (ServerConfig carries the values, `ft serve --max-n` etc. set them).
    """

    max_n: int = 8  # choices per request (OpenAI allows 128; each is a full generation)
    max_logprobs: int = 20  # top_logprobs / logprobs alternatives per token (OpenAI's limit)
    max_stop: int = 16  # stop strings per request (each is searched in every new token's text)
    max_stop_chars: int = 256  # characters in one stop string
    max_stop_token_ids: int = 64
    max_tools: int = 128  # tool definitions (each renders into the prompt; OpenAI's limit)


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    created: int = 0
    limits: RequestLimits = field(default_factory=RequestLimits)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses kept

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.engine.max_model_len)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves "
                f"{self.served_model_name!r} (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def require_ready(self) -> None:
        if not self.engine.ready:
            raise APIError(503, self.engine.load_error or "the model is still loading")


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """Validate a JSON body strictly; every problem becomes a 400 that names the field."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise bad_request(format_validation_error(e), param=first_param(e)) from None


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


async def render_chat(
    state: ServerState, messages: list[dict], tools: list[dict] | None, **kwargs
) -> tuple[str, list[int]]:
    """Chat template -> (prompt text, token ids), off the event loop (Jinja + tokenizer)."""
    tok = state.tokenizer

    def work() -> tuple[str, list[int]]:
        text = tok.apply_chat_template(messages, tools=tools, **kwargs)
        return text, tok.encode(text, add_special_tokens=False)

    try:
        return await asyncio.to_thread(work)
    except ValueError as e:
        raise bad_request(str(e), param="messages") from None
    except Exception as e:  # noqa: BLE001 - template errors (raise_exception, bad roles)
        raise bad_request(f"the chat template refused these messages: {e}", "messages") from None


async def encode_text(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens)


def resolve_max_tokens(state: ServerState, prompt_len: int, max_tokens: int | None) -> int:
    """max_tokens checked against the context; None = all that is left of it."""
    limit = state.max_model_len
    if prompt_len == 0:
        raise bad_request("the prompt is empty", param="prompt")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if prompt_len >= limit:
        raise context_overflow(limit, prompt_len, max_tokens or 0)
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise context_overflow(limit, prompt_len, max_tokens)
    return max_tokens


def check_bound(param: str, value: int, limit: int, what: str = "") -> None:
    """A 400 naming the field and the limit when `value` (a count or a size) exceeds it."""
    if value > limit:
        raise bad_request(
            f"{param} is {value}{what}, over this server's limit of {limit}", param=param
        )


def check_tools_count(limits: RequestLimits, tools: list | None, param: str = "tools") -> None:
    check_bound(param, len(tools or ()), limits.max_tools, " tools")


def make_params(
    limits: RequestLimits, *, stop_param: str = "stop", logprobs_param: str = "logprobs", **kw
) -> SamplingParams:
    """SamplingParams from request fields (None = the default); its checks become 400s.

    The server's RequestLimits are checked first: `n`, `logprobs`, `stop`, `stop_token_ids`.
    """
    kw = {k: v for k, v in kw.items() if v is not None}
    stops = kw.get("stop")
    if isinstance(stops, str):
        stops = kw["stop"] = [stops]
    if stops and any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", param=stop_param)
    _check_limits(limits, kw, stop_param, logprobs_param)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad_request(str(e), param=str(e).split(" ")[0]) from None


def _check_limits(limits: RequestLimits, kw: dict, stop_param: str, lp_param: str) -> None:
    check_bound("n", kw.get("n", 1), limits.max_n)
    if kw.get("logprobs") is not None:
        check_bound(lp_param, kw["logprobs"], limits.max_logprobs, " alternatives")
    stops = kw.get("stop") or []
    check_bound(stop_param, len(stops), limits.max_stop, " stop strings")
    longest = max((len(s) for s in stops), default=0)
    check_bound(stop_param, longest, limits.max_stop_chars, " characters in one stop string")
    check_bound("stop_token_ids", len(kw.get("stop_token_ids") or []),
                limits.max_stop_token_ids, " ids")


def sub_requests(rid: str, ids: list[int], params: SamplingParams) -> list[SubRequest]:
    """n choices = n engine requests; seeded ones get seed + i so the choices differ."""
    subs = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        p = dataclasses.replace(params, n=1, seed=seed)
        subs.append(SubRequest(f"{rid}-{i}", ids, p))
    return subs


def choice_index(engine_id: str) -> int:
    return int(engine_id.rsplit("-", 1)[1])


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class OutputParser:
    """One choice's text -> reasoning / content / tool calls, streamed safely."""

    def __init__(
        self,
        state: ServerState,
        *,
        reasoning: bool,
        tools: bool,
        prompt_text: str = "",
        tool_prefix: str = "",
    ) -> None:
        rname = state.reasoning_parser if reasoning else None
        tname = state.tool_call_parser if tools else None
        in_think = prompt_text.rstrip().endswith("<think>")
        self.reasoning = REASONING_PARSERS[rname](starts_in_reasoning=in_think) if rname else None
        self.tools = TOOL_PARSERS[tname](prefix=tool_prefix) if tname else None
        self.prefix_pending = tool_prefix if not self.tools else ""

    def feed(self, text: str) -> ParsedDelta:
        text, self.prefix_pending = self.prefix_pending + text, ""
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._tools(r, c, final=False)

    def finish(self) -> ParsedDelta:
        text, self.prefix_pending = self.prefix_pending, ""
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        if self.reasoning:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        return self._tools(r, c, final=True)

    def _tools(self, reasoning: str, content: str, final: bool) -> ParsedDelta:
        if self.tools is None:
            return ParsedDelta(reasoning, content)
        content, calls = self.tools.feed(content)
        if final:
            c2, calls2 = self.tools.finish()
            content, calls = content + c2, calls + calls2
        return ParsedDelta(reasoning, content, calls)


def forced_tool_prefix(state: ServerState, name: str | None) -> str:
    """Text that starts the assistant turn so the model must call a tool (or this one)."""
    if state.tool_call_parser is None:
        raise bad_request(
            "tool_choice requires a tool call, but this model has no tool-call parser "
            "(start the server with --tool-call-parser)",
            param="tool_choice",
        )
    return TOOL_PARSERS[state.tool_call_parser].forced_prefix(name)


def parse_arguments(text: str, where: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"{where} is not valid JSON: {e}", param=where) from None
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be a JSON object", param=where)
    return value
