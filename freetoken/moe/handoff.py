"""The hand-off between the device and the CPU executor for the cpu and hybrid backends (and
offload's leftovers inside a CUDA graph): one pinned host buffer, a C++ worker thread that
answers jobs in it, and a producer that writes them.

A layer call's CPU share goes like this (DESIGN.md: cache decisions never leave the GPU
inside a graph, and neither does the hand-off):
1. the producer writes the job (ids, routing weights, the layer's expert -> slot map after
   the plan, x) and posts its number in `go`;
2. the worker (csrc/cpu_moe/handoff.cpp, no Python, no CUDA call) sees it, computes the routes
   whose expert has no slot on live rows with the executor, writes `out` and sets `done`;
3. meanwhile the device fetches and computes its own routes; then it waits for `done` and
   adds `out`.
On a GPU the producer is the slot plan kernel, which posts the job once it has written the map
(kernels/triton/slot_plan.py; `send` where the plan runs as torch ops), and the receive kernel
(kernels/triton/handoff.py), so the whole step can be captured; the token count of a graph's
step (its padding rows are not computed) is written to the buffer's `live` word and copied to
the device by the host before each replay. With the CPU standing in as the
device, the producer is a few tensor copies and `post` / `wait` from Python: the worker and
its compaction are the same code as on a GPU.

Warming (FREETOKEN_MOE_PREFETCH=1, off by default): between two jobs the worker waits for
the device's next layer (its attention and router: tens of microseconds at decode), and the
host's memory is idle. So while job n runs, the producer also posts a hint (`hint`): the
next MoE layer's router applied to this layer's input x (the residual stream changes little
from one layer to the next, so it mostly picks the experts the next layer will), less the
experts that layer holds in slots, in the slot plan's fetch order. After answering job n the
worker drops the ones the device will fetch (the fetch table at their count; under hybrid's
split, where the worker copied a experts of that layer ahead, F(count + a) - a: the plan
counts hits on them as fetches; after a fill kernel's copies it does not know a) and has the
executor's threads read their shares of the rest into their caches until job n + 1 arrives
(Executor::warm). Results do not change (a warmed row is the same bytes); `prefetch_stats`
says how often the guess was right.

Copies ahead (fetching ahead, moe/expert_cache.py): the slot plan gives some of the next MoE
layer's predicted misses slots while a job runs; `post_ahead` lists them (expert, slot) in
the buffer, and after answering the job the worker copies them from the host banks into
their slots (on a GPU with the copy engine, on a stream of its own: no SM is taken from the
device's attention and router, which run then) and sets `ahead_done` once they are complete;
the next layer's call waits for it (`wait_ahead`) before it reads those slots.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from freetoken import env
from freetoken.moe.banks import ExpertBank
from freetoken.moe.cpu_executor import ACTIVATIONS, _ext, make_bank

# bytes; each word on a cache line of its own (the worker polls `go`, the GPU `done`)
_HEADER = {"go": 0, "done": 64, "live": 128, "error": 192, "timeout": 196, "job": 256}
_XDT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The worker polls without sleeping this long after a job: on a GPU a decode step's layers
# come tens of microseconds apart; with the CPU standing in as the device the producer
# computes on the same cores, and a spinning worker would take one from it.
SPIN_US = {"cuda": 50_000, "cpu": 200}
WAIT_TIMEOUT_S = 60.0  # the host's wait for an answer (the GPU's: kernels/triton/handoff.py)
# Experts a hint lists (the next layer's predicted misses; csrc/cpu_moe/handoff.h); hints are
# posted for calls of at most HINT_ROUTES routes (decode)
HINT_MAX = 64
HINT_ROUTES = 64
# Experts an ahead list holds (fetching ahead plans at most min(E, routes) of a call of at
# most HINT_ROUTES routes)
AHEAD_MAX = HINT_ROUTES


def _align(n: int, a: int = 64) -> int:
    return -(-n // a) * a


def layout(max_tokens: int, top_k: int, num_experts: int, hidden: int) -> dict[str, int]:
    """Byte offsets of the buffer's fields (csrc/cpu_moe/handoff.h), and its size."""
    off = dict(_HEADER)
    o = off["job"] + 64
    for name, nbytes in (("ids", max_tokens * top_k * 4), ("weights", max_tokens * top_k * 4),
                         ("map", num_experts * 4), ("x", max_tokens * hidden * 4),
                         ("out", max_tokens * hidden * 4), ("hint", 16 + HINT_MAX * 4),
                         ("ahead", 2 * (16 + AHEAD_MAX * 8)), ("ahead_done", 4)):
        off[name] = o
        o = _align(o + nbytes)
    off["size"] = o
    off.update(max_tokens=max_tokens, top_k=top_k, num_experts=num_experts, hidden=hidden,
               hint_max=HINT_MAX, ahead_max=AHEAD_MAX)
    return off


