"""Tokenizers of the three real GGUFs against llama.cpp's and transformers' own tokenizers.

References: token ids from llama.cpp (tests/data/tokenizer_llamacpp.json, made by
scripts/make_goldens_tokenizer.py with llama-cpp-python) and transformers building the
tokenizer from the same GGUF without our cache. Exact equality: tokenization is discrete.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from freetoken import assets
from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer
from freetoken.tokenizer.detokenizer import find_stop, held_back
from freetoken.tokenizer.loader import gguf_metadata

GOLDEN = json.loads(
    (Path(__file__).parent.parent / "data" / "tokenizer_llamacpp.json").read_text("utf-8")
)
MODELS = [assets.SMOLLM2, assets.GEMMA3_270M, assets.QWEN25_CODER]


@pytest.fixture(scope="module", params=MODELS)
def named_tok(request):
    return request.param, Tokenizer.from_path(assets.resolve_model(request.param))


def test_encode_matches_llama_cpp(named_tok):
    name, tok = named_tok
    for text, ids in GOLDEN[name]:
        assert tok.encode(text) == ids, text


def test_incremental_detokenizer_equals_full_decode(named_tok):
    name, tok = named_tok
    prompt = tok.encode("Say something:")
    for text, _ in GOLDEN[name]:
        ids = tok.encode(text, add_special_tokens=False)
        det = IncrementalDetokenizer(tok, prompt)
        pieces = [det.add(i) for i in ids]
        tail = det.flush()
        assert "".join(pieces) + tail == tok.decode(ids), text
        assert not any("\ufffd" in p for p in pieces), text  # never half a character


def test_cached_tokenizer_equals_transformers_from_gguf():
    from transformers import AutoTokenizer

    path = assets.smollm2_path()
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = Tokenizer.from_path(path)
    for text, _ in GOLDEN[assets.SMOLLM2]:
        assert tok.encode(text) == ref.encode(text)
    assert tok.chat_template == ref.chat_template and tok.vocab_size == len(ref)


def test_families_eos_and_templates():
    smol = Tokenizer.from_path(assets.smollm2_path())
    assert smol.model_family == "llama" and smol.has_chat_template
    assert smol.encode("<|im_end|>", add_special_tokens=False)[0] in smol.eos_token_ids
    text = smol.apply_chat_template([{"role": "user", "content": "hi"}])
    # ChatML, the format SmolLM2's model card documents.
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    gemma = Tokenizer.from_path(assets.gemma3_270m_path())
    assert gemma.model_family == "gemma3" and not gemma.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tools_and_generation_prompt_in_qwen_template():
    qwen = Tokenizer.from_path(assets.qwen25_coder_path())
    tool = {"type": "function", "function": {"name": "get_weather", "description": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    text = qwen.apply_chat_template(msgs, tools=[tool])
    assert "get_weather" in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not qwen.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")


def test_template_override_with_hf_helpers(tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}"
        "{% endif %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer.from_path(assets.smollm2_path(), chat_template_file=tpl)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x4[assistant]"
    with pytest.raises(Exception, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])


def test_hf_directory_tokenizer(smollm2_tokenizer_dir):
    tok = Tokenizer.from_path(smollm2_tokenizer_dir)
    for text, ids in GOLDEN[assets.SMOLLM2]:
        assert tok.encode(text) == ids


def test_metadata_scan_matches_gguf_reader():
    from gguf import GGUFReader

    path = assets.smollm2_path()
    keys = ("general.architecture", "llama.context_length", "tokenizer.ggml.eos_token_id",
            "tokenizer.chat_template", "llama.rope.freq_base")
    ours = gguf_metadata(path, keys)
    reader = GGUFReader(str(path))
    assert ours == {k: reader.get_field(k).contents() for k in keys}


def test_stop_string_helpers():
    assert find_stop("hello world", ["wor", "lo"], 0) == (3, "lo")
    assert find_stop("hello world", ["xyz"], 0) is None
    assert find_stop("abcabc", ["abc"], 4) == (3, "abc")  # only matches ending at/after start
    assert held_back("the end is ne", ["near", "xx"]) == 2
    assert held_back("nothing", ["stop"]) == 0


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
