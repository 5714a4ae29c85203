"""Load test: N concurrent streamed chat requests against a running `ft serve`.

    python benchmarks/bench_serve_load.py --base http://127.0.0.1:1919 -n 16 -c 8 --max-tokens 32

Prints requests/s, time to first token, per-request decode tokens/s and inter-token latency
percentiles, and aggregate output tokens/s. Tokens are counted from the server's usage (the
final `include_usage` chunk), not from text.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field

import openai

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "List three fruits.",
    "What is the capital of France? Answer briefly.",
]


@dataclass
class Result:
    ttft: float = 0.0
    total: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


async def one(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int) -> Result:
    res, t0 = Result(), time.perf_counter()
    last = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], stream=True,
            max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content:
                if last is None:
                    res.ttft = now - t0
                else:
                    res.gaps.append(now - last)
                last = now
    except openai.APIError as e:
        res.error = str(e)
    res.total = time.perf_counter() - t0
    return res


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def run(args: argparse.Namespace) -> list[Result]:
    client = openai.AsyncOpenAI(base_url=args.base + "/v1", api_key=args.api_key or "none",
                                timeout=3600, max_retries=0)
    model = args.model or (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(i: int) -> Result:
        async with sem:
            return await one(client, model, PROMPTS[i % len(PROMPTS)], args.max_tokens)

    return await asyncio.gather(*[limited(i) for i in range(args.num_requests)])


def report(results: list[Result], wall: float, args: argparse.Namespace) -> None:
    ok = [r for r in results if r.error is None]
    print(f"requests: {len(results)} ({len(results) - len(ok)} failed), concurrency "
          f"{args.concurrency}, max_tokens {args.max_tokens}, wall {wall:.2f} s")
    for r in results:
        if r.error:
            print("  error:", r.error[:200])
    tokens = sum(r.tokens for r in ok)
    print(f"requests/s: {len(ok) / wall:.3f}   output tokens/s (all streams): {tokens / wall:.2f}")
    decode = [(r.tokens - 1) / (r.total - r.ttft) for r in ok if r.tokens > 1 and r.total > r.ttft]
    gaps = [g for r in ok for g in r.gaps]
    rows = [("TTFT (s)", [r.ttft for r in ok]), ("ITL (s)", gaps),
            ("decode tokens/s per stream", decode), ("request latency (s)", [r.total for r in ok])]
    print(f"{'metric':28s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    for name, vals in rows:
        mean = statistics.fmean(vals) if vals else float("nan")
        print(f"{name:28s} {mean:9.4f} {pct(vals, 50):9.4f} {pct(vals, 90):9.4f} "
              f"{pct(vals, 99):9.4f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="http://127.0.0.1:1919")
    p.add_argument("--model", default=None, help="default: the server's only model")
    p.add_argument("--api-key", default=None)
    p.add_argument("-n", "--num-requests", type=int, default=16)
    p.add_argument("-c", "--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = asyncio.run(run(args))
    report(results, time.perf_counter() - t0, args)
    return 0 if all(r.error is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
