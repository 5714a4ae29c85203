"""The paged KV cache's bookkeeping: a page pool with reference counts, and prefix caches.

Tensors live in the runner (one `[2, num_pages, page_size, n_kv, d]` tensor per attention
layer); here are only page ids. A page is owned by everyone holding a reference: the requests
whose page tables list it and, for the radix cache, the prefix tree. It returns to the free
list when the last reference goes.

Prefix caches (a tiny registry, `make_prefix_cache`):
- `RadixCache`: a tree keyed by full pages of token ids. A request that starts with a cached
  prefix shares those pages (by reference) and skips their prefill. Unreferenced cached pages
  are evicted least-recently-used first when the pool runs dry.
- `NaiveCache`: no reuse; pages are freed when their request ends.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field


class PagePool:
    """Page ids 0..num_pages-1 with reference counts and a free list."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (refcount 1), or None (and nothing taken) if too few are free."""
        if n > len(self.free):
            return None
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            self.refcount[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free.append(p)
            elif self.refcount[p] < 0:
                raise AssertionError(f"KV page {p} released more often than taken")


class NaiveCache:
    """No prefix reuse."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool

    def match(self, token_ids: list[int]) -> list[int]:
        return []

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        pass

    def evict(self, n: int) -> int:
        return 0

    @property
    def num_cached_pages(self) -> int:
        return 0


_clock = itertools.count()


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]  # the page's page_size token ids
    page: int
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_use: int = 0


class RadixCache:
    """Prefix tree over full pages; the tree holds one reference on each page in it."""

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.root = _Node(key=(), page=-1, parent=None)
        self._num_pages = 0

    @property
    def num_cached_pages(self) -> int:
        return self._num_pages

    def _keys(self, token_ids: list[int]) -> list[tuple[int, ...]]:
        ps = self.pool.page_size
        return [tuple(token_ids[i : i + ps]) for i in range(0, len(token_ids) - ps + 1, ps)]

    def match(self, token_ids: list[int]) -> list[int]:
        """Pages of the longest cached prefix of whole pages; the caller gets a reference."""
        node, pages, now = self.root, [], next(_clock)
        for key in self._keys(token_ids):
            node = node.children.get(key)
            if node is None:
                break
            node.last_use = now
            pages.append(node.page)
        self.pool.incref(pages)
        return pages

    def insert(self, token_ids: list[int], pages: list[int]) -> None:
        """Cache the full pages of `token_ids` (whose KV `pages` hold, in order)."""
        node, now = self.root, next(_clock)
        for key, page in zip(self._keys(token_ids), pages):
            child = node.children.get(key)
            if child is None:  # a new page for the tree; an existing one stays as it is
                child = _Node(key=key, page=page, parent=node)
                node.children[key] = child
                self.pool.incref([page])
                self._num_pages += 1
            child.last_use = now
            node = child

    def evict(self, n: int) -> int:
        """Free up to n pages that only the tree holds, least recently used leaves first."""
        leaves = [x for x in self._nodes() if not x.children and self.pool.refcount[x.page] == 1]
        leaves.sort(key=lambda x: x.last_use)
        freed = 0
        while leaves and freed < n:
            leaf = leaves.pop(0)
            parent = leaf.parent
            del parent.children[leaf.key]
            self.pool.decref([leaf.page])
            self._num_pages -= 1
            freed += 1
            if parent is not self.root and not parent.children and (
                self.pool.refcount[parent.page] == 1
            ):
                leaves.append(parent)  # its parent may go next (it was used no later)
                leaves.sort(key=lambda x: x.last_use)
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def make_prefix_cache(cache_type: str, pool: PagePool) -> RadixCache | NaiveCache:
    caches = {"radix": RadixCache, "naive": NaiveCache}
    if cache_type not in caches:
        raise ValueError(f"cache_type must be one of {', '.join(caches)}, got {cache_type!r}")
    return caches[cache_type](pool)
