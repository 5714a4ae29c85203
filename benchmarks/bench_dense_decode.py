"""Decode tokens/s of FreeToken next to llama.cpp on the same GGUF, in the same run.

For each real model: the same prompt, greedy, the same thread count. Decode speed is measured
the same way for both: time(prompt + 1 + N tokens) - time(prompt + 1 token), divided by N, so
prefill and start-up cancel out. llama.cpp comes from llama-cpp-python (skipped, with a note,
where it is not installed).

    python benchmarks/bench_dense_decode.py [--tokens 16] [--threads 1] [--models a,b]
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


def freetoken_decode(path, n: int) -> float:
    engine = Engine(EngineConfig(model=str(path), show_progress=False, cache_type="naive"))
    ids = engine.tokenizer.encode(PROMPT)

    def run(k: int) -> None:
        rid = f"bench-{k}-{time.monotonic_ns()}"
        engine.add_request(rid, ids, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()

    run(2)  # warm-up
    return n / (_timed(lambda: run(n + 1)) - _timed(lambda: run(1)))


def llamacpp_decode(path, n: int, threads: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
    no_eos = {llm.token_eos(): float("-inf")}

    def run(k: int) -> None:
        llm.reset()  # no prompt cache between runs
        llm.create_completion(PROMPT, max_tokens=k, temperature=0, logit_bias=no_eos)

    run(2)
    return n / (_timed(lambda: run(n + 1)) - _timed(lambda: run(1)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"decode tokens/s, {args.tokens} tokens after {PROMPT!r}, {args.threads} thread(s)")
    print(f"{'model':32} {'FreeToken':>10} {'llama.cpp':>10} {'ratio':>7}")
    for name in args.models.split(","):
        path = assets.resolve_model(name)
        ours = freetoken_decode(path, args.tokens)
        ref = llamacpp_decode(path, args.tokens, args.threads)
        ref_s = f"{ref:10.2f}" if ref else f"{'n/a':>10}"
        ratio = f"{ours / ref:7.3f}" if ref else f"{'':>7}"
        print(f"{name:32} {ours:10.2f} {ref_s} {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
