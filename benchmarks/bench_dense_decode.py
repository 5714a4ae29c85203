"""Decode and prompt tokens/s of FreeToken next to llama.cpp on the same GGUF, in the same run.

For each real model: the same prompt, greedy, the same thread count. Decode speed is measured
the same way for both: time(prompt + 1 + N tokens) - time(prompt + 1 token), divided by N, so
prefill and start-up cancel out; the best of `--repeat` such pairs. Prompt processing: the same
`--prompt-len` token ids (the prompt's tokens repeated) through each, one token generated, best
of `--repeat` runs, prompt tokens / seconds. llama.cpp comes from llama-cpp-python (skipped,
with a note, where it is not installed).

    python benchmarks/bench_dense_decode.py [--tokens 16] [--threads 1] [--models a,b]
        [--prompt-len 512 (0: decode only)] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from freetoken import assets
from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
MODELS = [assets.SMOLLM2, assets.GEMMA3_270M, assets.QWEN25_CODER]


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def long_prompt(ids: list[int], n: int) -> list[int]:
    """n token ids: the prompt's, repeated."""
    return (ids * (n // len(ids) + 1))[:n]


def freetoken_speed(path, n: int, prompt_len: int, repeat: int) -> tuple[float, float | None]:
    """(decode tokens/s, prompt tokens/s or None)."""
    engine = Engine(EngineConfig(model=str(path), show_progress=False, cache_type="naive"))
    ids = engine.tokenizer.encode(PROMPT)

    def run(k: int, prompt: list[int] = ids) -> None:
        rid = f"bench-{k}-{time.monotonic_ns()}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=k, temperature=0,
                                                       ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    run(2)  # warm-up
    decode = max(n / (_timed(lambda: run(n + 1)) - _timed(lambda: run(1)))
                 for _ in range(repeat))
    if not prompt_len:
        return decode, None
    long = long_prompt(ids, prompt_len)
    return decode, prompt_len / min(_timed(lambda: run(1, long)) for _ in range(repeat))


def llamacpp_speed(path, n: int, threads: int, prompt_len: int, repeat: int
                   ) -> tuple[float, float | None] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(path), n_threads=threads, n_threads_batch=threads,
                n_ctx=max(512, prompt_len + 64), n_batch=max(512, prompt_len), verbose=False)
    no_eos = {llm.token_eos(): float("-inf")}

    def run(k: int, prompt=PROMPT) -> None:
        llm.reset()  # no prompt cache between runs
        llm.create_completion(prompt, max_tokens=k, temperature=0, logit_bias=no_eos)

    run(2)
    decode = max(n / (_timed(lambda: run(n + 1)) - _timed(lambda: run(1)))
                 for _ in range(repeat))
    if not prompt_len:
        return decode, None
    long = long_prompt(llm.tokenize(PROMPT.encode(), add_bos=False), prompt_len)
    return decode, prompt_len / min(_timed(lambda: run(1, long)) for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"tokens/s: decode = {args.tokens} tokens after {PROMPT!r}; prompt = a "
          f"{args.prompt_len}-token prompt (best of {args.repeat}); {args.threads} thread(s)")
    cols = ("decode", "prompt") if args.prompt_len else ("decode",)
    head = "".join(f" {c + ' FT':>11} {c + ' llama':>13} {'ratio':>6}" for c in cols)
    print(f"{'model':30}{head}")
    for name in args.models.split(","):
        path = assets.resolve_model(name)
        ours = freetoken_speed(path, args.tokens, args.prompt_len, args.repeat)
        ref = llamacpp_speed(path, args.tokens, args.threads, args.prompt_len, args.repeat)
        row = ""
        for i in range(len(cols)):
            r = ref[i] if ref else None
            row += f" {ours[i]:11.2f} " + (f"{r:13.2f} {ours[i] / r:6.3f}" if r else
                                           f"{'n/a':>13} {'':>6}")
        print(f"{name:30}{row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
