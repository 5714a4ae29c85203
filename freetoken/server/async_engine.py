"""The engine on a background thread, fed by the asyncio server.

The `Engine` is not thread-safe, so exactly one thread touches it: it loads the model, then
loops receive -> step -> dispatch. The event loop talks to it through a command queue
("add", "abort") and gets answers through one asyncio queue per HTTP request, filled with
`loop.call_soon_threadsafe`. A client that disconnects closes its `RequestStream`, which sends
"abort" at once, so its KV pages are freed before the next step.

One HTTP request may own several engine requests (OpenAI `n`): their outputs share one queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from freetoken.engine.outputs import RequestOutput
from freetoken.engine.sampling_params import SamplingParams
from freetoken.server.errors import APIError
from freetoken.server.metrics import Metrics

log = logging.getLogger("freetoken.server")


@dataclass
class SubRequest:
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one engine request."""

    stream: RequestStream
    arrival: float
    last: float
    first: bool = True


class RequestStream:
    """Outputs of one HTTP request's engine requests, in the order the engine made them."""

    def __init__(self, owner: AsyncEngine, subs: list[SubRequest]) -> None:
        self.owner = owner
        self.subs = subs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        self.unfinished = {s.engine_id for s in subs}
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Abort whatever has not finished (client gone, or handler done); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.owner._release(self)
        if self.unfinished:
            self.owner._command(("abort", [s.engine_id for s in self.subs]))


class AsyncEngine:
    """Runs `Engine` on a thread; `start()` loads it there so `/health` answers while loading."""

    def __init__(
        self,
        factory: Callable[[], object],
        max_in_flight: int = 256,
        metrics: Metrics | None = None,
    ) -> None:
        self.factory = factory
        self.max_in_flight = max_in_flight
        self.metrics = metrics or Metrics(lambda: self.stats)
        self.engine = None
        self.load_error: str | None = None
        self.stats: object | None = None
        self._commands: queue.Queue = queue.Queue()
        self._streams: set[RequestStream] = set()
        self._tracked: dict[str, _Tracked] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- event-loop side ------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.engine is not None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="freetoken-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._command(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def submit(self, subs: list[SubRequest]) -> RequestStream:
        """Hand requests to the engine; raises APIError (400 bad input, 503 busy / loading)."""
        if not self.ready:
            raise APIError(503, self.load_error or "the model is still loading; retry shortly")
        if len(self._streams) >= self.max_in_flight:
            raise APIError(
                503, f"server overloaded: {len(self._streams)} requests in flight "
                f"(limit {self.max_in_flight}); retry later"
            )
        stream = RequestStream(self, subs)
        self._streams.add(stream)
        self.metrics.in_flight.set(len(self._streams))
        self._command(("add", stream))
        try:
            await stream.accepted
        except BaseException:
            stream.close()
            raise
        return stream

    def _release(self, stream: RequestStream) -> None:
        self._streams.discard(stream)
        self.metrics.in_flight.set(len(self._streams))

    def _command(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    def _post(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the event loop (from the engine thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    # -- engine-thread side ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self.factory()
        except Exception as e:  # noqa: BLE001 - shown on /health and in the log
            self.load_error = f"model failed to load: {e}"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        self.stats = engine.stats()
        self.engine = engine
        while not self._stop.is_set():
            self._receive(block=not engine.has_unfinished())
            if engine.has_unfinished():
                self._step(engine)
            self.stats = engine.stats()

    def _receive(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            self._add(arg)
        elif kind == "abort":
            for rid in arg:
                if self._tracked.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    self.metrics.finished.labels("abort").inc()

    def _add(self, stream: RequestStream) -> None:
        if stream.closed:  # the client left before we got to it
            return
        added: list[str] = []
        try:
            for sub in stream.subs:
                self.engine.add_request(sub.engine_id, sub.prompt_token_ids, sub.params)
                added.append(sub.engine_id)
        except Exception as e:  # noqa: BLE001 - ValueError is the user's, others are ours
            for rid in added:
                self.engine.abort(rid)
            status = 400 if isinstance(e, ValueError) else 500
            self._post(_set_exception, stream.accepted, APIError(status, str(e)))
            return
        now = time.perf_counter()
        for sub in stream.subs:
            self._tracked[sub.engine_id] = _Tracked(stream, now, now)
            self.metrics.prompt_tokens.inc(len(sub.prompt_token_ids))
        self._post(_set_result, stream.accepted, None)

    def _step(self, engine) -> None:
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - a broken step must not kill the server
            log.error("engine step failed\n%s", traceback.format_exc())
            self._fail_all(engine, f"internal engine error: {e}")
            return
        now = time.perf_counter()
        for out in outputs:
            tr = self._tracked.get(out.request_id)
            if tr is None:
                continue  # aborted meanwhile
            self.metrics.observe_tokens(len(out.new_token_ids), tr.first, now - tr.last)
            if out.new_token_ids:
                tr.first, tr.last = False, now
            if out.finished:
                del self._tracked[out.request_id]
                self.metrics.finished.labels(out.finish_reason).inc()
                self.metrics.e2e.observe(now - tr.arrival)
            self._post(tr.stream.queue.put_nowait, out)

    def _fail_all(self, engine, message: str) -> None:
        for rid, tr in list(self._tracked.items()):
            engine.abort(rid)
            self._post(tr.stream.queue.put_nowait, APIError(500, message))
        self._tracked.clear()


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
