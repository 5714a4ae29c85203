"""Where a decode step's time goes: the CUDA kernels of a few engine steps, per step.

    python benchmarks/profile_decode_step.py --model qwen3-30b-a3b --dummy-weights \
        --dummy-format q4_k --batch 1,16 --steps 5

For each batch size B: B requests are prefilled and warmed up (graph capture, Triton JIT),
then `--steps` engine steps run under torch.profiler. The table lists each kernel (name cut to
60 characters), how many times it runs per step, its device microseconds per step and its
share of the kernel time; below it, the step's wall time against the summed kernel time (the
gap is launch overhead, host work and idle device) and the host-side calls that betray a sync
or a torch-reference fallback inside the step (`aten::_local_scalar_dense` = `.item()` /
`.tolist()`, memcpy, stream / device synchronize), per step. Without CUDA it profiles the CPU
ops instead (a small model: `--dummy-layers 2`), so the script itself is tested on any machine.

`--prefill 512,2048` also profiles the prefill of one prompt of each length (one engine step
each, after an untimed one of the same length), first, in the same table (`--batch ''`: no
decode tables).

`--timeline N` (CUDA) adds, per batch size, where the device sat idle between kernels: the
profiled steps' kernels in start order (all streams), the idle time before each kernel (no
kernel of any stream running), summed per kernel name per step, and N kernels of the middle
step in order (start, duration, idle before, stream): the launch gaps and hand-off latencies a
per-kernel table cannot show.

`--kernel-ab` (CUDA) times the decode kernels whose settings changed with this profile against
their previous settings, at one token on Qwen3-30B-A3B shapes, replayed from CUDA graphs
(benchmarks/bench_gpu_kernels.py's timer): the Q8_0 GEMV on blocks as stored vs split
(`formats.split_q8_0`, as the loader places dense Q8_0 on CUDA) and the fused MoE layer
(Q4_K, NVFP4) with the unrolled vs the rolled K loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from freetoken.engine import host_noise  # noqa: E402

# Host-side events that mean the step waits for the device or reads a value back.
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy", "cudaGraphLaunch",
            "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def _engine(args: argparse.Namespace):
    from freetoken.cli import engine_config_from_args
    from freetoken.engine.bench import Runner, bench_config
    from freetoken.engine.engine import Engine
    from freetoken.models.dummy import IdTokenizer

    config = bench_config(engine_config_from_args(args), args.batch or [1], args.prompt_len,
                          _decode_steps(args), args.warmup, args.prefill)
    tokenizer = IdTokenizer(1)
    engine = Engine(config, tokenizer=tokenizer)
    tokenizer.vocab_size = engine.model.config.vocab_size
    return Runner(engine)


def _decode_steps(args: argparse.Namespace) -> int:
    """Decode steps a batch's requests run: warm-up, the hand-off record's, the profiled ones
    and the --ahead-delays rounds'."""
    return (2 * args.steps + args.warmup
            + len(args.ahead_delays) * args.delay_rounds * args.delay_steps)


def _start(runner, batch: int, prompt_len: int, steps: int) -> list[str]:
    """`batch` requests, each past its prefill (decoding from the next step on)."""
    rids = [runner._add(prompt_len, steps + batch + 4) for _ in range(batch)]
    first = 0
    while first < batch:
        first += sum(1 for o in runner.engine.step() if len(o.output_token_ids) == 1)
    return rids


def _kernel_rows(prof, on_cuda: bool) -> dict[str, tuple[int, float]]:
    """name -> (calls, microseconds) over the profiled steps: device kernels on CUDA (self
    device time), top-level CPU ops otherwise."""
    rows: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        if on_cuda:
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.self_device_time_total
        else:
            if not ev.key.startswith("aten::"):
                continue
            us = ev.self_cpu_time_total
        if us <= 0:
            continue
        r = rows[ev.key[:60]]
        r[0] += ev.count
        r[1] += us
    return {k: (int(c), float(t)) for k, (c, t) in rows.items()}


def _device_events(prof) -> list[tuple[int, int, str, int]]:
    """(start ns, end ns, name, stream) of every device activity (kernels, copies, memsets)."""
    out = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() != torch.autograd.DeviceType.CUDA or ev.duration_ns() <= 0:
            continue
        out.append((ev.start_ns(), ev.start_ns() + ev.duration_ns(), ev.name()[:60],
                    ev.device_resource_id()))
    return sorted(out)


