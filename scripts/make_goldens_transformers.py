"""Reference goldens for the three real GGUFs from HF transformers (fp32, CPU).

transformers loads each GGUF with `from_pretrained(dir, gguf_file=...)` (dequantizing it to
float32) and greedily continues a few prompts for 64 tokens. Stored per prompt: the prompt
tokens, the 64 greedy tokens, and at every position from the last prompt token on the top-8
token ids and logits (enough to check values, argmax and the top-2 margin, and small).

    python scripts/make_goldens_transformers.py [--models smollm2-135m-instruct ...]

Writes tests/data/golden_transformers_<model>.json. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from freetoken import assets

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 64
TOP_K = 8
OUT = Path(__file__).resolve().parent.parent / "tests" / "data"


def load(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets.resolve_model(name)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
    return tok, model.eval()


@torch.inference_mode()
def golden(tok, model, prompt: str) -> dict:
    ids = tok(prompt).input_ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         min_new_tokens=NEW_TOKENS, output_logits=True,
                         return_dict_in_generate=True)
    steps = torch.stack([s[0].float() for s in out.logits])  # [64, V]: after each prefix
    top = steps.topk(TOP_K, dim=-1)
    return {"prompt": prompt, "prompt_ids": ids, "greedy": out.sequences[0, len(ids):].tolist(),
            "top_ids": top.indices.tolist(), "top_logits": top.values.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=assets.known_models())
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for name in args.models:
        tok, model = load(name)
        data = {"model": name, "reference": "transformers fp32 (GGUF dequantized)",
                "prompts": [golden(tok, model, p) for p in PROMPTS]}
        dst = OUT / f"golden_transformers_{name}.json"
        dst.write_text(json.dumps(data))
        print(f"{name}: wrote {dst.name}")


if __name__ == "__main__":
    main()
