"""Anthropic Messages request bodies as strict pydantic models (`/v1/messages`, `count_tokens`).

Content blocks: text, tool_use, tool_result, thinking, redacted_thinking. Images and documents
are refused with a 400 (this server serves text models) rather than dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(strict=True, extra="forbid")
_LOOSE = ConfigDict(strict=True, extra="ignore")  # blocks may carry cache_control, citations...


class TextBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = _LOOSE
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(BaseModel):
    model_config = _LOOSE
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent


class ToolChoice(BaseModel):
    model_config = _LOOSE
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = _LOOSE
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _MessagesBase(BaseModel):
    model_config = _STRICT
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> _MessagesBase:
        tc = self.tool_choice
        if tc is not None and tc.type == "tool":
            names = {t.name for t in self.tools or []}
            if tc.name not in names:
                raise ValueError(f"tool_choice names tool {tc.name!r}, which is not in tools")
        if tc is not None and tc.type == "any" and not self.tools:
            raise ValueError("tool_choice 'any' needs tools")
        return self

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n".join(b.text for b in self.system)
        return self.system


class OutputConfig(BaseModel):
    model_config = _LOOSE
    effort: str | None = None
    format: dict[str, Any] | None = None


class MessagesRequest(_MessagesBase):
    max_tokens: int
    stop_sequences: list[str] | None = None
    # Older clients send these; newer ones only through extra_body. Both are honoured.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # Accepted and without effect here (prompt caching is automatic: the radix prefix cache).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_output(self) -> MessagesRequest:
        fmt = self.output_format or (self.output_config and self.output_config.format)
        if fmt:
            raise ValueError("structured output (output_config.format / output_format) is not "
                             "supported by this server")
        return self


class CountTokensRequest(_MessagesBase):
    pass
