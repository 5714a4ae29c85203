"""engine/host_noise.py: the steal share and the involuntary context switches read from /proc,
checked against /proc texts written here by hand (the formats of proc(5)) and, on Linux, against
a thread made to be preempted."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from freetoken.engine import host_noise

STAT = """cpu  100 5 50 800 10 1 2 32 0 0
cpu0 50 2 25 400 5 0 1 16 0 0
intr 12345
"""


def test_parse_cpu_line_takes_the_aggregate_line():
    assert host_noise.parse_cpu_line(STAT) == (100, 5, 50, 800, 10, 1, 2, 32)
    # an old kernel's line without steal: the missing counters are 0
    assert host_noise.parse_cpu_line("cpu  1 2 3 4\n") == (1, 2, 3, 4, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        host_noise.parse_cpu_line("cpu0 1 2 3 4\n")


def test_parse_nonvoluntary():
    status = "Name:\tpython\nvoluntary_ctxt_switches:\t17\nnonvoluntary_ctxt_switches:\t5\n"
    assert host_noise.parse_nonvoluntary(status) == 5
    assert host_noise.parse_nonvoluntary("Name:\tpython\n") == 0


def test_between_is_the_steal_share_of_the_interval():
    a = host_noise.HostSample((100, 0, 50, 800, 0, 0, 0, 50), 10)
    b = host_noise.HostSample((160, 0, 70, 880, 0, 0, 0, 90), 25)
    n = host_noise.between(a, b)
    # 200 jiffies passed, 40 of them stolen
    assert n.steal_pct == pytest.approx(100 * 40 / 200) and n.preempted == 15
    assert n.text(5) == "steal 20.0%, 3.0 preemptions a step"
    assert host_noise.between(None, b) is None and host_noise.between(a, None) is None
    same = host_noise.between(a, a)
    assert same.steal_pct == 0.0 and same.preempted == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sample_counts_preempted_threads():
    """More busy threads than this process may run on (hashing, which runs without the GIL):
    the scheduler deschedules them against their will, and the count over this process's
    threads, read while they still run, grows."""
    import hashlib
    import os

    cpus = len(os.sched_getaffinity(0))
    a = host_noise.sample()
    assert a is not None and sum(a.jiffies) > 0 and a.preempted >= 0
    data = bytes(1 << 20)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            hashlib.sha256(data).digest()

    threads = [threading.Thread(target=spin) for _ in range(2 * cpus + 2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    b = host_noise.sample()  # before they end: an ended thread leaves /proc/self/task
    stop.set()
    for t in threads:
        t.join()
    n = host_noise.between(a, b)
    assert 0.0 <= n.steal_pct <= 100.0
    assert n.preempted > 0
