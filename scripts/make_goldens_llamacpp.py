"""llama.cpp goldens for the three real GGUFs (needs llama-cpp-python; CI lacks it).

Per model and prompt: llama.cpp's own tokenization, its greedy 64 tokens, and, teacher-forced
on prompt + those tokens, its top-8 logits at every position from the last prompt token on
(llama.cpp quantizes activations to 8 bits, so these differ from a float reference by up to
about 1; tests/models/test_llamacpp.py compares within that). CPU, 2 threads.

    python scripts/make_goldens_llamacpp.py [--models smollm2-135m-instruct ...]

Writes tests/data/golden_llamacpp_<model>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from freetoken import assets

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 64
TOP_K = 8
OUT = Path(__file__).resolve().parent.parent / "tests" / "data"


def golden(llm, prompt: str) -> dict:
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(ids)
    greedy = []
    for _ in range(NEW_TOKENS):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    steps = np.asarray(llm.scores[len(ids) - 1 : len(ids) - 1 + NEW_TOKENS], dtype=np.float32)
    top = np.argsort(-steps, axis=1)[:, :TOP_K]
    return {"prompt": prompt, "prompt_ids": list(ids), "greedy": greedy,
            "top_ids": top.tolist(), "top_logits": np.take_along_axis(steps, top, 1).tolist()}


def main() -> None:
    from llama_cpp import Llama

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=assets.known_models())
    args = ap.parse_args()
    for name in args.models:
        llm = Llama(str(assets.resolve_model(name)), n_ctx=256, n_threads=2, logits_all=True,
                    verbose=False, seed=0)
        data = {"model": name, "reference": "llama.cpp (llama-cpp-python), CPU",
                "prompts": [golden(llm, p) for p in PROMPTS]}
        dst = OUT / f"golden_llamacpp_{name}.json"
        dst.write_text(json.dumps(data))
        print(f"{name}: wrote {dst.name}")


if __name__ == "__main__":
    main()
