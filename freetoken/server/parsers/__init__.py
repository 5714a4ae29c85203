"""Reasoning and tool-call parsers, chosen from the model family and its chat template.

`choose_parsers(family, template, reasoning=None, tool_call=None)` returns the parser names
(None = no parsing); explicit names (the `--reasoning-parser` / `--tool-call-parser` flags) win,
"none" turns a parser off.
"""

from __future__ import annotations

from freetoken.server.parsers.reasoning import REASONING_PARSERS, ThinkParser
from freetoken.server.parsers.tool_calls import TOOL_PARSERS, ParsedToolCall

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedToolCall",
    "ThinkParser",
    "choose_parsers",
]


def _auto_tool(family: str, template: str) -> str | None:
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "llama" in family):
        return "llama3_json"
    if family.startswith("gemma"):
        return "gemma"
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe") and "tools" in template:
        return "hermes"
    return None


def _auto_reasoning(family: str, template: str) -> str | None:
    if "<think>" in template or "</think>" in template:
        return "think"
    if family in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "minimax_m2", "deepseek"):
        return "think"
    return None


def _pick(name: str | None, auto: str | None, table: dict, what: str) -> str | None:
    if name is None:
        return auto
    if name == "none":
        return None
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(table)} or none")
    return name


def choose_parsers(
    family: str | None,
    template: str | None,
    reasoning: str | None = None,
    tool_call: str | None = None,
) -> tuple[str | None, str | None]:
    """(reasoning parser name, tool-call parser name) for this model."""
    family, template = (family or "").lower(), template or ""
    r = _pick(reasoning, _auto_reasoning(family, template), REASONING_PARSERS, "reasoning parser")
    t = _pick(tool_call, _auto_tool(family, template), TOOL_PARSERS, "tool-call parser")
    return r, t