def _timeline(events: list[tuple[int, int, str, int]], steps: int, window: int,
              limit: int) -> str:
    """The device's idle time between activities (see the module docstring). `events` sorted by
    start; the steps are cut at the `steps - 1` longest idle gaps (the host between steps)."""
    if not events:
        return "timeline: no device activities recorded"
    idle = []  # idle ns before each event: no earlier event still running
    reach = events[0][0]
    for s0, e0, _, _ in events:
        idle.append(max(0, s0 - reach))
        reach = max(reach, e0)
    cuts = sorted(sorted(range(1, len(events)), key=lambda i: -idle[i])[:max(steps - 1, 0)])
    bounds = [0, *cuts, len(events)]
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    inner = 0.0
    busy = 0.0
    for a, b in zip(bounds[:-1], bounds[1:]):
        for i in range(a + 1, b):
            r = by_name[events[i][2]]
            r[0] += 1
            r[1] += idle[i]
            inner += idle[i]
        span_end = max(e for _, e, _, _ in events[a:b])
        busy += span_end - events[a][0] - sum(idle[a + 1:b])
    n = len(bounds) - 1
    out = [f"timeline: {n} steps, device busy {busy / n / 1e3:.1f} us and idle between its "
           f"activities {inner / n / 1e3:.1f} us per step; idle before each kernel, per step:",
           f"{'kernel':<60} {'calls/step':>10} {'idle us':>9} {'per call':>9}"]
    for name, (c, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:limit]:
        out.append(f"{name:<60} {c / n:>10.1f} {ns / n / 1e3:>9.1f} {ns / c / 1e3:>9.2f}")
    mid = n // 2
    a, b = bounds[mid], bounds[mid + 1]
    first = a + max(0, (b - a - window) // 2)
    out.append(f"step {mid + 1}: kernels {first - a} to {min(b, first + window) - a} of "
               f"{b - a}, in start order (us from the first listed)")
    out.append(f"{'start':>9} {'dur':>8} {'idle':>7} {'stream':>6}  kernel")
    t0 = events[first][0]
    for i in range(first, min(b, first + window)):
        s0, e0, name, stream = events[i]
        out.append(f"{(s0 - t0) / 1e3:>9.1f} {(e0 - s0) / 1e3:>8.1f} {idle[i] / 1e3:>7.1f} "
                   f"{stream:>6}  {name}")
    return "\n".join(out)


def _host_calls(prof) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for ev in prof.key_averages():
        if ev.key in SYNC_OPS and ev.device_type == torch.autograd.DeviceType.CPU:
            counts[ev.key] += ev.count
    return counts


def profile_batch(runner, batch: int, args: argparse.Namespace) -> str:
    """Profile `args.steps` decode steps at `batch`; the printed table as a string."""
    dev = runner.engine.device
    on_cuda = dev.type == "cuda"
    # warm-up, the hand-off record's steps and the profiled steps
    rids = _start(runner, batch, args.prompt_len, _decode_steps(args))
    for _ in range(args.warmup):
        runner._step()
    handoff_table, handoff_wall = _handoff_steps(runner, args.steps, on_cuda)
    if args.ahead_delays:
        handoff_table += _delay_rounds(runner, batch, args.ahead_delays, args.delay_rounds,
                                       args.delay_steps, on_cuda)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=acts) as prof:
        if on_cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            runner._step()
        if on_cuda:
            torch.cuda.synchronize(dev)
        wall = (time.perf_counter() - t0) / args.steps * 1e6
    for rid in rids:
        runner.engine.abort(rid)
    runner.drain()
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}.b{batch}.json")
    if handoff_wall and wall > PROFILED_SLOWER * handoff_wall:
        # torch's profiler takes CPU time from the executor's threads: the receive kernels
        # then poll for answers that come late, and the kernel table shows that wait
        handoff_table += (f"\nnote: the profiled steps took {wall:.0f} us against "
                          f"{handoff_wall:.0f} without the profiler; the kernel table's "
                          "receive and fill times include the CPU's slowdown under it; the "
                          "hand-off worker's table above is the step as it runs")
    timeline = ""
    if args.timeline and on_cuda:
        timeline = "\n" + _timeline(_device_events(prof), args.steps, args.timeline, args.rows)
    return _table(_kernel_rows(prof, on_cuda), _host_calls(prof), f"batch {batch}", args.steps,
                  wall,
                  on_cuda, args.rows) + timeline + handoff_table


