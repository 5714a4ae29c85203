"""HTTP errors in the OpenAI and Anthropic error schemas.

Handlers raise `APIError(status, message, ...)`; the app renders it as
OpenAI: `{"error": {"message", "type", "param", "code"}}` on /v1/chat/completions, /v1/completions
and the rest, or Anthropic: `{"type": "error", "error": {"type", "message"}}` on /v1/messages*.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

# status -> (OpenAI error type, Anthropic error type)
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("overloaded_error", "overloaded_error"),
}


class APIError(Exception):
    """An error the client caused or must retry: rendered with its status, never a traceback."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_overflow(max_len: int, prompt: int, completion: int) -> APIError:
    """The OpenAI wording, with the numbers, so clients can shorten the prompt or max_tokens."""
    return APIError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the prompt, {completion} in the completion). "
        "Please reduce the length of the prompt or max_tokens.",
        param="messages",
        code="context_length_exceeded",
    )


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, err: APIError) -> dict:
    openai_type, anthropic_type = _TYPES.get(err.status, ("invalid_request_error",) * 2)
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return {
        "error": {
            "message": err.message,
            "type": openai_type,
            "param": err.param,
            "code": err.code if err.code is not None else err.status,
        }
    }


def error_response(path: str, err: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if err.status in (429, 503) else None
    if err.status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(path, err), status_code=err.status, headers=headers)


def format_validation_error(exc: Exception) -> str:
    """pydantic's ValidationError as one line per problem: `field.path: what was wrong`."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    parts = []
    for e in errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body",))
        msg = e.get("msg", "invalid value")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or str(exc)


def first_param(exc: Exception) -> str | None:
    errors = getattr(exc, "errors", None)
    if not callable(errors) or not errors():
        return None
    return ".".join(str(p) for p in errors()[0].get("loc", ())) or None