class Handoff:
    """The buffer, the worker and the producer for every MoE layer of one model.

    executor: a CpuMoeExecutor (the worker is its only user while it runs); banks: each MoE
    layer's bank in the executor's layout; max_tokens: the most tokens of a call it takes.
    """

    def __init__(self, executor, banks: list[ExpertBank], top_k: int, device: torch.device,
                 max_tokens: int):
        b0 = banks[0]
        self.device = torch.device(device)
        self.off = layout(max_tokens, top_k, b0.num_experts, b0.hidden)
        self.max_tokens = max_tokens
        pin = self.device.type == "cuda"
        self.buf = torch.zeros(self.off["size"], dtype=torch.uint8, pin_memory=pin)
        # The host reads and writes the header words through numpy (the buffer may be made
        # under inference mode, whose tensors refuse in-place writes outside it: the engine
        # checks errors after the step, outside); the plan kernel reads `live` as a tensor.
        words = self.buf.numpy().view(np.int32)
        self._host = {k: words[self.off[k] // 4:self.off[k] // 4 + 1]
                      for k in ("live", "error", "timeout")}
        w = self.off["live"] // 4
        self._live = self.buf.view(torch.int32)[w:w + 1]
        # On a GPU the plan kernel reads a device copy of `live`, refreshed by set_live: a
        # read of the pinned word over PCIe was the first link (1-2 us) of every layer's plan.
        # Made outside inference mode, so that set_live may update it in and outside it.
        with torch.inference_mode(False):
            self._live_dev = (torch.zeros(1, dtype=torch.int32, device=self.device)
                              if pin else self._live)
        self._executor = executor
        self._worker = _ext().HandoffWorker(executor._ex, self.buf.data_ptr(),
                                            {k: v for k, v in self.off.items() if k != "size"},
                                            SPIN_US.get(self.device.type, 200))
        self._banks = banks  # the worker reads them: keep them alive
        for i, b in enumerate(banks):
            self._worker.set_layer(i, make_bank(b.w13, "w13"), make_bank(b.w2, "w2"),
                                   b.scales.data_ptr())
        # the job number: a device counter on a GPU (kernels advance it), else host-side
        self.seq = torch.zeros(1, dtype=torch.int32, device=self.device) if pin else None
        # on a GPU: nanoseconds the receive kernels polled for answers, and their calls
        with torch.inference_mode(False):
            self._waits = torch.zeros(2, dtype=torch.int64, device=self.device) if pin else None
        self._n = 0
        # copies ahead (`start_copies`): off until started
        self.copies = False
        self._ahead_n = 0  # with the CPU standing in: the last list posted, per layer its own
        self._ahead_want: dict[int, int] = {}
        self._copy_stream = None
        # set when check() reported a failure, until the owner has drained and recovered
        self.failed = False

    def close(self) -> None:
        """Stop the worker (before the buffer it polls is freed)."""
        self._worker = None

    def set_prefetch(self, on: bool, fetch_table: list[int] | None = None,
                     ahead_counts: bool = False) -> None:
        """Warming on or off (module doc); fetch_table[M]: how many of M missing experts the
        device fetches (the policy's table, capped; None: none); ahead_counts: the plan counts
        hits on slots filled ahead as fetches (hybrid's split: the worker then skips F(M + a)
        - a, a the experts of the layer's ahead list it copied). Between steps only."""
        self._worker.set_prefetch(bool(on), [int(f) for f in (fetch_table or [])],
                                  bool(ahead_counts))

    def prefetch_stats(self) -> dict[str, int]:
        """Since the buffer was made: `hints` (jobs after which the worker warmed experts),
        `warmed` (experts warmed fully), `used` (of those, the ones the next job of that layer
        computed) and `cpu` (the CPU experts of those next jobs)."""
        return dict(zip(("hints", "warmed", "used", "cpu"), self._worker.prefetch_stats()))

    def hint(self, layer: int, ids: torch.Tensor, emap: torch.Tensor) -> None:
        """Post the hint for MoE layer `layer`: ids [T, k] its predicted routes (rows past
        `live` ignored), emap [E] its expert -> slot map now. On a GPU a kernel writes it (no
        host sync) after the job it goes with was posted, tagged with the job counter; else
        the host, before that job is posted, tagged with the number `send` will give it."""
        if self.seq is not None:
            from freetoken.kernels.triton.handoff import post_hint

            post_hint(ids, emap, self._live_dev, self.seq, self.buf, self.off, layer)
            return
        live = int(self._host["live"][0])
        order, misses = hint_order(ids[:live], emap)
        words = self.buf.numpy().view(np.int32)
        h = self.off["hint"] // 4
        words[h + 4:h + 4 + len(order)] = order
        words[h + 1], words[h + 2] = layer, misses
        words[h] = (self._n + 1) & 0xFFFFFFFF  # the tag last

    def start_copies(self, pool: torch.Tensor, slot_bytes: int,
                     layers: list[list[tuple[int, int, int]]]) -> str | None:
        """Let the worker copy ahead lists into the slot pool (module doc). layers: per MoE
        layer its parts as (host address of expert 0, bytes per expert, offset in a slot).
        On a GPU the worker queues the driver's copies on a stream of its own and marks them
        complete with a stream write, found here in libcuda (`moe/h2d.py`). Returns None, or
        why the copies cannot be the worker's on this machine (the caller keeps its fill
        kernel)."""
        for i, parts in enumerate(layers):
            self._worker.set_copy_layer(i, [int(v) for p in parts for v in p])
        self._worker.set_ahead_delay(env.moe_ahead_delay_us())
        n = len(layers)
        if self.seq is None:
            self._worker.set_copier(pool.data_ptr(), slot_bytes, 0, 0, 0, 0, 0)
        else:
            from freetoken.moe.h2d import copier_entry_points

            stream = torch.cuda.Stream(self.device)
            done = self.buf.data_ptr() + self.off["ahead_done"]
            got = copier_entry_points(stream, done)
            if isinstance(got, str):
                return got
            self._copy_stream = stream  # the worker queues on it: keep it
            self._worker.set_copier(pool.data_ptr(), slot_bytes, *got, stream.cuda_stream)
            with torch.inference_mode(False):
                self._ahead_seq = torch.zeros(1, dtype=torch.int32, device=self.device)
                self._ahead_want_dev = torch.zeros(max(1, n), dtype=torch.int32,
                                                   device=self.device)
            self._load_ahead_kernels()
        self.copies = True
        return None

    def _load_ahead_kernels(self) -> None:
        """Compile and load the post and wait kernels now, while the device is idle, by an
        empty list for MoE layer 0 and its wait: a kernel module loaded while the device
        waits for the worker's copies holds the driver that the worker's copy calls need
        (`kernels/triton/handoff.py: post_ahead`)."""
        self.post_ahead(0, torch.full((2, 1), -1, dtype=torch.int64, device=self.device))
        self.wait_ahead(0)
        torch.cuda.synchronize(self.device)
        self.check()

    def post_ahead(self, layer: int, fetched: torch.Tensor) -> None:
        """List layer `layer`'s experts given slots ahead (fetched int64 [2, n]: (expert,
        slot), -1 = none) for the worker to copy after the job now running; on a GPU a kernel
        writes it (no host sync) and notes the list's number for `wait_ahead`."""
        if self.seq is not None:
            from freetoken.kernels.triton.handoff import post_ahead

            post_ahead(fetched, self._ahead_seq, self._ahead_want_dev, self.buf, self.off, layer)
            return
        rows = fetched[:, fetched[0] >= 0].to(torch.int32).t().contiguous()
        a = (self._ahead_n + 1) & 0xFFFFFFFF
        words = self.buf.numpy().view(np.int32)
        h = (self.off["ahead"] + (a & 1) * (16 + 8 * self.off["ahead_max"])) // 4
        words[h + 4:h + 4 + rows.numel()] = rows.flatten().numpy()
        words[h + 1], words[h + 2] = layer, rows.shape[0]
        words[h] = a  # the tag last
        self._ahead_n = a
        self._ahead_want[layer] = a

    def wait_ahead(self, layer: int) -> None:
        """Before layer `layer`'s call reads its slots: wait until the worker's copies of
        the list posted for it are complete (on a GPU a kernel polls, bounded like the
        receive's wait; with the CPU standing in the host)."""
        if self.seq is not None:
            from freetoken.kernels.triton.handoff import wait_ahead

            wait_ahead(self._ahead_want_dev, layer, self.buf, self.off)
            return
        a = self._ahead_want.pop(layer, None)
        if a is not None and not self._worker.wait_ahead(a, WAIT_TIMEOUT_S):
            self._host["error"][0] = 1
            self.check()

    def drain(self, timeout_s: float = WAIT_TIMEOUT_S) -> bool:
        """Wait until the worker has answered the last job posted and completed the copies of
        the last ahead list posted; the device must post nothing meanwhile (idle). After a
        failed step (a wait that timed out) the worker may still be at work on that step: a
        late copy would land in a slot that a later plan gave another expert. False after
        timeout_s."""
        words = self.buf.numpy().view(np.uint32)
        o = self.off

        def word(name: str) -> int:
            return int(words[o[name] // 4])

        area = (16 + 8 * o["ahead_max"]) // 4
        t0, t1 = (int(words[o["ahead"] // 4 + i * area]) for i in (0, 1))
        last = t0 if _wrapped(t0 - t1) > 0 else t1  # the newer list's number (0: none yet)
        start = time.monotonic()
        while word("done") != word("go") or (last and _wrapped(word("ahead_done") - last) < 0):
            if time.monotonic() - start > timeout_s:
                return False
            time.sleep(1e-4)
        return True

    def ahead_stats(self) -> dict[str, int]:
        """Since the worker started: ahead `lists` served and experts `copied`."""
        return dict(zip(("lists", "copied"), self._worker.ahead_stats()))

    def __del__(self):
        self.close()

    @property
    def jobs(self) -> int:
        return self._worker.jobs if self._worker is not None else 0

    def set_trace(self, on: bool) -> None:
        """Start (clearing it) or stop the worker's per-job timing record."""
        self._worker.set_trace(on)

    def trace(self) -> np.ndarray:
        """The record since set_trace(True), int64 [jobs, 7]: go seen, executor start,
        executor end, done set (steady-clock microseconds), rows and routes computed, and
        when the worker was free again (the copies ahead it queued and its warming done
        after the answer). Read it between steps (no job running)."""
        return np.asarray(self._worker.trace(), dtype=np.int64).reshape(-1, 7)

    def device_waits(self) -> tuple[float, int] | None:
        """(microseconds the device's receive kernels waited for the CPU's answers, calls)
        since the buffer was made, on a GPU (a sync: read it between steps); else None."""
        if self._waits is None:
            return None
        from freetoken.engine.sampler import read_ids

        ns, calls = read_ids(self._waits)  # not a pageable copy: see SlotCache.read_counters
        return ns / 1e3, calls

    @property
    def live(self) -> torch.Tensor:
        """The `live` word as an int32 [1] tensor on the device (the plan kernel reads it on a
        GPU; the worker reads the pinned word)."""
        return self._live_dev

    def set_live(self, n: int) -> None:
        """Real tokens of the coming step (a CUDA graph's padding rows are not computed): the
        pinned word, and on a GPU its device copy (an async copy on the current stream, before
        the step's kernels). The worker reads the pinned word while a step runs: a step is
        launched before the one before it has finished only by the engine's overlap, which
        does so for the same batch alone (engine/engine.py), so the word keeps its value."""
        self._host["live"][0] = n
        if self._live_dev is not self._live:
            self._live_dev.copy_(self._live, non_blocking=True)

    def job(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
            activation: str):
        """On a GPU, layer `layer`'s job as the kernels that post it take it
        (`kernels/triton/handoff.job_args`): the slot plan kernel posts it with the map it
        writes (moe/expert_cache.py). None with the CPU standing in as the device."""
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"hand-off: {T} tokens in one call, at most {self.max_tokens}")
        if self.seq is None:
            return None
        from freetoken.kernels.triton.handoff import job_args

        return job_args(x, ids, w, self.seq, self.buf, self.off, layer,
                        ACTIVATIONS[activation], _XDT[x.dtype])

    def send(self, layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
             emap: torch.Tensor, activation: str) -> None:
        """Post layer `layer`'s job: its routes whose expert maps to -1 go to the CPU."""
        job = self.job(layer, x, ids, w, activation)
        if job is not None:
            from freetoken.kernels.triton.handoff import send

            send(job, emap)
            return
        T, H = x.shape
        act = ACTIVATIONS[activation]
        xdt = _XDT[x.dtype]
        k = ids.shape[1]
        o = self.off
        self.buf[o["job"]:o["job"] + 16].view(torch.int32).copy_(
            torch.tensor([layer, T, act, xdt], dtype=torch.int32))
        self.buf[o["ids"]:o["ids"] + T * k * 4].view(torch.int32).copy_(ids.reshape(-1))
        self.buf[o["weights"]:o["weights"] + T * k * 4].view(torch.float32).copy_(
            w.reshape(-1))
        self.buf[o["map"]:o["map"] + emap.numel() * 4].view(torch.int32).copy_(emap)
        nx = T * H * x.element_size()
        self.buf[o["x"]:o["x"] + nx].view(x.dtype).copy_(x.reshape(-1))
        self._n = (self._n + 1) & 0xFFFFFFFF
        self._worker.post(self._n)

    def receive(self, y: torch.Tensor, shared: tuple | None = None, fold=None) -> torch.Tensor:
        """y + the CPU's part of the last job (in y's dtype, summed in fp32). shared, on a GPU
        only: the shared expert's (sh, x, gate row or None) added in the same launch, with the
        bits of its own launch before (`kernels/triton/handoff.receive_add`). fold: the
        residual step after it (`kernels/norm.py` NormFold), computed in the same launch on
        a GPU (with a shared expert where `glu.gate_folds`; the output then carries
        it), else ignored."""
        if self.seq is not None:
            from freetoken.kernels.triton.handoff import receive_add

            return receive_add(y, self.seq, self.buf, self.off, self._waits, shared, fold)
        if shared is not None:
            raise ValueError("hand-off: the receive adds a shared expert on a GPU only")
        if not self._worker.wait(self._n, WAIT_TIMEOUT_S):
            self._host["error"][0] = 1
            self.check()
        T, H = y.shape
        o = self.off["out"]
        out = self.buf[o:o + T * H * 4].view(torch.float32).view(T, H)
        return (y.float() + out).to(y.dtype)

    def check(self) -> None:
        """Raise the worker's error, or a GPU wait that timed out, once (then clear it, and
        set `failed` for the owner's recovery: moe/expert_cache.py `after_step`)."""
        if int(self._host["error"][0]):
            self._host["error"][0] = 0
            self.failed = True
            raise RuntimeError(f"CPU MoE hand-off failed: {self._worker.last_error}")
        if int(self._host["timeout"][0]):
            self._host["timeout"][0] = 0
            self.failed = True
            raise RuntimeError("CPU MoE hand-off: the GPU waited more than its timeout for the "
                               "CPU worker's answer or its copies ahead; that step's MoE "
                               "outputs are wrong")


def _wrapped(d: int) -> int:
    """A difference of two uint32 sequence numbers as a signed one (they wrap)."""
    return (d + 2**31) % 2**32 - 2**31


def hint_order(ids: torch.Tensor, emap: torch.Tensor) -> tuple[list[int], int]:
    """(the first HINT_MAX, how many) of the experts of routes ids [T, k] that emap [E] maps to
    no slot, in the slot plan's fetch order: most-routed first, then the lower id (the
    reference of the GPU's hint kernel)."""
    E = emap.numel()
    counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)[:E]
    cand = torch.nonzero((counts > 0) & (emap.cpu() < 0)).flatten()
    # ascending (-count, id): the ids are distinct, so the key is too
    cand = cand[torch.argsort(-counts[cand] * E + cand)]
    return cand[:HINT_MAX].tolist(), cand.numel()
