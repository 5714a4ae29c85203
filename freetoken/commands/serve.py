"""`ft serve`: the OpenAI- and Anthropic-compatible HTTP server (uvicorn + FastAPI).

The socket opens at once and `/health` answers 503 while the engine loads on its own thread;
the reasoning and tool-call parsers are chosen once the tokenizer (family, chat template) is
known, unless `--reasoning-parser` / `--tool-call-parser` name them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from freetoken import assets
from freetoken.cli import add_engine_args, engine_config_from_args
from freetoken.config import EngineConfig, ServerConfig
from freetoken.server.parsers import REASONING_PARSERS, TOOL_PARSERS, choose_parsers

log = logging.getLogger("freetoken.server")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default=ServerConfig.host)
    p.add_argument("--port", type=int, default=ServerConfig.port)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the packaged name or file stem)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1 routes")
    p.add_argument("--reasoning-parser", default=None,
                   choices=[*REASONING_PARSERS, "none"], help="default: from the model")
    p.add_argument("--tool-call-parser", default=None,
                   choices=[*TOOL_PARSERS, "none"], help="default: from the chat template")
    p.add_argument("--max-in-flight-requests", type=int,
                   default=ServerConfig.max_in_flight_requests,
                   help="generation requests held at once (running + waiting); more get 503")
    p.add_argument("--max-body-mb", type=int, default=ServerConfig.max_body_mb)
    p.add_argument("--max-n", type=int, default=ServerConfig.max_n,
                   help="choices one request may ask for (n); more is a 400")
    p.add_argument("--max-logprobs", type=int, default=ServerConfig.max_logprobs,
                   help="logprobs / top_logprobs alternatives per token; more is a 400")
    p.add_argument("--max-stop", type=int, default=ServerConfig.max_stop,
                   help="stop strings per request; more is a 400")
    p.add_argument("--max-tools", type=int, default=ServerConfig.max_tools,
                   help="tool definitions per request; more is a 400")
    p.add_argument("--max-stored-responses", type=int,
                   default=ServerConfig.max_stored_responses,
                   help="/v1/responses kept in memory for GET and previous_response_id")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run)


def served_name(model: str | None) -> str:
    if model is None or model in assets.known_models():
        return model or assets.DEFAULT_MODEL
    p = Path(model)
    if not p.exists() and assets.HUB_NAME.match(model):
        return model.partition(":")[0]  # the hub name, as vLLM serves it
    return p.stem if p.suffix == ".gguf" else p.name


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        engine=engine_config_from_args(args), host=args.host, port=args.port,
        served_model_name=args.served_model_name or served_name(args.model),
        api_key=args.api_key, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        max_in_flight_requests=args.max_in_flight_requests, max_body_mb=args.max_body_mb,
        max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop=args.max_stop,
        max_tools=args.max_tools, max_stored_responses=args.max_stored_responses,
    )


def make_app(cfg: ServerConfig, engine_factory=None, announce: bool = False):
    """The app with its engine thread (not started); engine_factory defaults to `Engine`.

    announce: print the start-up banner (URLs, model, MoE backend, memory, context) to stderr
    once the model is loaded.
    """
    from freetoken.server.app import build_app
    from freetoken.server.async_engine import AsyncEngine
    from freetoken.server.responses_store import ResponseStore
    from freetoken.server.serving import RequestLimits, ServerState

    limits = RequestLimits(max_n=cfg.max_n, max_logprobs=cfg.max_logprobs,
                           max_stop=cfg.max_stop, max_tools=cfg.max_tools)
    state = ServerState(None, cfg.served_model_name or served_name(cfg.engine.model),
                        created=int(time.time()), limits=limits,
                        responses=ResponseStore(cfg.max_stored_responses))

    def load():
        if engine_factory is not None:
            engine = engine_factory(cfg.engine)
        else:
            from freetoken.engine.engine import Engine

            engine = Engine(cfg.engine)
        tok = engine.tokenizer
        r, t = choose_parsers(tok.model_family, getattr(tok, "chat_template", None),
                              cfg.reasoning_parser, cfg.tool_call_parser)
        state.reasoning_parser, state.tool_call_parser = r, t
        log.info("serving %r: reasoning parser %s, tool-call parser %s",
                 state.served_model_name, r, t)
        if announce:
            from freetoken.server.banner import banner

            e = cfg.engine
            path = (f"{e.model} (random {e.dummy_format} weights)" if e.dummy_weights
                    else str(assets.resolve_model(e.model)))
            text = banner(state, engine, cfg.host, cfg.port, bool(cfg.api_key), path)
            print(text, file=sys.stderr, flush=True)
        return engine

    state.engine = AsyncEngine(load, max_in_flight=cfg.max_in_flight_requests)
    return build_app(state, api_key=cfg.api_key, max_body_bytes=cfg.max_body_mb << 20)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    cfg = server_config_from_args(args)
    _check(cfg.engine)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    app = make_app(cfg, announce=True)
    log.info("listening on http://%s:%d (model loading; /health is 503 until ready)",
             cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0


def _check(cfg: EngineConfig) -> None:
    """Fail before opening the socket on what can be checked without loading."""
    if cfg.dummy_weights:  # a built-in shape or a path: models/dummy.py checks it
        from freetoken.models.dummy import dummy_config

        dummy_config(cfg.model, cfg.dummy_layers)
        return
    assets.resolve_model(cfg.model)
