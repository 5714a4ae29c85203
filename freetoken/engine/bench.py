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

MoE cache backends (offload, cpu, hybrid; `moe_runs` sweeps several on one loaded model):
each decode row also gives the expert-cache counters of its timed steps (hit rate, experts
fetched and computed on the CPU per step) and a ceiling: with uniform routing a step misses
L * E * (1 - (1 - k/E)^B) * (1 - rate) experts, whose bytes must cross the host's side at the
bandwidth `ft bench bw` measured (its profile: PCIe alone for offload, the executor alone for
cpu, both at once for hybrid); ceiling tokens/s = B / (those bytes / that bandwidth). The
device's own work is not in it, so the ceiling is an upper bound.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace

import torch

from freetoken.config import EngineConfig
from freetoken.engine import host_noise
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
    moe_backend: str | None = None  # offload / cpu / hybrid rows: the expert cache
    moe_cache_rate: float | None = None
    hit_rate: float | None = None  # of the distinct experts each layer call routes to
    fetched_per_step: float | None = None
    cpu_per_step: float | None = None
    ceiling_tokens_per_s: float | None = None  # see the module docstring
    ceiling_pct: float | None = None
    # the host during the timed steps (engine/host_noise.py; None off Linux): CPU time the
    # hypervisor gave other guests, and this process's threads descheduled against their will
    steal_pct: float | None = None
    preempted_per_step: float | None = None


@dataclass
class PrefillResult:
    prompt_len: int
    seconds: float
    tokens_per_s: float
    moe_backend: str | None = None
    moe_cache_rate: float | None = None
    fetched: int | None = None  # experts copied to the device during the prefill
    ceiling_tokens_per_s: float | None = None  # prompt / (routed expert bytes / PCIe GB/s)
    ceiling_pct: float | None = None


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
        self.noise: host_noise.HostNoise | None = None  # of the last `decode`

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

    def moe_counters(self) -> dict[str, int] | None:
        moe = self.engine.moe
        return moe.counters() if moe is not None else None

    def decode(self, batch: int, prompt_len: int, tokens: int, warmup: int
               ) -> tuple[int, float, dict[str, int] | None]:
        """(tokens produced, seconds, expert-cache counters or None) over `tokens` timed steps
        of `batch` decodes; what the host did meanwhile is left in `self.noise`
        (`host_noise.between`, None off Linux)."""
        # Early requests decode while later ones still prefill (chunked): never run out.
        rids = [self._add(prompt_len, tokens + warmup + batch + 2) for _ in range(batch)]
        first = 0
        while first < batch:  # each request samples its first token at the end of its prefill
            first += sum(1 for o in self._outputs() if len(o.output_token_ids) == 1)
        for _ in range(warmup):
            self._step()
        dev = self.engine.device
        _sync(dev)
        c0 = self.moe_counters()
        h0 = host_noise.sample()
        t0 = time.perf_counter()
        made = sum(self._step() for _ in range(tokens))
        _sync(dev)
        dt = time.perf_counter() - t0
        self.noise = host_noise.between(h0, host_noise.sample())
        c1 = self.moe_counters()
        for rid in rids:
            self.engine.abort(rid)
        self.drain()
        return made, dt, None if c0 is None else {k: c1[k] - c0[k] for k in c0}

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


# ---- the expert cache's ceiling ---------------------------------------------------------------
def moe_side_gbps(backend: str, profile: dict | None) -> float | None:
    """GB/s at which missing experts reach a result (module docstring); None without an
    `ft bench bw` profile with PCIe figures."""
    if profile is None:
        return None
    if backend == "offload":
        return profile["pcie_gbps"]
    if backend == "cpu":
        return profile["cpu_gbps"]
    return profile["cpu_both_gbps"] + profile["pcie_both_gbps"]


def moe_expert_bytes(engine) -> tuple[int, float]:
    """(routed experts in the model, mean bytes of one) from the expert cache's host banks."""
    return engine.moe.experts, engine.moe.expert_bytes


def moe_decode_ceiling(engine, batch: int, rate: float, gbps: float | None) -> float | None:
    if gbps is None:
        return None
    from freetoken.layers.moe import FusedExperts

    spec = next(m for m in engine.model.modules() if isinstance(m, FusedExperts)).spec
    total, per_expert = moe_expert_bytes(engine)
    touched = total * (1 - (1 - spec.top_k / spec.num_experts) ** batch)
    return batch / (touched * (1 - rate) * per_expert / (gbps * 1e9))


