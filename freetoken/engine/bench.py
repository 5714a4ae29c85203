"""`ft bench decode` and `ft bench prefill`: engine speed next to the memory roofline.

Decode: for each batch size B, B requests with random prompts of `prompt_len` tokens are
prefilled, `warmup` decode steps run untimed (graph capture, autotuning), then `tokens` decode
steps of B tokens each are timed through `Engine.step()` (schedule, forward, sample, detokenize:
what a served token costs). Reported per B: tokens/s, ms per step, the weight bytes a step reads,
those bytes over the step time, and that as a share of the device's memory bandwidth measured
in the same run (a device copy on CUDA, read + write; a large tensor read on the CPU).

Weight bytes per step: every dense matrix (attention, dense MLPs, shared experts, routers,
lm_head or the tied embedding table) once, plus the routed experts the step touches. With
uniform routing a layer of E experts and top-k touches E * (1 - (1 - k/E)^B) distinct experts
at batch B, which this counts; random weights route about uniformly.

Prefill: one request per prompt length, `max_tokens=1`; prompt tokens/s over the time to the
first token. Prompts are fresh random ids every time, so the prefix cache never helps.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

import torch

from freetoken.config import EngineConfig
from freetoken.engine.sampling_params import SamplingParams


@dataclass
class DecodeResult:
    batch: int
    steps: int
    seconds: float
    tokens_per_s: float
    ms_per_step: float
    weight_bytes_per_step: int
    achieved_gbps: float
    roofline_pct: float


@dataclass
class PrefillResult:
    prompt_len: int
    seconds: float
    tokens_per_s: float


# ---- the roofline -----------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int | None = None,
                      repeats: int = 5) -> tuple[float, str]:
    """(GB/s, how): best of `repeats` copies of a large device buffer (bytes read + written)
    on CUDA; on the CPU a large float32 tensor summed (bytes read)."""
    if device.type == "cuda":
        n = nbytes or 2 << 30
        src = torch.empty(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        best = min(_timed(lambda: dst.copy_(src), device) for _ in range(repeats))
        return 2 * n / best / 1e9, f"device copy of {n >> 20} MiB, read + write"
    n = nbytes or 512 << 20  # beyond any last-level cache
    x = torch.ones(n // 4, dtype=torch.float32)
    best = min(_timed(x.sum, device) for _ in range(max(2, repeats // 2)))
    return n / best / 1e9, f"sum of a {n >> 20} MiB tensor, bytes read"


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


# ---- bytes a decode step reads ----------------------------------------------------------------
def step_weight_bytes(model, batch: int) -> int:
    """Weight bytes one decode step of `batch` tokens reads (see module docstring)."""
    from freetoken.layers.embedding import Embedding
    from freetoken.layers.linear import Linear
    from freetoken.layers.moe import FusedExperts

    total = 0
    for mod in model.modules():
        if isinstance(mod, Linear):
            total += sum(w.nbytes() for w in mod.weights)
        elif isinstance(mod, FusedExperts) and mod.bank is not None:
            b, s = mod.bank, mod.spec
            per_expert = (b.w13.nbytes() + b.w2.nbytes()) / b.num_experts
            touched = s.num_experts * (1 - (1 - s.top_k / s.num_experts) ** batch)
            total += int(per_expert * touched)
        elif isinstance(mod, Embedding) and mod.weight is not None:
            rows = mod.weight.nbytes() / mod.vocab_size
            tied = model.lm_head is None  # the table is the output projection too
            total += mod.weight.nbytes() if tied else int(rows * batch)
    return total


# ---- driving the engine -----------------------------------------------------------------------
def bench_config(config: EngineConfig, batches: list[int], prompt_len: int, tokens: int,
                 warmup: int, prompt_lens: list[int]) -> EngineConfig:
    """`config` with room for the largest batch and prompt: enough running requests, KV
    pages (unless --num-pages was given) and a prefill budget of one whole prompt."""
    ps = config.page_size
    per_req = -(-(prompt_len + tokens + warmup + max(batches) + 2) // ps)
    pages = max([max(batches) * per_req] + [-(-(n + 2) // ps) for n in prompt_lens])
    return replace(
        config, max_running_requests=max(config.max_running_requests, max(batches)),
        max_prefill_tokens=max([config.max_prefill_tokens, prompt_len] + prompt_lens),
        num_pages=config.num_pages or pages + max(batches) + 8)


class Runner:
    """One engine, several measurements; random prompt ids from a seeded generator."""

    def __init__(self, engine):
        self.engine = engine
        self.vocab = engine.model.config.vocab_size
        self.gen = torch.Generator().manual_seed(1234)
        self.count = 0

    def _prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def _add(self, prompt_len: int, max_tokens: int) -> str:
        self.count += 1
        rid = f"bench-{self.count}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, self._prompt(prompt_len), params)
        return rid

    def _outputs(self) -> list:
        """One engine step's outputs. Errors stop the bench."""
        if not self.engine.has_unfinished():
            raise RuntimeError("the engine finished every request before the bench did")
        outs = self.engine.step()
        for o in outs:
            if o.finish_reason == "error":
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
        return outs

    def _step(self) -> int:
        """One engine step; the number of tokens it produced."""
        return len(self._outputs())

    def decode(self, batch: int, prompt_len: int, tokens: int, warmup: int) -> tuple[int, float]:
        """(tokens produced, seconds) over `tokens` timed steps of `batch` decodes."""
        # Early requests decode while later ones still prefill (chunked): never run out.
        rids = [self._add(prompt_len, tokens + warmup + batch + 2) for _ in range(batch)]
        first = 0
        while first < batch:  # each request samples its first token at the end of its prefill
            first += sum(1 for o in self._outputs() if len(o.output_token_ids) == 1)
        for _ in range(warmup):
            self._step()
        dev = self.engine.device
        _sync(dev)
        t0 = time.perf_counter()
        made = sum(self._step() for _ in range(tokens))
        _sync(dev)
        dt = time.perf_counter() - t0
        for rid in rids:
            self.engine.abort(rid)
        self.drain()
        return made, dt

    def prefill(self, prompt_len: int) -> float:
        """Seconds from adding one prompt to its first token."""
        _sync(self.engine.device)
        t0 = time.perf_counter()
        self._add(prompt_len, 1)
        self.drain()
        _sync(self.engine.device)
        return time.perf_counter() - t0

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self._outputs()