def profile_prefill(runner, prompt_len: int, args: argparse.Namespace) -> str:
    """Profile the prefill of one `prompt_len`-token prompt (after one untimed prefill of the
    same length: kernels compile and tune per shape); the printed table as a string."""
    dev = runner.engine.device
    on_cuda = dev.type == "cuda"
    runner.prefill(prompt_len)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=acts) as prof:
        wall = runner.prefill(prompt_len) * 1e6
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}.p{prompt_len}.json")
    return _table(_kernel_rows(prof, on_cuda), _host_calls(prof), f"prefill {prompt_len}", 1,
                  wall, on_cuda, args.rows)


# A profiled step this many times the unprofiled one (the hand-off worker's steps) is noted
PROFILED_SLOWER = 1.5


def _handoff_of(runner):
    """The engine's CPU hand-off (moe/handoff.py), or None (another backend, or not started)."""
    return getattr(getattr(runner.engine.moe, "cache", None), "_handoff", None)


def _handoff_record(runner, steps: int, on_cuda: bool) -> dict | None:
    """`steps` decode steps without the profiler, the hand-off worker's job record on: the
    steps' wall time (us a step) and, summed over them, the worker's phases (us), the
    device's waits for the answers, the counters, warming and the host's noise; None for
    backends without a hand-off."""
    moe, ho = runner.engine.moe, _handoff_of(runner)
    if ho is None:
        return None
    c0 = moe.counters()
    p0 = ho.prefetch_stats()
    ho.set_trace(True)
    if on_cuda:
        torch.cuda.synchronize()
    w0 = ho.device_waits()
    h0 = host_noise.sample()
    t0 = time.perf_counter()
    for _ in range(steps):
        runner._step()
    if on_cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e6
    noise = host_noise.between(h0, host_noise.sample())
    tr = ho.trace()
    ho.set_trace(False)
    w1 = ho.device_waits()
    c1 = moe.counters()
    p1 = ho.prefetch_stats()
    rec = {"wall": wall, "steps": steps, "jobs": len(tr), "tr": tr, "noise": noise,
           "counters": {k: (c1[k] - c0[k]) / steps for k in c1},
           "warming": {k: p1[k] - p0[k] for k in p1}, "handoff": ho,
           "device_wait": None if w0 is None else (w1[0] - w0[0], w1[1] - w0[1])}
    if len(tr):
        seen, f0, f1, done, rows, routes, free = tr.T
        gaps = seen[1:] - free[:-1]
        # a gap longer than a step's wall time is the host between steps, not a layer's GPU
        # work
        keep = gaps < wall
        rec["phases"] = {"executor": (f1 - f0).sum(), "compaction": (f0 - seen).sum(),
                         "answer": (done - f1).sum(),
                         "after": (free - done)[:-1][keep].sum(), "wait": gaps[keep].sum()}
    return rec


_PHASES = (("executor", "executor (CPU experts' compute)"),
           ("compaction", "compaction before it (go seen -> start)"),
           ("answer", "answer after it (end -> done)"),
           ("after", "copies ahead queued, warming (done -> free)"),
           ("wait", "waiting for the device (free -> next job)"))