class MoEInfo:
    """The expert cache of the runner's engine (None fields without one)."""

    def __init__(self, runner: Runner):
        from freetoken.moe.policy import expert_format, find_profile

        moe = runner.engine.moe
        self.backend = moe.backend if moe is not None else None
        self.rate = moe.num_slots / moe_expert_bytes(runner.engine)[0] if moe else None
        self.profile = find_profile(expert_format(moe.cache.hosts[0])) if moe else None


def run_decode(runner: Runner, batches: list[int], prompt_len: int, tokens: int, warmup: int,
               bandwidth_gbps: float) -> list[DecodeResult]:
    results = []
    info = MoEInfo(runner)
    for b in batches:
        made, dt, c = runner.decode(b, prompt_len, tokens, warmup)
        if made != b * tokens:
            raise RuntimeError(f"batch {b}: {made} tokens in {tokens} steps, expected "
                               f"{b * tokens} (were requests preempted? raise --kv-cache-mb)")
        nbytes = step_weight_bytes(runner.engine.model, b)
        gbps = nbytes * tokens / dt / 1e9
        row = DecodeResult(
            batch=b, steps=tokens, seconds=dt, tokens_per_s=made / dt,
            ms_per_step=dt / tokens * 1e3, weight_bytes_per_step=nbytes, achieved_gbps=gbps,
            roofline_pct=100 * gbps / bandwidth_gbps)
        if runner.noise is not None:
            row = replace(row, steal_pct=runner.noise.steal_pct,
                          preempted_per_step=runner.noise.preempted / tokens)
        if c is not None:
            ceil = moe_decode_ceiling(runner.engine, b, info.rate,
                                      moe_side_gbps(info.backend, info.profile))
            row = replace(row, moe_backend=info.backend, moe_cache_rate=info.rate,
                          hit_rate=c["hits"] / max(1, c["hits"] + c["misses"]),
                          fetched_per_step=c["fetched"] / tokens, cpu_per_step=c["cpu"] / tokens,
                          ceiling_tokens_per_s=ceil,
                          ceiling_pct=None if ceil is None else 100 * row.tokens_per_s / ceil)
        results.append(row)
    return results


def run_prefill(runner: Runner, prompt_lens: list[int], warmup: int) -> list[PrefillResult]:
    for n in prompt_lens * warmup:  # each shape once: kernels compile / tune per shape
        runner.prefill(n)
    info = MoEInfo(runner)
    results = []
    for n in prompt_lens:
        c0 = runner.moe_counters()
        dt = runner.prefill(n)
        row = PrefillResult(prompt_len=n, seconds=dt, tokens_per_s=n / dt)
        if c0 is not None:
            total, per_expert = moe_expert_bytes(runner.engine)
            pcie = info.profile["pcie_gbps"] if info.profile else None
            ceil = None if pcie is None else n / (total * per_expert / (pcie * 1e9))
            row = replace(row, moe_backend=info.backend, moe_cache_rate=info.rate,
                          fetched=runner.moe_counters()["fetched"] - c0["fetched"],
                          ceiling_tokens_per_s=ceil,
                          ceiling_pct=None if ceil is None else 100 * row.tokens_per_s / ceil)
        results.append(row)
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


def _opt(v, fmt: str, width: int) -> str:
    return f"{v:>{width}{fmt}}" if v is not None else f"{'-':>{width}}"


