"""Tokenizers from HF directories or GGUF metadata, chat templates, incremental detokenizer."""

from freetoken.tokenizer.detokenizer import IncrementalDetokenizer
from freetoken.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
