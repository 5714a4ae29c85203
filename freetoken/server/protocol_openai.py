"""OpenAI request bodies as strict pydantic models (`/v1/chat/completions`, `/v1/completions`).

Strict: a wrong type is a 400 naming the field, never a silent coercion; an unknown top-level
field is refused rather than dropped (nothing a user sent is lost silently). Fields that clients
send routinely and that change nothing here (`user`, `metadata`, `store`, ...) are accepted.
Responses are built as plain dicts in `openai_routes.py`, field for field as OpenAI writes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(strict=True, extra="forbid")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]  # json_object / json_schema need guided decoding: refused, not faked


class _SamplingFields(BaseModel):
    """What /v1/chat/completions and /v1/completions share."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, SGLang)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _check(self) -> _SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, e.g. enable_thinking
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice is set but no tools were given")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, "
                    f"which is not among the tools ({', '.join(sorted(names))})"
                )
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        return self

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else (
            self.max_tokens
        )

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be an empty list")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # one prompt of token ids
        return list(p)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]