def _print_decode(rows: list[DecodeResult]) -> None:
    moe = rows and rows[0].moe_backend is not None
    head = (f"{'batch':>5} {'tok/s':>10} {'ms/step':>9} {'weight MB/step':>15} {'GB/s':>8} "
            f"{'% roofline':>11}")
    if moe:
        head += (f" {'backend':>8} {'rate':>5} {'hit rate':>8} {'fetched':>8} {'cpu':>7} "
                 f"{'ceiling':>8} {'% ceil':>7}")
    noise = rows and rows[0].steal_pct is not None
    if noise:
        head += f" {'steal':>6} {'preempt':>8}"
    print(head)
    for r in rows:
        line = (f"{r.batch:>5} {r.tokens_per_s:>10.1f} {r.ms_per_step:>9.2f} "
                f"{r.weight_bytes_per_step / 1e6:>15.1f} {r.achieved_gbps:>8.1f} "
                f"{r.roofline_pct:>10.1f}%")
        if moe:
            line += (f" {r.moe_backend:>8} {r.moe_cache_rate:>5.2f} {r.hit_rate:>8.3f} "
                     f"{r.fetched_per_step:>8.1f} {r.cpu_per_step:>7.1f} "
                     f"{_opt(r.ceiling_tokens_per_s, '.1f', 8)} {_opt(r.ceiling_pct, '.1f', 6)}%")
        if noise:
            line += f" {_opt(r.steal_pct, '.1f', 5)}% {_opt(r.preempted_per_step, '.1f', 8)}"
        print(line)
    if noise:
        print("steal: CPU time the hypervisor gave other guests during the timed steps; "
              "preempt: this process's threads descheduled against their will, a step "
              "(engine/host_noise.py)")


def _print_prefill(rows: list[PrefillResult]) -> None:
    moe = rows and rows[0].moe_backend is not None
    head = f"{'prompt':>7} {'prompt tok/s':>13} {'seconds':>9}"
    if moe:
        head += f" {'backend':>8} {'rate':>5} {'fetched':>8} {'ceiling':>8} {'% ceil':>7}"
    print(head)
    for r in rows:
        line = f"{r.prompt_len:>7} {r.tokens_per_s:>13.1f} {r.seconds:>9.3f}"
        if moe:
            line += (f" {r.moe_backend:>8} {r.moe_cache_rate:>5.2f} {r.fetched:>8} "
                     f"{_opt(r.ceiling_tokens_per_s, '.1f', 8)} {_opt(r.ceiling_pct, '.1f', 6)}%")
        print(line)