def run_decode(runner: Runner, batches: list[int], prompt_len: int, tokens: int, warmup: int,
               bandwidth_gbps: float) -> list[DecodeResult]:
    results = []
    for b in batches:
        made, dt = runner.decode(b, prompt_len, tokens, warmup)
        if made != b * tokens:
            raise RuntimeError(f"batch {b}: {made} tokens in {tokens} steps, expected "
                               f"{b * tokens} (were requests preempted? raise --kv-cache-mb)")
        nbytes = step_weight_bytes(runner.engine.model, b)
        gbps = nbytes * tokens / dt / 1e9
        results.append(DecodeResult(
            batch=b, steps=tokens, seconds=dt, tokens_per_s=made / dt,
            ms_per_step=dt / tokens * 1e3, weight_bytes_per_step=nbytes, achieved_gbps=gbps,
            roofline_pct=100 * gbps / bandwidth_gbps))
    return results


def run_prefill(runner: Runner, prompt_lens: list[int], warmup: int) -> list[PrefillResult]:
    for n in prompt_lens * warmup:  # each shape once: kernels compile / tune per shape
        runner.prefill(n)
    results = []
    for n in prompt_lens:
        dt = runner.prefill(n)
        results.append(PrefillResult(prompt_len=n, seconds=dt, tokens_per_s=n / dt))
    return results


# ---- the command ------------------------------------------------------------------------------
def _describe(config: EngineConfig, engine) -> dict:
    cfg = engine.model.config
    return {"model": config.model, "arch": cfg.arch, "layers": cfg.num_layers,
            "dummy_weights": config.dummy_weights,
            "dummy_format": config.dummy_format if config.dummy_weights else None,
            "moe_backend": config.moe_backend, "device": str(engine.device),
            "device_name": torch.cuda.get_device_name(engine.device)
            if engine.device.type == "cuda" else "cpu", "dtype": str(engine.dtype)}


