"""The KV page pool's bookkeeping: free / in-use / cached pages, refcounts, and the chained-hash index.

Every page is in exactly one state:
  free    refcount 0, no hash, on the free list;
  in use  refcount > 0 (it may also be published, i.e. shared through the index);
  cached  refcount 0, published: reusable by a later request with the same prefix, evictable.
The eviction policy (minivllm.cache.eviction, the same classes the trace replay uses) tracks published pages
by hash and decides which cached page to give up. The pool tells it every use (`access` with the page's
parent: a hit or a publication) and every page that stops being used (`release`, a request's pages tail
first), and asks it for a victim only when an allocation finds no free page.

Pinned pages (minivllm.cache.pins decides which) are cached pages no allocation may take: the pool skips
them when it asks the policy for a victim, through the policy's own `can_evict` hook, so pins compose
with every policy, and does not count them as available. The pool also remembers the hashes of the pages
it evicted lately (a bounded memory), so that a lookup that stops can tell an evicted page from new content.
"""

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from minivllm.cache.eviction import EvictionPolicy
from minivllm.cache.free_pages import FreePages

logger = logging.getLogger(__name__)
EVICTED_MEMORY = 4  # evicted hashes remembered, in pools' sizes


class OutOfPages(RuntimeError):
    pass


@dataclass
class PoolCounters:
    pages_published: int = 0
    pages_evicted: int = 0  # cached pages the policy or the allocator gave up
    pages_unreachable: int = 0  # cached pages freed because a page of their prefix was evicted
    pages_restored: int = 0  # page hits handed to requests
    pages_from_disk: int = 0  # pages read back from the disk tier into the pool