def _profile_step(runner: Runner, batch: int, prompt_len: int, path: str) -> None:
    """A torch.profiler trace of one decode step at `batch` (chrome trace in `path`), the
    busiest host ops, and where an expert-cache step's time goes: the host time of each
    `moe.*` phase (expert_cache.py's ranges: kernel launches and host copies; a CUDA graph
    replay runs none of them) against the step's wall time and the device's kernel and copy
    time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(batch):
        runner._add(prompt_len, 4)
    while not all(len(r.output_token_ids) for r in runner.engine.scheduler.running) or \
            runner.engine.scheduler.waiting:
        runner._step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                     if runner.engine.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        runner._step()
        _sync(runner.engine.device)
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(path)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(step_breakdown(prof.events(), wall))
    runner.drain()


def step_breakdown(events, wall_s: float) -> str:
    """One profiled step: host ms of each moe.* range, device ms of kernels and copies."""
    host: dict[str, list[float]] = {}
    kernels = copies = 0.0
    for e in events:
        on_device = e.device_type.name == "CUDA"
        if e.name.startswith("moe."):
            if not on_device:  # (the ranges also appear on the device's timeline)
                host.setdefault(e.name, []).append(e.cpu_time_total / 1e3)
        elif on_device:
            t = e.device_time_total / 1e3
            if "memcpy" in e.name.lower():
                copies += t
            else:
                kernels += t
    lines = [f"step {wall_s * 1e3:.2f} ms wall; device: kernels {kernels:.2f} ms, copies "
             f"{copies:.2f} ms (summed, they may overlap)"]
    for name, ts in sorted(host.items()):
        lines.append(f"  {name:<12} {len(ts):>4} calls {sum(ts):>9.2f} ms host "
                     f"({100 * sum(ts) / (wall_s * 1e3):.0f}% of the step)")
    return "\n".join(lines)


def main(config: EngineConfig, *, batches: list[int], prompt_len: int, tokens: int,
         warmup: int, prompt_lens: list[int], decode: bool, prefill: bool,
         json_path: str | None = None, profile_path: str | None = None,
         torch_threads: int | None = None,
         moe_runs: list[tuple[str, float]] | None = None) -> dict:
    """Run the decode and / or prefill measurements, print tables, optionally write JSON.

    moe_runs: (backend, cache rate) pairs measured in turn on one loaded model (each replaces
    config's --moe-backend and --moe-cache-rate); None: config as given."""
    if min(batches + [prompt_len, tokens] + prompt_lens) < 1 or warmup < 0:
        raise ValueError("--batch, --prompt-len, --tokens and --prompt-lens must be positive, "
                         "--warmup not negative")
    from freetoken.moe.expert_cache import CACHE_BACKENDS

    for backend, rate in moe_runs or []:
        if backend not in CACHE_BACKENDS or not 0 < rate <= 1:
            raise ValueError(f"--moe-backends takes {', '.join(CACHE_BACKENDS)} (the model is "
                             f"loaded once with host banks) and --moe-cache-rates fractions in "
                             f"(0, 1], got {backend} at {rate}")
    threads = torch.get_num_threads()
    if torch_threads is not None:
        # NOTE: on a CPU shared with other jobs, an intra-op thread that is not scheduled
        # stalls every op at its barrier: 1 thread made a tiny model's step 100x faster on
        # the busy 2-core CI machine.
        torch.set_num_threads(torch_threads)
    try:
        return _main(config, batches, prompt_len, tokens, warmup, prompt_lens, decode, prefill,
                     json_path, profile_path, moe_runs)
    finally:
        torch.set_num_threads(threads)


def _main(config: EngineConfig, batches: list[int], prompt_len: int, tokens: int, warmup: int,
          prompt_lens: list[int], decode: bool, prefill: bool, json_path: str | None,
          profile_path: str | None, moe_runs: list[tuple[str, float]] | None) -> dict:
    config = bench_config(config, batches, prompt_len, tokens, warmup,
                          prompt_lens if prefill else [])
    # --moe-hybrid-max-fetch goes to the sweep's hybrid runs only (the others refuse it)
    runs = [replace(config, moe_backend=b, moe_cache_rate=r,
                    moe_hybrid_max_fetch=config.moe_hybrid_max_fetch if b == "hybrid" else None)
            for b, r in moe_runs or []]
    report: dict = {}
    model = None
    for i, cfg in enumerate(runs or [config]):
        runner = _runner(cfg, model)
        engine = runner.engine
        model = engine.model
        if i == 0:
            report = _describe(cfg, engine)
            report["torch_threads"] = torch.get_num_threads()
            print(", ".join(f"{k} {v}" for k, v in report.items()))
        if runs:
            print(f"\n== MoE backend {cfg.moe_backend}, cache rate {cfg.moe_cache_rate}")
        if decode:
            if "bandwidth_gbps" not in report:
                bw, how = measure_bandwidth(engine.device)
                report.update(bandwidth_gbps=bw, bandwidth_method=how, prompt_len=prompt_len)
                print(f"memory bandwidth {bw:.1f} GB/s ({how}); prompt {prompt_len} tokens, "
                      f"{tokens} timed steps after {warmup} warm-up")
            rows = run_decode(runner, batches, prompt_len, tokens, warmup,
                              report["bandwidth_gbps"])
            _print_decode(rows)
            report.setdefault("decode", []).extend(asdict(r) for r in rows)
        if prefill:
            rows_p = run_prefill(runner, prompt_lens, min(warmup, 1))
            _print_prefill(rows_p)
            report.setdefault("prefill", []).extend(asdict(r) for r in rows_p)
        if profile_path:
            path = profile_path
            if runs:
                stem, dot, ext = profile_path.rpartition(".")
                tag = f"-{cfg.moe_backend}-{cfg.moe_cache_rate}"
                path = f"{stem}{tag}.{ext}" if dot else profile_path + tag
            _profile_step(runner, batches[0], prompt_len, path)
        if engine.moe is not None:  # the run's CPU threads stop before the next run's start
            engine.moe.close()
        del runner, engine
        _release()
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report


def _runner(config: EngineConfig, model=None) -> Runner:
    """An engine on `model` (loaded from config when None) and its Runner."""
    from freetoken.engine.engine import Engine
    from freetoken.models.dummy import IdTokenizer

    # Prompts are token ids: no tokenizer is built (a GGUF's may be slow or unsupported).
    tokenizer = IdTokenizer(1)
    engine = Engine(config, tokenizer=tokenizer, model=model)
    tokenizer.vocab_size = engine.model.config.vocab_size
    return Runner(engine)


def _release() -> None:
    """Free the last engine's KV cache and slot pool before the next is built."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
