"""What else the host did while a benchmark ran (Linux): the CPU time the hypervisor gave to
other guests (`steal` in /proc/stat) and how often this process's threads were descheduled
against their will (`nonvoluntary_ctxt_switches` of /proc/self/task/*/status).

The CPU MoE executor splits a layer's experts over all but one core and every job waits for
its slowest thread: one thread preempted for a scheduler slice (milliseconds) holds up a job
of 100-300 us. On the H200's shared host the same decode ran 2-3x apart between runs minutes
apart (30B Q4_K cpu backend, batch 1: 79.6 tok/s, then 23-54 in another run), and a profiled
35B hybrid step's executor read 29.9 GB/s of experts a job where `ft bench bw` had measured
119 alone minutes before, with nothing in our own counters to say why.
`ft bench decode` rows, `benchmarks/ab_env.py` rounds and `profile_decode_step.py` print these
two figures beside the speed so that such runs can be told apart from slow code.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

# /proc/stat's cpu line: user nice system idle iowait irq softirq steal (guest time is inside
# user / nice)
_STEAL = 7


@dataclass(frozen=True)
class HostSample:
    jiffies: tuple[int, ...]  # the aggregate cpu line of /proc/stat, its first 8 fields
    preempted: int  # this process's threads' nonvoluntary context switches so far


def parse_cpu_line(text: str) -> tuple[int, ...]:
    """The first 8 counters of /proc/stat's aggregate `cpu` line (user .. steal)."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            vals = [int(v) for v in line.split()[1:9]]
            return tuple(vals + [0] * (8 - len(vals)))
    raise ValueError("/proc/stat: no aggregate 'cpu' line")


def parse_nonvoluntary(text: str) -> int:
    """`nonvoluntary_ctxt_switches` of one /proc/<pid>/task/<tid>/status text (0 if absent)."""
    for line in text.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split(":", 1)[1])
    return 0


def _preempted() -> int:
    n = 0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        try:
            with open(path) as f:
                n += parse_nonvoluntary(f.read())
        except OSError:  # a thread that ended between the listing and the read
            pass
    return n


def sample() -> HostSample | None:
    """The counters now, or None where the host has no /proc (not Linux)."""
    try:
        with open("/proc/stat") as f:
            jiffies = parse_cpu_line(f.read())
    except (OSError, ValueError):
        return None
    return HostSample(jiffies, _preempted())


@dataclass(frozen=True)
class HostNoise:
    steal_pct: float  # of all CPUs' time between the samples, given to other guests
    preempted: int  # this process's involuntary context switches between them

    def text(self, steps: int) -> str:
        return (f"steal {self.steal_pct:.1f}%, {self.preempted / max(steps, 1):.1f} "
                "preemptions a step")


def between(a: HostSample | None, b: HostSample | None) -> HostNoise | None:
    """What the host did from sample a to sample b (None without both)."""
    if a is None or b is None:
        return None
    d = [y - x for x, y in zip(a.jiffies, b.jiffies)]
    total = sum(d)
    steal = 100.0 * d[_STEAL] / total if total > 0 else 0.0
    return HostNoise(steal, max(0, b.preempted - a.preempted))
