"""Golden token ids from llama.cpp's tokenizer (llama-cpp-python) for the three real GGUFs.

Writes tests/data/tokenizer_llamacpp.json: {model name: [[text, ids], ...]}. CI has no
llama-cpp-python; tests/tokenizer reads this file. Run: python scripts/make_goldens_tokenizer.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from freetoken import assets

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizer_llamacpp.json"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand   runs    of     spaces",
    "naïve café, Zürich, São Paulo, Ærøskøbing",
    "日本語のテキストと中文文本，还有한국어.",
    "emoji: 🤗 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨",
    "Numbers 1234567890 3.14159 -42 1e-5 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    "don't won't I'm you're they'll",
    "Ελληνικά και русский текст",
    "<|im_start|>user\nhi<|im_end|>",
    "a" * 50,
    "!!!???...,,,;;;",
    "https://example.com/path?q=1&r=2",
    "mixed\u00a0no-break\u2009thin\u200bzero-width",
]


def main() -> int:
    from llama_cpp import Llama

    models = {
        assets.SMOLLM2: assets.smollm2_path(),
        assets.GEMMA3_270M: assets.gemma3_270m_path(),
        assets.QWEN25_CODER: assets.qwen25_coder_path(),
    }
    golden = {}
    for name, path in models.items():
        llm = Llama(str(path), vocab_only=True, verbose=False)
        # add_bos=True adds BOS only where the model's metadata asks for it; special=True
        # parses special-token text as those tokens, as transformers' encode does.
        golden[name] = [[t, llm.tokenize(t.encode(), add_bos=True, special=True)] for t in TEXTS]
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
