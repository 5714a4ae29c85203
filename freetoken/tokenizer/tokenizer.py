"""The engine's tokenizer: transformers' fast tokenizer plus what serving needs around it.

Encoding and decoding are transformers' (tokenizers library) as is; chat templates are rendered
by transformers' own `apply_chat_template` machinery (Jinja2 sandbox with `raise_exception`,
`strftime_now`, tools, `add_generation_prompt`), from the model's template or an override file.
"""

from __future__ import annotations

import os
from pathlib import Path

from freetoken.tokenizer import loader

# End-of-turn tokens that chat models emit instead of (or besides) their declared EOS.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "<|end|>")


class Tokenizer:
    """Text <-> token ids for one model, with its chat template and end-of-sequence ids."""

    def __init__(
        self,
        hf_tokenizer,
        *,
        model_family: str = "unknown",
        extra_eos_ids: list[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.hf = hf_tokenizer
        self.model_family = model_family
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None)
        self.vocab_size = len(hf_tokenizer)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.eos_token_ids = self._collect_eos(extra_eos_ids or [])
        self.all_special_ids = set(hf_tokenizer.all_special_ids)

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike,
        *,
        tokenizer_dir: str | os.PathLike | None = None,
        chat_template_file: str | os.PathLike | None = None,
    ) -> Tokenizer:
        """From a GGUF file or an HF directory; `tokenizer_dir` overrides the tokenizer itself."""
        hf = loader.load_hf_tokenizer(tokenizer_dir or path)
        template = None
        if chat_template_file is not None:
            template = Path(chat_template_file).read_text(encoding="utf-8")
        return cls(
            hf,
            model_family=loader.model_family(path),
            extra_eos_ids=loader.generation_eos_ids(path),
            chat_template=template,
        )

    def _collect_eos(self, extra: list[int]) -> list[int]:
        ids = [] if self.hf.eos_token_id is None else [self.hf.eos_token_id]
        ids += extra
        vocab = self.hf.get_vocab()
        ids += [vocab[t] for t in _END_OF_TURN if t in vocab]
        return sorted({i for i in ids if 0 <= i < self.vocab_size})

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS where the tokenizer does so."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(ids)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        """The prompt text for a conversation (encode it with add_special_tokens=False)."""
        if not self.has_chat_template:
            raise ValueError(
                f"this {self.model_family} model has no chat template; pass --chat-template "
                "FILE or use plain completion (--no-chat)"
            )
        return self.hf.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=self.chat_template,
            **template_kwargs,
        )

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        """apply_chat_template, then encode without adding special tokens a second time."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)
