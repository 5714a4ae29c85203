"""The engine: requests in, one batched step at a time, outputs out.

    engine = Engine(EngineConfig(model=...))
    engine.add_request("a", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

`step()` is schedule -> prepare + forward (runner) -> sample -> postprocess. The engine is
safe to drive from one thread calling `step()` while others call `add_request` / `abort`.

Overlap (CUDA, unless `disable_overlap_schedule`): a pure-decode step whose rows are all
sampled on the device is held in flight (`_InFlight`): its ids stay on the device, copied to
the host without a wait, and each request gets a placeholder token (`PENDING`). The next
`step()` schedules the same requests again (their placeholder is the one uncomputed token),
launches that step with the held ids as its input, and only then waits for the held ids and
does their bookkeeping (detokenize, stop checks, outputs), while the device computes. So the
host's work between two decode steps (a fifth of a batch-1 step on the H200) leaves the
device's path. A step's outputs come one `step()` call later; a request that stops (EOS, a
stop string) has one row computed in vain, dropped. Overlap is taken only where the next
step is certain to be the same batch: nothing waiting to join, no request finishing by
length, pages for every next token without preemption; otherwise the held step lands first
and the step runs as before.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass

import torch

from freetoken.config import EngineConfig
from freetoken.engine import postprocess, sampler
from freetoken.engine.kv_cache import PagePool, make_prefix_cache
from freetoken.engine.outputs import RequestOutput
from freetoken.engine.request import Request, Status
from freetoken.engine.runner import ModelRunner, has_recurrent_state, kv_bytes_per_page
from freetoken.engine.sampling_params import SamplingParams
from freetoken.engine.scheduler import ScheduledBatch, Scheduler
from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


# An output token sampled on the device and not read yet (overlap; never a real token id).
PENDING = -1


@dataclass
class _InFlight:
    """A decode step launched and sampled whose ids the host has not read (see module doc)."""

    requests: list[Request]  # its rows, in order
    ids: torch.Tensor  # int64 [S] on the device: the next step's input
    host: torch.Tensor  # the ids' host copy (pinned on CUDA, filled without a wait)
    done: torch.cuda.Event | None  # recorded after that copy (CUDA)

    def read(self) -> list[int]:
        return sampler.finish_read(self.host, self.done)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int  # pages held by requests (shared prefix pages counted once)
    kv_pages_cached: int  # pages held by the prefix cache alone (evictable)
    kv_pages_total: int
    prefix_cache_hit_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    moe_experts: dict[str, int] | None = None  # expert cache totals (offload / hybrid / cpu)
    moe_handoff_failures: int = 0  # steps whose CPU hand-off failed (the cache recovered)


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = config.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    return torch.device(device), getattr(torch, dtype)


class Engine:
    """Continuous-batching engine over one model (see module docstring)."""

    def __init__(self, config: EngineConfig, *, model=None, tokenizer: Tokenizer | None = None):
        """Load the model and tokenizer of `config.model` (or use the given ones: tests)."""
        self.config = config
        self.device, self.dtype = resolve_device_dtype(config)
        if model is None:
            model, tokenizer = self._load(config, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        from freetoken.moe.runtime import configure_moe  # sets the MoE backend on the model

        self.moe = configure_moe(model, config, self.device)
        num_pages = config.num_pages or max(
            1, (config.kv_cache_mb << 20) // kv_bytes_per_page(model, config.page_size, self.dtype)
        )
        self.max_model_len = min(
            config.max_model_len or model.config.max_position, num_pages * config.page_size
        )
        self.pool = PagePool(num_pages, config.page_size)
        # Hybrid models: reusing a cached KV prefix would also need the recurrent state at that
        # prefix, which is not saved, so their prefix reuse is off.
        hybrid = has_recurrent_state(model)
        self.scheduler = Scheduler(
            self.pool,
            make_prefix_cache("naive" if hybrid else config.cache_type, self.pool),
            config.max_running_requests,
            config.max_prefill_tokens,
        )
        self.runner = ModelRunner(model, num_pages, config.page_size, self.dtype, self.device,
                                  config.max_running_requests if hybrid else 0,
                                  max_model_len=self.max_model_len,
                                  cuda_graph_max_bs=self._graph_max_bs(config),
                                  step_hook=self.moe.begin_step if self.moe else None)
        # The expert-cache backends' host work (the executor's pool, the hand-offs) runs
        # inside the forward: torch's own CPU threads stay out of its way during decode.
        self.runner.single_thread_decode |= self.moe is not None
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._lock = threading.RLock()
        self._arrivals = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._counters = {"hit": 0, "prompt": 0, "gen": 0}
        # decode steps overlap on a GPU (module doc); tests turn it on for the CPU too
        self.overlap = self.device.type == "cuda" and not config.disable_overlap_schedule
        self._inflight: _InFlight | None = None

    def _graph_max_bs(self, config: EngineConfig) -> int:
        """Largest decode batch captured as a CUDA graph (0: none; the CPU never captures)."""
        if config.disable_cuda_graph or self.device.type != "cuda":
            return 0
        want = config.cuda_graph_max_bs or config.max_running_requests
        if self.moe is not None:  # the expert cache's decode path is all kernels
            got = self.moe.graph_max_bs(want)
            if got < want:
                logger.info("CUDA graphs for decode batches up to %d (not %d): the %s MoE "
                            "backend's calls of more tokens run eagerly", got, want,
                            self.moe.backend)
            return got
        return want

    def _load(self, config: EngineConfig, tokenizer: Tokenizer | None):
        from freetoken.assets import resolve_model
        from freetoken.layers.moe import host_banks
        from freetoken.models import load_model
        from freetoken.models.dummy import check_dummy_flags, load_dummy_engine_model

        if check_dummy_flags(config):  # --dummy-weights: random weights, token-id prompts
            # Experts are made where they live: host banks for offload / hybrid / cpu.
            on_host = self.device.type == "cuda" and config.moe_backend not in ("fused", "auto")
            with host_banks(on_host):
                return load_dummy_engine_model(config, self.dtype, self.device, tokenizer,
                                               experts_on_host=on_host)
        path = resolve_model(config.model)

        # Only the fused backend puts every expert on the device; the others keep host banks.
        with host_banks(self.device.type == "cuda" and config.moe_backend != "fused"):
            model, _ = load_model(
                path, dtype=self.dtype, device=self.device, show_progress=config.show_progress
            )
        if tokenizer is None:
            tokenizer = Tokenizer.from_path(
                path, tokenizer_dir=config.tokenizer, chat_template_file=config.chat_template
            )
        return model, tokenizer

    # ---- requests in ----------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Queue a request. ValueError (message for the user) on bad input; nothing queued.

        One request is one sequence: `params.n` is for callers (LLM, server), who add n
        requests.
        """
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            req = self._make_request(request_id, list(prompt_token_ids), params)
            self._requests[request_id] = req
            self.scheduler.add(req)

    def _make_request(self, rid: str, prompt: list[int], params: SamplingParams) -> Request:
        max_tokens = postprocess.check_prompt(prompt, params, self.max_model_len,
                                              self.tokenizer.vocab_size)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seeds))
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            params=params,
            max_tokens=max_tokens,
            arrival=next(self._arrivals),
            detok=IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens),
            generator=torch.Generator().manual_seed(seed),
        )

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV pages now; unknown or finished ids are ignored."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None or req.finished:
                return
            self.scheduler.finish(req)
            self.runner.release_state(req)
            if req.output_token_ids and req.output_token_ids[-1] == PENDING:
                req.output_token_ids.pop()  # a step in flight sampled it: never read
            req.finish_reason = "abort"
            self._aborted.append(req)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> forward -> sample -> postprocess; outputs of requests with news (with
        overlap, of the step before: see the module docstring)."""
        with self._lock:
            outputs = [postprocess.make_output(r) for r in self._aborted]
            self._aborted.clear()
            held, self._inflight = self._inflight, None
            if held is not None:
                nxt = self._launch_after(held)
                outputs += self._land(held)  # while the next step computes
                if nxt is not None:
                    batch, logits, ids = nxt
                    if logits is None:
                        return outputs + self._fail_batch(
                            [r for r in batch.requests if not r.finished])
                    self._hold(batch.requests, ids)
                    return outputs
            batch = self.scheduler.schedule()
            for req in batch.preempted:  # recomputed from position 0 when it runs again
                self.runner.release_state(req)
            if not batch:
                return outputs
            logits = self._run(batch)
            if logits is None:
                return outputs + self._fail_batch(batch.requests)
            if self._can_hold(batch):
                self._hold(batch.requests, self._sample_device(batch.requests, logits))
                return outputs
            sampled = self._sample(batch, logits)
            return outputs + self._postprocess(sampled)

    def _run(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
             ) -> torch.Tensor | None:
        """The forward and the expert cache's step bookkeeping; None when the forward failed."""
        logits = self._forward(batch, input_ids)
        if self.moe is not None:  # expert-cache counters and the decode log line
            self.moe.after_step(sum(batch.num_new), all(n == 1 for n in batch.num_new))
        return logits

    def _forward(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
                 ) -> torch.Tensor | None:
        try:
            logits = self.runner.forward(batch, input_ids)
        except Exception as e:  # noqa: BLE001 - reported to every request of the batch
            self._batch_error = f"forward failed: {type(e).__name__}: {e}"
            # The requests get the one-line reason; the operator's log gets the traceback.
            ids = [r.request_id for r in batch.requests]
            logger.exception("forward failed for requests %s", ids)
            return None
        self.scheduler.computed(batch)
        return logits

    # ---- overlap (module docstring) -------------------------------------------------------
    def _can_hold(self, batch: ScheduledBatch) -> bool:
        """Whether this step's ids may stay on the device until the next step is launched:
        overlap on, a pure decode, every row sampled on the device."""
        if not self.overlap or any(n != 1 for n in batch.num_new):
            return False
        for req in batch.requests:
            if not sampler.batchable(req.params) or req.num_uncomputed != 0:
                return False
            try:
                sampler.check_late(req.params, self.tokenizer.vocab_size)
            except ValueError:
                return False  # the step samples as before, which reports it
        return True

    def _sample_device(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        return sampler.sample_batch(logits, [r.params for r in reqs],
                                    [r.generator.initial_seed() for r in reqs],
                                    [len(r.output_token_ids) for r in reqs])

    def _hold(self, reqs: list[Request], ids: torch.Tensor) -> None:
        """Keep a sampled step in flight: its ids copied to the host without a wait, and a
        placeholder token for each request still going (one that stopped in the step before
        had this row computed in vain)."""
        host, done = sampler.start_read(ids)
        for req in reqs:
            if not req.finished:
                req.output_token_ids.append(PENDING)
        self._inflight = _InFlight(list(reqs), ids, host, done)

    def _launch_after(self, held: _InFlight
                      ) -> tuple[ScheduledBatch, torch.Tensor | None, torch.Tensor | None] | None:
        """The next decode step of the held step's requests, launched with the held ids as its
        input and sampled on the device: (batch, logits or None if the forward failed, ids),
        or None where that step is not certain to be the same batch (module docstring)."""
        reqs = held.requests
        if not self.overlap or self.scheduler.waiting or self.scheduler.running != reqs:
            return None
        for req in reqs:
            if (req.finished or len(req.output_token_ids) >= req.max_tokens
                    or req.num_tokens >= self.max_model_len or req.num_uncomputed != 1):
                return None  # it stops by length with the held token
        if sum(self.scheduler.pages_needed(r, 1) for r in reqs) > self.pool.num_free:
            return None  # pages might mean preempting one of them
        batch = self.scheduler.schedule()
        if batch.requests != reqs or batch.preempted or any(n != 1 for n in batch.num_new):
            raise RuntimeError("overlap: the scheduled batch is not the step in flight's "
                               f"({len(batch)} requests, {len(batch.preempted)} preempted)")
        logits = self._run(batch, held.ids)
        if logits is None:
            return batch, None, None
        return batch, logits, self._sample_device(reqs, logits)

    def _land(self, held: _InFlight) -> list[RequestOutput]:
        """Read a held step's ids (the device has long computed them), put them in place of
        the placeholders and do the step's bookkeeping. Rows of requests that stopped in the
        step before, or were aborted, are dropped."""
        toks = held.read()
        live = []
        for req, tok in zip(held.requests, toks):
            if req.finished or req.finish_reason is not None:
                continue
            req.output_token_ids[-1] = tok
            req.pending_token_ids.append(tok)
            live.append(req)
        return self._postprocess(live)

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[Request]:
        """Sample for each request whose tokens are all computed; errors finish only it.

        On CUDA, rows without penalties or logprobs are sampled together on the device and
        read back at once (the step's one host sync); the others go row by row."""
        sampling = [r for r in batch.requests if r.num_uncomputed == 0]
        together = [i for i, r in enumerate(sampling)
                    if logits.is_cuda and sampler.batchable(r.params)]
        checked = [i for i in together if self._check(sampling[i])]
        if checked:
            self._sample_together(sampling, logits, checked)
        done = set(together)
        for i, (row, req) in enumerate(zip(logits, sampling)):
            if i in done:
                continue
            try:
                self._sample_one(req, row)
            except Exception as e:  # noqa: BLE001 - one request's failure stays its own
                self._fail_request(req, e)
        return sampling

    def _check(self, req: Request) -> bool:
        try:
            sampler.check_late(req.params, self.tokenizer.vocab_size)
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own
            self._fail_request(req, e)
            return False
        return True

    def _fail_request(self, req: Request, e: Exception) -> None:
        req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
        logger.exception("sampling failed for request %s", req.request_id)

    def _sample_together(self, sampling: list[Request], logits: torch.Tensor,
                         rows: list[int]) -> None:
        reqs = [sampling[i] for i in rows]
        if len(rows) < logits.shape[0]:
            logits = logits.index_select(0, sampler.upload(rows, torch.long, logits.device))
        for req, tok in zip(reqs, sampler.read_ids(self._sample_device(reqs, logits))):
            req.output_token_ids.append(tok)
            req.pending_token_ids.append(tok)

    def _sample_one(self, req: Request, row: torch.Tensor) -> None:
        p = req.params
        sampler.check_late(p, self.tokenizer.vocab_size)
        tok = sampler.sample_token(row, p, req.prompt_token_ids, req.output_token_ids,
                                   req.generator)
        req.output_token_ids.append(tok)
        req.pending_token_ids.append(tok)
        if p.logprobs is not None:
            req.pending_logprobs.append(sampler.token_logprob(row, tok, p.logprobs))

    def _postprocess(self, sampled: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in sampled:
            if req.finish_reason is None:
                postprocess.update_text_and_stop(req, self.tokenizer.eos_token_ids,
                                                 self.max_model_len)
            self._counters["gen"] += 1
            if len(req.output_token_ids) == 1:
                self._counters["prompt"] += len(req.prompt_token_ids)
                self._counters["hit"] += req.num_cached_tokens
            if req.finish_reason is not None:
                self._finish(req)
            outputs.append(postprocess.make_output(req))
        return outputs

    def _fail_batch(self, requests: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in requests:
            req.finish_reason, req.error = "error", self._batch_error
            self._finish(req)
            outputs.append(postprocess.make_output(req))
        return outputs

    def _finish(self, req: Request) -> None:
        self.scheduler.finish(req)
        self.runner.release_state(req)
        self._requests.pop(req.request_id, None)

    # ---- state ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self._lock:
            return (self.scheduler.has_unfinished() or bool(self._aborted)
                    or self._inflight is not None)

    def stats(self) -> EngineStats:
        with self._lock:
            s = self.scheduler
            held = {p for r in s.running for p in r.pages}
            return EngineStats(
                num_running=len(s.running),
                num_waiting=len(s.waiting),
                kv_pages_used=len(held),
                kv_pages_cached=self.pool.num_pages - self.pool.num_free - len(held),
                kv_pages_total=self.pool.num_pages,
                prefix_cache_hit_tokens=self._counters["hit"],
                prompt_tokens_total=self._counters["prompt"],
                generation_tokens_total=self._counters["gen"],
                moe_experts=self.moe.counters() if self.moe else None,
                moe_handoff_failures=self.moe.cache.failures if self.moe else 0,
            )

    def running_status(self, request_id: str) -> Status | None:
        req = self._requests.get(request_id)
        return None if req is None else req.status