def _handoff_steps(runner, steps: int, on_cuda: bool) -> tuple[str, float]:
    """With an expert-cache backend (cpu, hybrid, offload's leftovers): `steps` decode steps
    without the profiler, the hand-off worker's job record on, summed per step: where the
    CPU's side of a step goes (executor, compaction before it, the answer after it, the
    copies ahead it queues and its warming after the answer) and how long it then waits for
    the device's next job (the layers' GPU work before each hand-off),
    on a GPU also how long the device waits for the answers (the receive kernels' polling:
    near zero when the device's share of a layer is the longer one), beside the expert-cache
    counters; and the steps' wall time in us. ('', 0.0) for other backends."""
    rec = _handoff_record(runner, steps, on_cuda)
    if rec is None:
        return "", 0.0
    wall, tr = rec["wall"], rec["tr"]
    if len(tr) == 0:
        return "\nhand-off: no jobs in these steps", wall
    noise = rec["noise"]
    n = len(tr) / steps
    lines = [f"\n== hand-off worker, {steps} steps without the profiler: {wall:.1f} us per step, "
             f"{n:.1f} jobs per step",
             "counters per step: " + ", ".join(f"{k} {v:.1f}"
                                               for k, v in rec["counters"].items()),
             *([] if noise is None else [f"host (engine/host_noise.py): {noise.text(steps)}"]),
             f"{'per step':<44} {'us':>9} {'per job':>9} {'of wall':>8}"]
    for key, label in _PHASES:
        us = rec["phases"][key]
        lines.append(f"{label:<44} {us / steps:>9.1f} {us / len(tr):>9.1f} "
                     f"{100 * us / steps / wall:>7.1f}%")
    if rec["device_wait"] is not None:  # the other side: the receive kernels' polling
        us, calls = rec["device_wait"]
        lines.append(f"{'device waiting for the answers (receive)':<44} {us / steps:>9.1f} "
                     f"{us / max(calls, 1):>9.1f} {100 * us / steps / wall:>7.1f}%")
    pf = rec["warming"]
    if pf["hints"]:  # warming (moe/handoff.py): the next layer's predicted CPU experts
        lines.append(f"warming: {pf['hints'] / steps:.1f} hints per step, "
                     f"{pf['warmed'] / pf['hints']:.2f} experts warmed per hint; of them "
                     f"{pf['used'] / max(pf['warmed'], 1):.0%} computed by the next job, "
                     f"{pf['used'] / max(pf['cpu'], 1):.0%} of its CPU experts")
    seen, f0, f1, done, rows, routes, free = tr.T
    busy = f1 > f0
    if busy.any():
        b0 = rec["handoff"]._banks[0]
        per_expert = (b0.w13.nbytes() + b0.w2.nbytes()) / b0.num_experts
        us = (f1 - f0)[busy]
        lines.append(f"per job with CPU routes: {rows[busy].mean():.2f} rows, "
                     f"{routes[busy].mean():.2f} routes, executor {us.mean():.1f} us; "
                     f"at one row, {(routes[busy] * per_expert).sum() / us.sum() / 1e3:.1f} "
                     "GB/s of expert weights")
    return "\n".join(lines), wall


def _delay_rounds(runner, batch: int, delays: list[int], rounds: int, steps: int,
                  on_cuda: bool) -> str:
    """The hand-off worker's copies ahead held back `delays` us after each answer
    (FREETOKEN_MOE_AHEAD_DELAY_US, set on the running worker), alternated for `rounds` rounds
    of `steps` decode steps each on the same engine: per delay the median tokens/s of the
    rounds and the worker's phases a job (the wait for the device's next job is the layer's
    GPU work before the hand-off, where the copies share the link with the device's read of
    the answer)."""
    from freetoken import env

    ho = _handoff_of(runner)
    if ho is None or not ho.copies:
        return "\n(--ahead-delays: no copies ahead by the hand-off's worker in this engine)"
    worker = ho._worker
    got: dict[int, list[dict]] = defaultdict(list)
    try:
        for _ in range(rounds):
            for d in delays:
                worker.set_ahead_delay(d)
                got[d].append(_handoff_record(runner, steps, on_cuda))
    finally:
        worker.set_ahead_delay(env.moe_ahead_delay_us())
    lines = [f"\n== copies ahead held back after each answer: {rounds} rounds of {steps} steps, "
             "alternated: tok/s (median, each round), then us a job and CPU experts a step "
             "(medians of the rounds)",
             f"{'delay us':>8} {'tok/s':>8} {'executor':>9} {'after':>7} {'wait':>7} "
             f"{'device waits':>12} {'CPU experts':>11}  rounds"]
    for d in delays:
        rs = got[d]
        tps = [batch * 1e6 / r["wall"] for r in rs]

        def per_job(key, rs=rs):
            return statistics.median(r["phases"][key] / max(r["jobs"], 1) for r in rs)

        dw = statistics.median(r["device_wait"][0] / max(r["device_wait"][1], 1)
                               for r in rs) if rs[0]["device_wait"] is not None else float("nan")
        cpu = statistics.median(r["counters"]["cpu"] for r in rs)
        lines.append(f"{d:>8} {statistics.median(tps):>8.1f} {per_job('executor'):>9.1f} "
                     f"{per_job('after'):>7.1f} {per_job('wait'):>7.1f} {dw:>12.1f} "
                     f"{cpu:>11.1f}  " + " ".join(f"{t:.1f}" for t in tps))
    return "\n".join(lines)


