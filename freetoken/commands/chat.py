"""`ft chat`: an interactive conversation that streams answers and keeps the history.

Commands at the prompt: /exit (or Ctrl-D) quits, /reset forgets the conversation.
"""

from __future__ import annotations

import argparse
import sys

from freetoken.commands.generate import (
    add_sampling_args,
    chat_messages,
    sampling_params,
    setup_logging,
    stream,
)


def add_parser(sub) -> None:
    from freetoken.cli import add_engine_args

    p = sub.add_parser("chat", help="chat with a model interactively (streams answers)")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from freetoken.cli import engine_config_from_args
    from freetoken.engine.engine import Engine

    setup_logging(args)
    engine = Engine(engine_config_from_args(args))
    tok = engine.tokenizer
    if not tok.has_chat_template:
        raise ValueError("this model has no chat template; give one with --chat-template FILE")
    history: list[dict] = []
    print("Chatting. /reset forgets the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        ids = tok.encode_chat(chat_messages(args.system, history))
        room = engine.max_model_len - len(ids)
        if room < 1:
            history.clear()
            print("[the conversation fills the context; it was reset]", file=sys.stderr)
            continue
        text, _ = stream(engine, ids, sampling_params(args, min(args.max_tokens, room)),
                         sys.stdout)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": text})
