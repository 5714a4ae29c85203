"""OpenAI Responses API request bodies (`POST /v1/responses`) as pydantic models.

Field names follow `openai.types.responses` (ResponseCreateParams and the input item types).
The request itself is strict (a wrong type or an unknown field is a 400 naming it). Input items
that clients build by hand are strict too; the items a client sends back from an earlier
response's `output` (`input += response.output`) carry every field of the output types
(`status`, `annotations`, `logprobs`, ...), so those accept and ignore extra fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(strict=True, extra="forbid")
_LENIENT = ConfigDict(strict=True, extra="ignore")


class InputText(BaseModel):
    model_config = _LENIENT
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    """EasyInputMessage and ResponseOutputMessage both land here (role + text parts)."""

    model_config = _LENIENT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = _LENIENT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _LENIENT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


class ReasoningText(BaseModel):
    model_config = _LENIENT
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = _LENIENT
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        """The chat-completions shape that HF chat templates render."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class FunctionChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class Reasoning(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]  # json_schema / json_object need guided decoding: refused, not faked


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponseCreateRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[dict[str, Any]]  # items checked one by one in `items()`, naming the index
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked in `function_tools()`, naming the index
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    top_k: int | None = None  # extension (vLLM)
    seed: int | None = None  # extension
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseCreateRequest:
        if self.background and not self.store:
            raise ValueError("background responses must be stored: background needs store=true")
        if self.background and self.stream:
            raise ValueError("background with stream is not supported; poll GET /v1/responses/ID")
        if isinstance(self.input, list) and not self.input and not self.previous_response_id:
            raise ValueError("input must not be an empty list")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be at least 1, got {self.max_output_tokens}")
        return self
