"""The FastAPI app: routes, auth, body limit, error schemas, health, metrics, tokenize.

`build_app(state, api_key=..., max_body_bytes=...)` returns the app; `ft serve`
(freetoken/commands/serve.py) builds the engine on a background thread and runs it with uvicorn,
so `/health` says 503 while the model loads and 200 once it serves.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from freetoken.server import anthropic_routes, openai_routes, responses_routes
from freetoken.server.errors import APIError, error_response, format_validation_error
from freetoken.server.metrics import CONTENT_TYPE
from freetoken.server.openai_chat import template_message
from freetoken.server.protocol_openai import DetokenizeRequest, TokenizeRequest
from freetoken.server.serving import (
    ServerState,
    check_tools_count,
    encode_text,
    parse_body,
    render_chat,
)

log = logging.getLogger("freetoken.server")
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"
_KNOWN_ROUTES = {
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/responses",
    "/v1/messages/count_tokens", "/health", "/metrics", "/tokenize", "/detokenize", "/",
}


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413, before reading them whole."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            resp = error_response(scope["path"], self._error(int(declared)))
            return await resp(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit:
                raise self._error(seen)
            return msg

        return await self.app(scope, limited_receive, send)

    def _error(self, n: int) -> APIError:
        return APIError(413, f"request body of {n} bytes exceeds the limit of {self.limit} bytes")


class AuthAndCount:
    """ASGI middleware: API key on /v1 routes (when set), and a request counter by status."""

    def __init__(self, app, api_key: str | None, metrics) -> None:
        self.app, self.key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            if self.key and path.startswith("/v1") and not _authorized(scope, self.key):
                err = APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                               "KEY' or 'x-api-key: KEY'")
                await error_response(path, err)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            route = path if path in _KNOWN_ROUTES else "other"
            self.metrics.requests.labels(route, str(status[0])).inc()


def _authorized(scope, key: str) -> bool:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    auth = headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    given = given or headers.get("x-api-key")
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


def build_app(state: ServerState, *, api_key: str | None = None,
              max_body_bytes: int = 8 << 20) -> FastAPI:
    """The HTTP app around a (possibly still loading) async engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start(asyncio.get_running_loop())
        yield
        state.engine.shutdown()

    app = FastAPI(title="FreeToken", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    _add_handlers(app)
    metrics = state.engine.metrics

    app.add_middleware(AuthAndCount, api_key=api_key, metrics=state.engine.metrics)
    if max_body_bytes:
        app.add_middleware(BodyLimit, limit=max_body_bytes)
    metrics = state.engine.metrics

    @app.get("/", include_in_schema=False)
    async def chat_page():
        # What the page must know before its first API call (so it never draws a 401 it could
        # have avoided): the served name and whether /v1 needs a key. Never the key itself.
        page = CHAT_PAGE.read_text(encoding="utf-8")
        conf = {"model": state.served_model_name, "api_key_required": bool(api_key)}
        page = page.replace("/*SERVER_CONFIG*/null", json.dumps(conf).replace("<", "\\u003c"))
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    async def health():
        if state.engine.ready:
            return {"status": "ok"}
        status = "error" if state.engine.load_error else "loading"
        return JSONResponse({"status": status, "detail": state.engine.load_error}, 503)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_body(await request.body(), TokenizeRequest)
        state.check_model(req.model)
        state.require_ready()
        check_tools_count(state.limits, req.tools)
        if req.messages is not None:
            msgs = [template_message(i, m) for i, m in enumerate(req.messages)]
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            extra = {"continue_final_message": True} if req.continue_final_message else {}
            _, ids = await render_chat(state, msgs, tools,
                                       add_generation_prompt=req.add_generation_prompt, **extra)
        else:
            ids = await encode_text(state, req.prompt, req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_body(await request.body(), DetokenizeRequest)
        state.check_model(req.model)
        state.require_ready()
        vocab = state.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    return app


def _add_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(request.url.path, APIError(400, format_validation_error(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request.url.path, APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        msg = f"internal server error: {type(exc).__name__}: {exc}"
        return error_response(request.url.path, APIError(500, msg))