class PagePool:
    def __init__(self, num_pages: int, page_size: int, policy: EvictionPolicy):
        self.num_pages = num_pages
        self.page_size = page_size
        self.policy = policy
        self.refcount = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.free = FreePages(num_pages)
        self.index: dict[bytes, int] = {}  # published hash -> page
        self.parent: dict[bytes, bytes | None] = {}  # published hash -> the published hash of the page before
        self.children: dict[bytes, set[bytes]] = {}  # published hash -> published hashes of the next pages
        self.num_cached = 0  # published pages with refcount 0
        self.pinned: set[bytes] = set()  # published hashes no allocation may evict
        self.num_pinned_cached = 0  # pinned pages with refcount 0
        self.evicted: OrderedDict[bytes, None] = OrderedDict()  # hashes evicted lately, oldest first
        self.counters = PoolCounters()
        self.on_drop: Callable[[bytes], None] | None = None  # told of each hash that stops being published

    # -- counts -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    def num_available(self) -> int:
        """Pages an allocation can get now: free ones plus cached ones it may evict (not pinned ones)."""
        return self.num_free + self.num_cached - self.num_pinned_cached

    def is_idle_pin(self, page: int) -> bool:
        """A cached page that is pinned: not available, and acquiring it takes nothing off what is."""
        return self.refcount[page] == 0 and self.page_hash[page] in self.pinned

    # -- lookup and sharing ---------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], token_ids: list[int], max_pages: int) -> list[int]:
        """Pages of the longest published prefix, from page 0, stopping at the first miss.

        A hit needs an equal chained hash *and* equal token ids, so a hash collision can never serve
        another prompt's KV.
        """
        pages: list[int] = []
        for i, h in enumerate(hashes[:max_pages]):
            page = self.index.get(h)
            tokens = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            if page is None or self.page_tokens[page] != tokens:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Share a published prefix (pages from page 0) with a request: the policy counts a use of each."""
        for page in pages:
            self.num_pinned_cached -= self.is_idle_pin(page)
            self.num_cached -= self.refcount[page] == 0
            self.refcount[page] += 1
            h = self.page_hash[page]
            self._uncache(self.policy.access(h, self.parent[h]))
        self.counters.pages_restored += len(pages)

    def release(self, pages: list[int]) -> None:
        """A request gives its pages back, tail first: cached pages leave the cache from a prompt's end."""
        for page in reversed(pages):
            assert self.refcount[page] > 0, f"page {page} released more often than acquired"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                h = self.page_hash[page]
                if h is None:
                    self.free.add(page)
                else:
                    self.num_cached += 1
                    self.num_pinned_cached += h in self.pinned
                    self.policy.release(h)

    # -- pins -----------------------------------------------------------------------------------------
    def pin(self, hashes: list[bytes]) -> None:
        """These published pages may not be evicted until unpinned."""
        for h in hashes:
            assert h in self.index and h not in self.pinned, "pinned a page that is not published, or twice"
            self.pinned.add(h)
            self.num_pinned_cached += self.refcount[self.index[h]] == 0

    def unpin(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.num_pinned_cached -= self.is_idle_pin(self.index[h])
            self.pinned.remove(h)

    # -- allocation -----------------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n pages for a request; `after`: its last page, which they follow where they can (see FreePages)."""
        if n > self.num_available():
            raise OutOfPages(f"need {n} pages, {self.num_available()} available")
        while len(self.free) < n:
            victim = self.policy.evict(lambda h: self.refcount[self.index[h]] == 0 and h not in self.pinned)
            assert victim is not None, "policy found no unreferenced, unpinned cached page"
            self._drop(victim)
        pages = self.free.take(n, after)
        for page in pages:
            self.refcount[page] = 1
        return pages

    # -- publication ----------------------------------------------------------------------------------
    def publish(self, page: int, h: bytes, parent: bytes | None, tokens: list[int]) -> bool:
        """Make a fully written page reusable under its chained hash. False if not published.

        A page whose hash is already published stays private (its twin serves lookups), and so does
        one whose parent is no longer published: no lookup could ever reach it.
        """
        if h in self.index or (parent is not None and parent not in self.index):
            return False
        assert self.refcount[page] > 0 and self.page_hash[page] is None
        self.page_hash[page] = h
        self.page_tokens[page] = tuple(tokens)
        self.index[h] = page
        self.parent[h] = parent
        if parent is not None:
            self.children.setdefault(parent, set()).add(h)
        self.counters.pages_published += 1
        self._uncache(self.policy.access(h, parent))
        return True

    # -- eviction -------------------------------------------------------------------------------------
    def _uncache(self, evicted: list) -> None:
        """Pages the policy just evicted stop being published; the unused ones are free at once. A pinned
        one stays: a policy that evicts on admission (S3FIFO) is given it back as a new use, which may
        evict others in turn (pins are at most half the pool, so this ends on an unpinned page)."""
        evicted = list(evicted)
        while evicted:
            h = evicted.pop(0)
            if h in self.pinned:
                evicted += self.policy.access(h, self.parent[h])
                if self.refcount[self.index[h]] == 0:
                    self.policy.release(h)
            elif h in self.index:
                self._drop(h)

    def _drop(self, h: bytes, count_orphans: bool = True) -> None:
        """Unpublish h, which the policy no longer tracks, after the pages extending it, deepest first:
        without h no lookup reaches them, so they are freed before any reachable page is. (A
        prefix-aware policy never evicts a page with cached children: pages_unreachable stays 0.)"""
        for child in self.children.pop(h, ()):
            if child in self.index:
                self.counters.pages_unreachable += count_orphans and self.refcount[self.index[child]] == 0
                self._drop(child, count_orphans)
                self.policy.remove(child)
        assert h not in self.pinned, "a pinned page was evicted"
        page = self.index.pop(h)
        if self.on_drop is not None:
            self.on_drop(h)
        self._remember_evicted(h)
        siblings = self.children.get(self.parent.pop(h))
        if siblings is not None:
            siblings.discard(h)
        self.counters.pages_evicted += 1
        self.page_hash[page] = None
        self.page_tokens[page] = None
        if self.refcount[page] == 0:
            self.num_cached -= 1
            self.free.add(page)

    def _remember_evicted(self, h: bytes) -> None:
        self.evicted[h] = None
        self.evicted.move_to_end(h)
        if len(self.evicted) > EVICTED_MEMORY * self.num_pages:
            self.evicted.popitem(last=False)

    def clear_cache(self) -> None:
        """Forget every published page (their KV is gone); unused ones become free."""
        for h in list(self.index):
            if h in self.index:
                self._drop(h, count_orphans=False)
                self.policy.remove(h)

    # -- invariants -----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free = set(self.free)
        for page in range(self.num_pages):
            states = (
                (page in free)
                + (self.refcount[page] > 0)
                + (self.refcount[page] == 0 and self.page_hash[page] is not None)
            )
            assert states == 1, f"page {page} is in {states} states"
        in_use = sum(1 for c in self.refcount if c > 0)
        cached = sum(1 for p in self.index.values() if self.refcount[p] == 0)
        assert cached == self.num_cached, f"cached count {self.num_cached} != {cached}"
        assert self.num_free + in_use + cached == self.num_pages
        assert self.pinned <= self.index.keys(), "a pinned page is not published"
        idle_pins = sum(1 for h in self.pinned if self.refcount[self.index[h]] == 0)
        assert idle_pins == self.num_pinned_cached, (
            f"pinned cached count {self.num_pinned_cached} != {idle_pins}"
        )
        assert len(self.policy) == len(self.index), "the policy tracks pages the index does not"
        for h, page in self.index.items():
            assert self.page_hash[page] == h and h in self.policy, "index and policy disagree"
            parent = self.parent[h]
            assert parent is None or parent in self.index, f"published page {page} is unreachable"
        if self.policy.prefix_aware:
            assert self.counters.pages_unreachable == 0, (
                "a prefix-aware policy evicted a page with cached children"
            )
