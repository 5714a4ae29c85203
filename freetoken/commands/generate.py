"""`ft generate "prompt"`: one completion, streamed to stdout as tokens come.

With a chat model the prompt is sent as a user message through the model's chat template
(`--no-chat` sends it as raw text).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TextIO

from freetoken.engine.sampling_params import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message (chat mode)")
    add_log_level(p)


def add_log_level(p: argparse.ArgumentParser) -> None:
    """`--log-level` for `setup_logging` (commands that build an engine)."""
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log lines on stderr (the MoE backend's choice, the decode log line)")


class _Stderr(logging.StreamHandler):
    """Writes to sys.stderr as it is when a line is written (not when the handler was made)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(args: argparse.Namespace) -> None:
    """FreeToken's log lines to stderr at --log-level (one handler on the package's logger, so
    a host program's own logging set-up stays as it is)."""
    log = logging.getLogger("freetoken")
    log.setLevel(args.log_level.upper())
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        h = _Stderr()
        h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(h)


def add_parser(sub) -> None:
    from freetoken.cli import add_engine_args

    p = sub.add_parser("generate", help="generate from a prompt, streaming the tokens")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the model has one)")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def sampling_params(args: argparse.Namespace, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=list(args.stop),
    )


def stream(engine, prompt_ids: list[int], params: SamplingParams, out: TextIO,
           first_token: list[float] | None = None) -> tuple[str, int]:
    """Run one request, writing text as it comes; returns (text, number of tokens).
    `first_token`, when given, gets the perf_counter time at which the first token came."""
    rid = f"cli-{time.monotonic_ns()}"
    engine.add_request(rid, prompt_ids, params)
    text, n = "", 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if first_token is not None and not first_token:
                first_token.append(time.perf_counter())
            out.write(o.new_text)
            out.flush()
            text, n = o.text, len(o.output_token_ids)
            if o.finish_reason == "error":
                raise ValueError(f"generation failed: {o.error}")
    return text, n


def chat_messages(system: str | None, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + history


def run(args: argparse.Namespace) -> int:
    from freetoken.cli import engine_config_from_args
    from freetoken.engine.engine import Engine

    setup_logging(args)
    engine = Engine(engine_config_from_args(args))
    tok = engine.tokenizer
    use_chat = tok.has_chat_template if args.chat is None else args.chat
    if use_chat:
        msgs = chat_messages(args.system, [{"role": "user", "content": args.prompt}])
        ids = tok.encode_chat(msgs)
    else:
        ids = tok.encode(args.prompt)
    first: list[float] = []
    t0 = time.perf_counter()
    _, n = stream(engine, ids, sampling_params(args), sys.stdout, first)
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    print(speed_line(len(ids), n, t0, first[0] if first else t1, t1), file=sys.stderr)
    return 0


def speed_line(prompt: int, generated: int, t0: float, t_first: float, t1: float) -> str:
    """Prompt speed (to the first token) and decode speed (the tokens after it)."""
    pre = t_first - t0
    line = f"[prompt: {prompt} tokens in {pre:.2f} s, {prompt / max(pre, 1e-9):.1f} tokens/s"
    if generated > 1:
        dec = t1 - t_first
        line += f"; decode: {generated - 1} tokens in {dec:.2f} s, " \
                f"{(generated - 1) / max(dec, 1e-9):.1f} tokens/s"
    return line + "]"
