"""Host weights on transparent huge pages (cpu_executor.huge_page_empty): the advice covers
the whole 2 MiB pages of the tensor (the kernel records it in the mapping's VmFlags) and is
skipped with FREETOKEN_CPU_MOE_HUGEPAGES=0. Whether free huge pages then back the memory is the
machine's state, not the code's, and is not asserted."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from freetoken.moe import cpu_executor
from freetoken.moe.cpu_executor import advise_huge_pages, huge_page_empty, thp_mode

MiB = 1 << 20


def mappings(addr: int, n: int) -> list[tuple[int, int, set[str]]]:
    """(start, end, VmFlags) of the mappings that overlap [addr, addr + n) (/proc/self/smaps;
    the advice splits the tensor's mapping at its 2 MiB boundaries)."""
    out: list[tuple[int, int, set[str]]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            cur = lo < addr + n and addr < hi
        elif cur and line.startswith("VmFlags:"):
            out.append((lo, hi, set(line.split()[1:])))
    return out


def test_advice_covers_the_whole_huge_pages_inside():
    t = torch.empty(9 * MiB, dtype=torch.uint8)
    a = t.data_ptr()
    lo, hi = -(-a // (2 * MiB)) * 2 * MiB, (a + 9 * MiB) // (2 * MiB) * 2 * MiB
    assert advise_huge_pages(t) in (hi - lo, 0)  # 0: madvise refused (no THP support)
    assert advise_huge_pages(torch.empty(MiB, dtype=torch.uint8)) == 0  # no whole huge page


def test_switch_off(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CPU_MOE_HUGEPAGES", "0")
    assert advise_huge_pages(torch.empty(9 * MiB, dtype=torch.uint8)) == 0


THP_OFF = pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in (
    "always", "madvise"), reason="the kernel has transparent huge pages off")


def whole_pages(a: int, n: int) -> tuple[int, int]:
    return -(-a // (2 * MiB)) * 2 * MiB, (a + n) // (2 * MiB) * 2 * MiB


def advised_bytes(maps, lo: int, hi: int) -> int:
    """Bytes of [lo, hi) inside mappings that carry the huge page advice (VmFlags `hg`)."""
    return sum(min(e, hi) - max(s, lo) for s, e, flags in maps if "hg" in flags
               and s < hi and lo < e)


@THP_OFF
def test_advice_marks_exactly_the_whole_huge_pages():
    """What the code controls: the kernel recorded the advice (VmFlags `hg`) for every whole
    2 MiB page inside the tensor and for nothing else of it. The memory is a fresh anonymous
    mapping of its own, so no earlier advice can be on it. (Whether free huge pages then back
    it depends on how fragmented memory is at that moment, which no test can count on: a fresh
    clone failed when only 18 of 64 MiB got huge pages.)"""
    mem = mmap.mmap(-1, 64 * MiB + 12345 + 100)
    t = torch.frombuffer(mem, dtype=torch.uint8)[100:]  # starts off a page boundary
    a, n = t.data_ptr(), t.numel()
    lo, hi = whole_pages(a, n)
    assert advise_huge_pages(t) == hi - lo
    maps = mappings(a, n)
    assert advised_bytes(maps, lo, hi) == hi - lo, maps
    assert advised_bytes(maps, a, lo) == 0, "advice before the first whole page"
    assert advised_bytes(maps, hi, a + n) == 0, "advice after the last whole page"
    del t


@THP_OFF
def test_huge_page_empty_is_advised():
    """The allocator behind huge_page_empty may hand out memory advised before (by an earlier
    tensor), so only the coverage of the whole pages is the code's to guarantee here."""
    t = huge_page_empty((64 * MiB + 12345,), torch.uint8)
    a, n = t.data_ptr(), t.numel()
    lo, hi = whole_pages(a, n)
    assert advised_bytes(mappings(a, n), lo, hi) == hi - lo


def test_bench_banks_use_it(monkeypatch):
    seen = []
    real = cpu_executor.advise_huge_pages
    monkeypatch.setattr(cpu_executor, "advise_huge_pages", lambda t: seen.append(t) or real(t))
    from freetoken.moe import cpu_bench

    w = cpu_bench.nvfp4_bank(1, 256, 2048, 0)
    ptrs = {t.data_ptr() for t in seen}
    assert w.data.data_ptr() in ptrs and w.scales.data_ptr() in ptrs