def _print_decode(rows: list[DecodeResult]) -> None:
    print(f"{'batch':>5} {'tok/s':>10} {'ms/step':>9} {'weight MB/step':>15} {'GB/s':>8} "
          f"{'% roofline':>11}")
    for r in rows:
        print(f"{r.batch:>5} {r.tokens_per_s:>10.1f} {r.ms_per_step:>9.2f} "
              f"{r.weight_bytes_per_step / 1e6:>15.1f} {r.achieved_gbps:>8.1f} "
              f"{r.roofline_pct:>10.1f}%")


def _print_prefill(rows: list[PrefillResult]) -> None:
    print(f"{'prompt':>7} {'prompt tok/s':>13} {'seconds':>9}")
    for r in rows:
        print(f"{r.prompt_len:>7} {r.tokens_per_s:>13.1f} {r.seconds:>9.3f}")


def _profile_step(runner: Runner, batch: int, prompt_len: int, path: str) -> None:
    """A torch.profiler trace of one decode step at `batch` (chrome trace in `path`)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(batch):
        runner._add(prompt_len, 4)
    while not all(len(r.output_token_ids) for r in runner.engine.scheduler.running) or \
            runner.engine.scheduler.waiting:
        runner._step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                     if runner.engine.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        runner._step()
        _sync(runner.engine.device)
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    runner.drain()


def main(config: EngineConfig, *, batches: list[int], prompt_len: int, tokens: int,
         warmup: int, prompt_lens: list[int], decode: bool, prefill: bool,
         json_path: str | None = None, profile_path: str | None = None,
         torch_threads: int | None = None) -> dict:
    """Run the decode and / or prefill measurements, print tables, optionally write JSON."""
    if min(batches + [prompt_len, tokens] + prompt_lens) < 1 or warmup < 0:
        raise ValueError("--batch, --prompt-len, --tokens and --prompt-lens must be positive, "
                         "--warmup not negative")
    threads = torch.get_num_threads()
    if torch_threads is not None:
        # NOTE: on a CPU shared with other jobs, an intra-op thread that is not scheduled
        # stalls every op at its barrier: 1 thread made a tiny model's step 100x faster on
        # the busy 2-core CI machine.
        torch.set_num_threads(torch_threads)
    try:
        return _main(config, batches, prompt_len, tokens, warmup, prompt_lens, decode, prefill,
                     json_path, profile_path)
    finally:
        torch.set_num_threads(threads)


def _main(config: EngineConfig, batches: list[int], prompt_len: int, tokens: int, warmup: int,
          prompt_lens: list[int], decode: bool, prefill: bool, json_path: str | None,
          profile_path: str | None) -> dict:
    from freetoken.engine.engine import Engine
    from freetoken.models.dummy import IdTokenizer

    config = bench_config(config, batches, prompt_len, tokens, warmup,
                          prompt_lens if prefill else [])
    # Prompts are token ids: no tokenizer is built (a GGUF's may be slow or unsupported).
    tokenizer = IdTokenizer(1)
    engine = Engine(config, tokenizer=tokenizer)
    tokenizer.vocab_size = engine.model.config.vocab_size
    runner = Runner(engine)
    report = _describe(config, engine)
    report["torch_threads"] = torch.get_num_threads()
    print(", ".join(f"{k} {v}" for k, v in report.items()))
    if decode:
        bw, how = measure_bandwidth(engine.device)
        report.update(bandwidth_gbps=bw, bandwidth_method=how, prompt_len=prompt_len)
        print(f"memory bandwidth {bw:.1f} GB/s ({how}); prompt {prompt_len} tokens, "
              f"{tokens} timed steps after {warmup} warm-up")
        rows = run_decode(runner, batches, prompt_len, tokens, warmup, bw)
        _print_decode(rows)
        report["decode"] = [asdict(r) for r in rows]
    if prefill:
        rows_p = run_prefill(runner, prompt_lens, min(warmup, 1))
        _print_prefill(rows_p)
        report["prefill"] = [asdict(r) for r in rows_p]
    if profile_path:
        _profile_step(runner, batches[0], prompt_len, profile_path)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report
