"""Host weights on transparent huge pages (cpu_executor.huge_page_empty): the advice covers
the whole 2 MiB pages of the tensor, is skipped with FREETOKEN_CPU_MOE_HUGEPAGES=0, and where
the kernel grants huge pages on advice the memory really is on them once written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.moe import cpu_executor
from freetoken.moe.cpu_executor import advise_huge_pages, huge_page_empty, thp_mode

MiB = 1 << 20


def anon_huge_kib(addr: int, n: int) -> int:
    """AnonHugePages of the mappings that overlap [addr, addr + n) (/proc/self/smaps; the
    advice splits the tensor's mapping at its 2 MiB boundaries)."""
    total, cur = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            cur = lo < addr + n and addr < hi
        elif cur and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_advice_covers_the_whole_huge_pages_inside():
    t = torch.empty(9 * MiB, dtype=torch.uint8)
    a = t.data_ptr()
    lo, hi = -(-a // (2 * MiB)) * 2 * MiB, (a + 9 * MiB) // (2 * MiB) * 2 * MiB
    assert advise_huge_pages(t) in (hi - lo, 0)  # 0: madvise refused (no THP support)
    assert advise_huge_pages(torch.empty(MiB, dtype=torch.uint8)) == 0  # no whole huge page


def test_switch_off(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_MOE_HUGEPAGES", "0")
    assert advise_huge_pages(torch.empty(9 * MiB, dtype=torch.uint8)) == 0


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="no transparent huge pages")
def test_written_memory_is_on_huge_pages():
    t = huge_page_empty((64 * MiB,), torch.uint8)
    t.fill_(1)
    got = anon_huge_kib(t.data_ptr(), t.numel())
    if got == 0:  # THP on, but none free (fragmented memory): nothing to check here
        pytest.skip("the kernel had no free huge pages")
    assert got >= 32 * 1024, got


def test_bench_banks_use_it(monkeypatch):
    seen = []
    real = cpu_executor.advise_huge_pages
    monkeypatch.setattr(cpu_executor, "advise_huge_pages", lambda t: seen.append(t) or real(t))
    from freetoken.moe import cpu_bench

    w = cpu_bench.nvfp4_bank(1, 256, 2048, 0)
    ptrs = {t.data_ptr() for t in seen}
    assert w.data.data_ptr() in ptrs and w.scales.data_ptr() in ptrs
