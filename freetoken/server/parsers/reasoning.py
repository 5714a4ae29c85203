"""Reasoning parsers: split a model's output into `reasoning_content` and `content`.

`ThinkParser` handles `<think>...</think>` (Qwen3, DeepSeek-R1, QwQ and their templates).
Streaming-safe: `feed()` holds back any suffix that could be the start of a tag, so no partial
`<thi` ever reaches `content`; `finish()` flushes what is left. Templates that open the think
block inside the generation prompt (the model's output starts in the middle of reasoning) are
handled with `starts_in_reasoning=True`, which the server sets when the prompt ends in `<think>`.
"""

from __future__ import annotations


def safe_prefix_len(buf: str, tag: str) -> int:
    """Length of the longest prefix of `buf` that cannot be extended into containing `tag`.

    Everything after it is a suffix of `buf` that is a proper prefix of `tag` and must wait.
    """
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-k:]):
            return len(buf) - k
    return len(buf)


class ThinkParser:
    """Stateful splitter of streamed text into (reasoning, content) deltas."""

    def __init__(
        self, start: str = "<think>", end: str = "</think>", starts_in_reasoning: bool = False
    ) -> None:
        self.start, self.end = start, end
        self.in_reasoning = starts_in_reasoning
        self.buf = ""
        self._strip = starts_in_reasoning  # drop the newline(s) right after a tag

    def feed(self, text: str) -> tuple[str, str]:
        """Add a delta; return (reasoning_delta, content_delta) that are safe to send now."""
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            tag = self.end if self.in_reasoning else self.start
            out = reasoning if self.in_reasoning else content
            i = self.buf.find(tag)
            if i >= 0:
                self._emit(out, self.buf[:i])
                self.buf = self.buf[i + len(tag) :]
                self.in_reasoning = not self.in_reasoning
                self._strip = True
                continue
            n = safe_prefix_len(self.buf, tag)
            self._emit(out, self.buf[:n])
            self.buf = self.buf[n:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: whatever is buffered was not a tag after all."""
        rest, self.buf = self.buf, ""
        out: list[str] = []
        self._emit(out, rest)
        return ("".join(out), "") if self.in_reasoning else ("", "".join(out))

    def _emit(self, out: list[str], text: str) -> None:
        if self._strip:
            stripped = text.lstrip("\n")
            if not stripped:
                return  # still only newlines: keep stripping at the next piece
            text, self._strip = stripped, False
        out.append(text)


REASONING_PARSERS = {"think": ThinkParser, "qwen3": ThinkParser, "deepseek_r1": ThinkParser}