def _table(rows: dict[str, tuple[int, float]], host: dict[str, int], label: str, steps: int,
           wall_us: float, on_cuda: bool, limit: int) -> str:
    total = sum(t for _, t in rows.values()) / steps
    what = "kernel" if on_cuda else "CPU op (self time)"
    out = [f"== {label}: {steps} steps, {wall_us:.1f} us per step (wall, profiler on), "
           f"{total:.1f} us of {what} time per step, "
           f"{sum(c for c, _ in rows.values()) / steps:.0f} launches per step",
           f"{what[:60]:<60} {'calls/step':>10} {'us/step':>9} {'share':>7}"]
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    for name, (calls, us) in ranked[:limit]:
        out.append(f"{name:<60} {calls / steps:>10.1f} {us / steps:>9.1f} "
                   f"{100 * us / steps / max(total, 1e-9):>6.1f}%")
    if len(ranked) > limit:
        rest = ranked[limit:]
        out.append(f"{f'({len(rest)} more)':<60} {sum(c for _, (c, _) in rest) / steps:>10.1f} "
                   f"{sum(t for _, (_, t) in rest) / steps:>9.1f}")
    out.append("host calls per step: " + (", ".join(
        f"{k} {v / steps:.1f}" for k, v in sorted(host.items())) or "none"))
    return "\n".join(out)


def kernel_ab() -> None:
    """Decode kernels now vs before (see the module docstring): us per call and GB/s."""
    from bench_gpu_kernels import DENSE, make_weight, random_bank, time_call

    from freetoken.kernels.triton.linear import triton_linear
    from freetoken.kernels.triton.moe import fused_moe_triton

    def row(label: str, fn, nbytes: float) -> None:
        _, g = time_call(fn)
        print(f"{label:<44} {g * 1e3:8.1f} us {nbytes / g / 1e6:7.0f} GB/s", flush=True)

    for name, n, k in DENSE:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for fmt in ("Q8_0", "Q8_0s"):  # blocks as stored, split as the loader places them
            qw = make_weight(fmt, (n, k))
            row(f"{fmt} {name} {n}x{k}", lambda x=x, qw=qw: triton_linear(x, qw), qw.nbytes())
    e, h, inter, topk = 128, 2048, 768, 8
    for fmt in ("Q4_K", "nvfp4"):
        bank = random_bank(fmt, e, h, inter)
        per_expert = (bank.w13.nbytes() + bank.w2.nbytes()) / e
        # 16 tokens: the per-route GEMV with 16 rows (rolled by default) at other unrolls
        for t, unrolls in ((1, (None, 1)), (16, (None, 2, 4))):
            ids = torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(t)])
            w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            nbytes = int(torch.unique(ids).numel()) * per_expert
            for u in unrolls:
                row(f"MoE {fmt} {t} tokens top-8 unroll={u or 'default'}",
                    lambda a=(x, bank, ids, w, "silu", None, None, u): fused_moe_triton(*a),
                    nbytes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from freetoken.cli import add_engine_args
    from freetoken.commands.generate import add_log_level

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    add_log_level(p)
    p.add_argument("--batch", default="1,16",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="comma-separated decode batch sizes (default 1,16)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="profiled decode steps per batch")
    p.add_argument("--warmup", type=int, default=3, help="untimed decode steps first")
    p.add_argument("--rows", type=int, default=40, help="kernels listed per table")
    p.add_argument("--prefill", default="",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="comma-separated prompt lengths whose prefill (one prompt, one step "
                   "each) is profiled first")
    p.add_argument("--kernel-ab", action="store_true",
                   help="only time the changed decode kernels against their previous settings")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="(CUDA) also the device's idle time before each kernel, and N kernels "
                   "of the middle step in order")
    p.add_argument("--ahead-delays", default="",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="comma-separated us: the hand-off worker's copies ahead held back "
                   "that long after each answer, alternated on the same engine (with "
                   "--moe-fetch-ahead; FREETOKEN_MOE_AHEAD_DELAY_US)")
    p.add_argument("--delay-rounds", type=int, default=3)
    p.add_argument("--delay-steps", type=int, default=32)
    p.add_argument("--trace", default=None, metavar="PREFIX",
                   help="also write chrome traces PREFIX.b<batch>.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from freetoken.commands.generate import setup_logging

    args = parse_args(argv)
    setup_logging(args)
    if args.kernel_ab and args.prefill:
        raise SystemExit("--kernel-ab times kernels alone: it takes no --prefill")
    if args.kernel_ab:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        kernel_ab()
        return 0
    runner = _engine(args)
    for n in args.prefill:
        print(profile_prefill(runner, n, args), flush=True)
    for b in args.batch:
        print(profile_batch(runner, b, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
