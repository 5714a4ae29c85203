"""Engine test helpers: the real SmolLM2 model with its weights dequantized once to float32.

The quantized CPU path dequantizes every weight on every call (by design: weights stay
quantized), which costs seconds per step on 2 cores. Engine tests are about scheduling, paging
and sampling, not the codec, so they run SmolLM2's real weights as float32 tensors: the numbers
the quantized path computes (dequantize, then float matmul), at float speed.
"""

from __future__ import annotations

import functools

import torch

from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.formats.dequant import dequantize
from freetoken.formats.qweight import QuantWeight
from freetoken.tokenizer import Tokenizer


def _as_f32(qw: QuantWeight) -> QuantWeight:
    w = dequantize(qw, apply_scale2=True)
    return QuantWeight(w.contiguous(), "f32", tuple(w.shape), source=qw.source)


def dequantize_model(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every quantized weight of a loaded model by its float32 dequantization."""
    for mod in model.modules():
        if isinstance(getattr(mod, "weights", None), list):
            mod.weights = [_as_f32(w) for w in mod.weights]
        if isinstance(getattr(mod, "weight", None), QuantWeight):
            mod.weight = _as_f32(mod.weight)
    return model


@functools.cache
def smollm2() -> tuple[torch.nn.Module, Tokenizer]:
    from freetoken import assets
    from freetoken.models import load_model

    path = assets.smollm2_path()
    model, _ = load_model(path, show_progress=False)
    return dequantize_model(model), Tokenizer.from_path(path)


def engine(**config) -> Engine:
    """A fresh engine (own KV cache and scheduler) on the shared dequantized SmolLM2."""
    model, tok = smollm2()
    config.setdefault("show_progress", False)
    return Engine(EngineConfig(**config), model=model, tokenizer=tok)


def run(eng: Engine, prompts: dict[str, list[int]], params) -> dict:
    """Add all requests, step until done; {request_id: final output, with all logprobs}."""
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    done, logprobs = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
            if out.finished:
                out.logprobs = logprobs[out.request_id] if out.logprobs is not None else None
                done[out.request_id] = out
    stats = eng.stats()  # every finished request gave its pages back
    assert stats.kv_pages_used == 0 and stats.num_running == stats.num_waiting == 0
    assert eng.pool.num_free + stats.kv_pages_cached == eng.pool.num_pages
    return done
