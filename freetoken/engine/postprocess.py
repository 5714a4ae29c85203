"""Request bookkeeping around the model: input checks, stop conditions, text, outputs."""

from __future__ import annotations

from freetoken.engine.outputs import RequestOutput
from freetoken.engine.request import Request
from freetoken.engine.sampling_params import SamplingParams
from freetoken.tokenizer.detokenizer import find_stop, held_back


def check_prompt(
    prompt: list[int], params: SamplingParams, max_model_len: int, vocab_size: int
) -> int:
    """Validate a new request; return its resolved max_tokens. ValueError says what is wrong."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens, but the context holds {max_model_len} "
            "(prompt plus at least one generated token); shorten the prompt"
        )
    room = max_model_len - len(prompt)
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise ValueError(
            f"max_tokens={params.max_tokens} plus the prompt's {len(prompt)} tokens exceeds the "
            f"context of {max_model_len} tokens; ask for at most {room}"
        )
    return params.max_tokens


def update_text_and_stop(req: Request, eos_ids: list[int], max_model_len: int) -> None:
    """After a new token: detokenize it and decide whether the request is done."""
    p, tok = req.params, req.output_token_ids[-1]
    if tok in eos_ids and not p.ignore_eos:
        req.finish_reason, req.stop_reason = "stop", None
    elif tok in p.stop_token_ids:
        req.finish_reason, req.stop_reason = "stop", tok
    else:
        prev = len(req.text)
        req.text += req.detok.add(tok)
        hit = find_stop(req.text, p.stop, prev)
        if hit is not None:
            req.text = req.text[: hit[0]]
            req.finish_reason, req.stop_reason = "stop", hit[1]
            return
    if req.finish_reason is None and (
        len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len
    ):
        req.finish_reason = "length"
    if req.finish_reason is not None and req.stop_reason is None:
        req.text += req.detok.flush()  # an incomplete last character, as decode() gives it


def make_output(req: Request) -> RequestOutput:
    """The delta since this request's last output; pending tokens and logprobs are consumed."""
    visible = len(req.text)
    if req.finish_reason is None:
        visible -= held_back(req.text, req.params.stop)
    visible = max(visible, req.emitted_chars)
    new_text = req.text[req.emitted_chars : visible]
    req.emitted_chars = visible
    out = RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        new_token_ids=req.pending_token_ids,
        new_text=new_text,
        text=req.text[:visible],
        output_token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=req.pending_logprobs if req.params.logprobs is not None else None,
        num_cached_tokens=req.num_cached_tokens,
        error=req.error,
    )
    req.pending_token_ids, req.pending_logprobs = [], []
    return out
