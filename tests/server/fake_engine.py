"""A scripted stand-in for `Engine` with the real SmolLM2 tokenizer, for fast server tests.

It follows the Engine interface (add_request / abort / step / has_unfinished / stats) and
"generates" a fixed text: the last one between `[[say:` and `:yas]]` in the prompt, else a default
sentence, one token per step, then EOS. Everything around it (the HTTP layer, parsers, SSE,
the official clients) is real; the real engine is tested end to end in test_e2e_*.py.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from freetoken.engine.outputs import RequestOutput, TokenLogprob
from freetoken.engine.sampling_params import SamplingParams
from freetoken.tokenizer.detokenizer import IncrementalDetokenizer, find_stop

DEFAULT_REPLY = "Hello from the scripted engine."
_SAY = re.compile(r"\[\[say:(.*?):yas\]\]", re.S)


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 64
    prefix_cache_hit_tokens: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    script: list[int]
    detok: IncrementalDetokenizer
    out: list[int] = field(default_factory=list)
    text: str = ""


class FakeEngine:
    page_size = 16

    def __init__(self, tokenizer, max_model_len: int = 512, step_s: float = 0.004,
                 max_running: int = 8) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.step_s = step_s
        self.max_running = max_running
        self.reqs: dict[str, _Req] = {}
        self.order: list[str] = []
        self.totals = FakeStats()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        if request_id in self.reqs:
            raise ValueError(f"request id {request_id!r} is already running")
        said = _SAY.findall(self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
        reply = said[-1] if said else DEFAULT_REPLY  # the latest instruction wins
        script = self.tokenizer.encode(reply, add_special_tokens=False)
        script.append(self.tokenizer.eos_token_ids[0])
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        self.reqs[request_id] = _Req(request_id, list(prompt_token_ids), params, script, detok)
        self.order.append(request_id)
        self.totals.prompt_tokens_total += len(prompt_token_ids)

    def abort(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)
        if request_id in self.order:
            self.order.remove(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.reqs)

    def stats(self) -> FakeStats:
        running = self.order[: self.max_running]
        s = FakeStats(**self.totals.__dict__)
        s.num_running, s.num_waiting = len(running), len(self.order) - len(running)
        s.kv_pages_used = sum(
            math.ceil((len(self.reqs[r].prompt) + len(self.reqs[r].out)) / self.page_size)
            for r in running
        )
        return s

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        return [self._advance(self.reqs[r]) for r in list(self.order[: self.max_running])]

    def _advance(self, r: _Req) -> RequestOutput:
        tid = r.script[len(r.out) % len(r.script)]  # ignore_eos: go round again
        r.out.append(tid)
        self.totals.generation_tokens_total += 1
        eos = tid in self.tokenizer.eos_token_ids and not r.params.ignore_eos
        new = r.detok.flush() if eos else r.detok.add(tid)
        finish, stop_reason = ("stop", tid) if eos else (None, None)
        start = len(r.text)
        r.text += new
        hit = find_stop(r.text, r.params.stop, start)
        if hit is not None:
            r.text, finish, stop_reason = r.text[: hit[0]], "stop", hit[1]
        elif finish is None and r.params.max_tokens is not None and (
            len(r.out) >= r.params.max_tokens
        ):
            finish = "length"
        lps = None
        if r.params.logprobs is not None:
            top = [(tid, -0.25), (tid + 1, -1.5)][: r.params.logprobs]
            lps = [TokenLogprob(tid, -0.25, top)]
        out = RequestOutput(r.rid, r.prompt, [tid], r.text[start:], r.text, list(r.out),
                            finish, stop_reason, lps)
        if finish is not None:
            self.abort(r.rid)
        return out
