"""The executor's thread pool when its workers sleep between layers.

With FREETOKEN_CPU_MOE_SPIN_US=0 (read once per process, so in a child process) a worker goes
to sleep right after each run, and every layer call has to wake it: a lost wake-up hangs the
call (the child's timeout fails the test), a worker that runs a stale job corrupts the output
(compared bit for bit with this process's spinning pool), and the pool's destructor has to
wake and join them all for the child to exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from cpu_moe_cases import random_nvfp4

from freetoken.moe.cpu_executor import CpuMoeExecutor, crowding


def case():
    """A small layer's forward arguments: (x, ids, route, w13, w2, scales)."""
    gen = torch.Generator().manual_seed(0)
    E, H, inter, T, k = 8, 256, 128, 2, 4
    w13, w2 = random_nvfp4(gen, E, 2 * inter, H), random_nvfp4(gen, E, H, inter)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    return x, ids, torch.full((T, k), 1.0 / k), w13, w2, torch.ones(E, 4)


CHILD = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_cpu_moe_pool import case
from freetoken.moe.cpu_executor import CpuMoeExecutor
args = case()
outs = []
for threads in (3, 4):
    ex = CpuMoeExecutor(threads)
    for i in range(40):
        if i % 8 == 0:
            time.sleep(0.005)  # the workers are asleep by now
        outs.append(ex.forward(*args))
    del ex  # the destructor wakes and joins its sleeping workers
torch.save(torch.stack(outs), sys.argv[1])
"""


def test_sleeping_workers_wake_for_every_call(tmp_path: Path):
    tests = str(Path(__file__).parent)
    out = tmp_path / "outs.pt"
    env = dict(os.environ, FREETOKEN_CPU_MOE_SPIN_US="0")
    subprocess.run([sys.executable, "-c", CHILD.format(tests=tests), str(out)], env=env,
                   check=True, timeout=60)
    want = CpuMoeExecutor(2).forward(*case())
    got = torch.load(out)
    assert got.shape[0] == 80
    for i in range(got.shape[0]):
        assert torch.equal(got[i], want), f"call {i}"


def test_threads_on_every_core_beside_a_gpu_are_named():
    """crowding: executor threads on every physical core (beside a GPU, where the hand-off
    worker and the host thread need one) get a message naming the flag, the cores and the
    default; fewer, or the default (None), get none."""
    assert crowding(None, cores=16) is None
    assert crowding(15, cores=16) is None
    why = crowding(16, cores=16)
    assert why is not None
    assert "--moe-cpu-threads 16" in why and "16 physical cores" in why
    assert "the default, 15," in why
    assert "the default, 1," in crowding(2, cores=1)
