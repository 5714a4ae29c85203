"""OpenAI `/v1/chat/completions` and `/v1/completions`, streamed (SSE) and not."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from freetoken.server import openai_chat as chat
from freetoken.server.errors import APIError, error_body
from freetoken.server.openai_completion import CompletionRun
from freetoken.server.protocol_openai import ChatCompletionRequest, CompletionRequest
from freetoken.server.serving import (
    ServerState,
    encode_text,
    make_params,
    new_id,
    parse_body,
    resolve_max_tokens,
    sub_requests,
)

router = APIRouter()


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_stream(
    path: str, events: AsyncIterator[dict], close
) -> AsyncIterator[str]:
    """SSE framing; an error after the headers went out is sent as an error event."""
    try:
        async for obj in events:
            yield sse(obj)
    except APIError as e:
        yield sse(error_body(path, e))
    finally:
        close()  # NOTE: runs on client disconnect too (the task is cancelled): aborts at once
    yield sse("[DONE]")


def sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(gen, media_type="text/event-stream", headers=headers)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state: ServerState = request.app.state.server
    req = parse_body(await request.body(), ChatCompletionRequest)
    state.check_model(req.model)
    state.require_ready()
    prep = await chat.prepare(state, req)
    rid = new_id("chatcmpl-")
    stream = await state.engine.submit(sub_requests(rid, prep.prompt_ids, prep.params))
    run = chat.ChatRun(state, req, prep, rid)
    if req.stream:
        return sse_response(sse_stream(request.url.path, run.stream_events(stream), stream.close))
    try:
        return JSONResponse(await run.collect(stream, request))
    finally:
        stream.close()


@router.post("/v1/completions")
async def completions(request: Request):
    state: ServerState = request.app.state.server
    req = parse_body(await request.body(), CompletionRequest)
    state.check_model(req.model)
    state.require_ready()
    prompts = req.prompts()
    if len(prompts) != 1:
        raise APIError(400, "send one prompt per request (batched prompts are not supported)",
                       param="prompt")
    p = prompts[0]
    ids = p if isinstance(p, list) else await encode_text(state, p)
    vocab = state.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    params = make_params(
        state.limits,
        max_tokens=resolve_max_tokens(state, len(ids), req.max_tokens),
        **chat.common_sampling(req),
        logprobs=req.logprobs,
    )
    rid = new_id("cmpl-")
    stream = await state.engine.submit(sub_requests(rid, ids, params))
    prompt_text = p if isinstance(p, str) else state.tokenizer.decode(ids)
    run = CompletionRun(state, req, ids, rid, prompt_text)
    if req.stream:
        return sse_response(sse_stream(request.url.path, run.stream_events(stream), stream.close))
    try:
        return JSONResponse(await run.collect(stream, request))
    finally:
        stream.close()


def model_card(state: ServerState) -> dict:
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created or int(time.time()),
        "owned_by": "freetoken",
    }
    if state.engine.ready:
        card["max_model_len"] = state.max_model_len
    return card


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [model_card(request.app.state.server)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    state: ServerState = request.app.state.server
    state.check_model(model_id)
    return model_card(state)
