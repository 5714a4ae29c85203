"""Incremental detokenization and stop strings, for streaming.

Decoding token by token breaks multi-byte characters (a byte-level BPE emoji spans several
tokens) and word-boundary spacing (SentencePiece). The usual fix, as in HF's TextStreamer and
vLLM: decode a short window of recent tokens twice, with and without the newest ones, and emit
the difference once it no longer ends in U+FFFD (an incomplete UTF-8 sequence).

Stop strings are searched in the full text; the tail that could still grow into a stop string
is held back, so a streaming client never sees part of one.
"""

from __future__ import annotations

from freetoken.tokenizer.tokenizer import Tokenizer

_WINDOW = 6  # prompt tokens of left context for the first output token


class IncrementalDetokenizer:
    """Feeds token ids in, gives text out; never emits half a UTF-8 character."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        # Start with a few prompt tokens as context so the first output token's leading space
        # decodes as it would mid-text.
        self.ids = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append a token; return the newly completed text (may be empty)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end: whatever is left, an incomplete character included (as decode gives)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""  # nothing yet, or a character still incomplete
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += new
        return new


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string that ends at or after `start` (position, string), or None."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters might be the start of a stop string (withhold them)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n
