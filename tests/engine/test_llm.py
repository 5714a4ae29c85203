"""The offline LLM API on the packaged SmolLM2 (quantized, as users run it), and bad models.

The quantized path dequantizes per call (seconds per step on 2 cores), so these runs are short;
their tokens are checked against the engine on the dequantized weights (helpers), which is the
same computation: dequantize, then float matmul.
"""

from __future__ import annotations

import sys

import engine_helpers as helpers
import gguf
import pytest

from freetoken import LLM, SamplingParams, assets
from freetoken.formats.errors import FormatError

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(show_progress=False)


def test_generate_text_and_ids(llm):
    prompts = ["The capital of France is", llm.tokenizer.encode("1, 2, 3,")]
    res = llm.generate(prompts, GREEDY)
    ref = helpers.run(helpers.engine(), {"a": llm.tokenizer.encode(prompts[0]), "b": prompts[1]},
                      GREEDY)
    assert [r.token_ids for r in res] == [ref["a"].output_token_ids, ref["b"].output_token_ids]
    assert res[0].text == llm.tokenizer.decode(res[0].token_ids)
    assert all(r.finish_reason == "length" for r in res)


def test_chat_applies_the_template(llm):
    msgs = [{"role": "user", "content": "Say hi."}]
    res = llm.chat(msgs, SamplingParams(max_tokens=3, temperature=0))
    assert res[0].prompt.endswith("<|im_start|>assistant\n")
    assert res[0].prompt_token_ids == llm.tokenizer.encode_chat(msgs)
    assert len(res[0].token_ids) <= 3 and res[0].finish_reason in ("stop", "length")


def _copy_gguf(src, dst, arch: str | None = None, drop: str | None = None) -> None:
    """Rewrite a GGUF with another architecture name or without one tensor (gguf-py)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch or r.get_field("general.architecture").contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[1] if len(f.types) > 1 else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub)
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture_and_missing_tensor(tmp_path):
    src = assets.smollm2_path()
    odd = tmp_path / "odd.gguf"
    _copy_gguf(src, odd, arch="mystery")
    with pytest.raises(FormatError, match="mystery.*supported"):
        LLM(str(odd), show_progress=False)
    holey = tmp_path / "holey.gguf"
    _copy_gguf(src, holey, drop="blk.3.ffn_down.weight")
    with pytest.raises(FormatError, match="blk.3.ffn_down|layers.3.mlp.down_proj"):
        LLM(str(holey), show_progress=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
