"""The KV cache manager: the one owner of which pages each request holds, which prefix is cached, and what
may be evicted.

The scheduler decides who runs and asks this manager whether the pages are there ("can this request be
admitted", "give it room for N tokens", "publish what the step computed", "release"). A request's page
table lives on its Sequence (the runner reads it to build the step's layout) but only this manager
changes it. The PagePool is the storage bookkeeping (refcounts, free list, the chained-hash index); the
eviction policy (minivllm.cache.eviction) picks victims inside it.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.cache.eviction import make_policy
from minivllm.cache.page_pool import PagePool, PoolCounters

if TYPE_CHECKING:  # the engine's request state: page_table, token_ids, num_computed_tokens, ...
    from minivllm.engine.sequence import Sequence


@dataclass
class PoolState:
    """What the pool holds now: every page is free, in use or cached."""

    total: int
    free: int
    in_use: int
    cached: int


class KVManager:
    def __init__(self, num_pages: int, page_size: int, eviction: str, enable_prefix_caching: bool = True):
        self.num_pages = num_pages
        self.page_size = page_size
        self.eviction = eviction
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = self._new_pool(PoolCounters())

    def _new_pool(self, counters: PoolCounters) -> PagePool:
        pool = PagePool(self.num_pages, self.page_size, make_policy(self.eviction, self.num_pages))
        pool.counters = counters
        return pool

    # -- questions ------------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_short(self, seq: "Sequence", num_tokens: int) -> int:
        """Pages seq lacks to hold num_tokens (<= 0: none)."""
        return self.pages_for(num_tokens) - len(seq.page_table)

    def num_available(self) -> int:
        """Pages an allocation can get now: free ones plus cached ones it may evict."""
        return self.pool.num_available()

    def free_room(self, seq: "Sequence") -> int:
        """Tokens seq can hold in its pages and the free ones, evicting no cached page (a draft's room)."""
        return (len(seq.page_table) + self.pool.num_free) * self.page_size

    def state(self) -> PoolState:
        p = self.pool
        return PoolState(p.num_pages, p.num_free, p.num_in_use, p.num_cached)

    @property
    def counters(self) -> PoolCounters:
        return self.pool.counters

    def cached_prefix_pages(self, seq: "Sequence") -> int:
        """How many pages of seq's longest cached prefix admission would restore now."""
        return len(self._cached_prefix(seq))

    def _cached_prefix(self, seq: "Sequence") -> list[int]:
        """The pages of seq's longest cached prefix. The last token is always computed, for its logits:
        at most floor((N-1)/P) pages of N tokens."""
        if not self.enable_prefix_caching:
            return []
        n, hashes = len(seq.token_ids), seq.full_page_hashes(self.page_size)
        return self.pool.lookup(hashes, seq.token_ids, (n - 1) // self.page_size)

    # -- a request's pages ----------------------------------------------------------------------------
    def admit(self, seq: "Sequence") -> int | None:
        """Restore seq's longest cached prefix and allocate pages for the rest of its tokens; the tokens
        restored, or None (nothing changed) when the pool cannot hold it now."""
        hits = self._cached_prefix(seq)
        need = self.pages_for(len(seq.token_ids)) - len(hits)
        taken_off_cache = sum(1 for p in hits if self.pool.refcount[p] == 0)  # acquiring un-caches them
        if need > self.num_available() - taken_off_cache:
            return None
        self.pool.acquire(hits)
        seq.page_table = hits + self.pool.allocate(need, after=hits[-1] if hits else None)
        seq.num_computed_tokens = len(hits) * self.page_size
        seq.publish_cursor = len(hits)
        return seq.num_computed_tokens

    def grow(self, seq: "Sequence", num_tokens: int) -> None:
        """Give seq pages for num_tokens (the caller checked that they are available)."""
        need = self.pages_short(seq, num_tokens)
        if need > 0:
            after = seq.page_table[-1] if seq.page_table else None
            seq.page_table.extend(self.pool.allocate(need, after=after))

    def truncate(self, seq: "Sequence", num_tokens: int) -> None:
        """Give back seq's pages past those holding num_tokens tokens: after a verification, the pages
        only rejected drafted tokens were written to. They were allocated for this request alone and
        never published (publication stops at the accepted, computed tokens): they go back free."""
        keep = self.pages_for(num_tokens)
        tail = seq.page_table[keep:]
        for page in tail:
            assert self.pool.refcount[page] == 1 and self.pool.page_hash[page] is None, (
                f"page {page} past the accepted tokens of {seq.request_id} is shared or published"
            )
        self.pool.release(tail)
        del seq.page_table[keep:]
        seq.publish_cursor = min(seq.publish_cursor, keep)

    def publish(self, seq: "Sequence") -> None:
        """Publish every full page whose KV is computed (and evaluated: the engine calls this after the
        step's evaluation)."""
        if not self.enable_prefix_caching:
            return
        hashes = seq.full_page_hashes(self.page_size)
        full = min(seq.num_computed_tokens // self.page_size, len(hashes))
        for i in range(seq.publish_cursor, full):
            end = (i + 1) * self.page_size
            tokens = seq.token_ids[end - self.page_size : end]
            parent = hashes[i - 1] if i else None
            if self.pool.publish(seq.page_table[i], hashes[i], parent, tokens):
                seq.num_pages_published += 1
                # a page wholly within the prompt is prompt cache a later request can restore
                # (Anthropic's usage counts it as cache creation)
                if end <= seq.num_prompt_tokens:
                    seq.num_published_prompt_tokens += self.page_size
        seq.publish_cursor = max(seq.publish_cursor, full)

    def release(self, seq: "Sequence") -> None:
        """seq gives all its pages back (what it published stays cached) and has no KV any more."""
        self.pool.release(seq.page_table)
        self.forget(seq)

    @staticmethod
    def forget(seq: "Sequence") -> None:
        seq.page_table = []
        seq.num_computed_tokens = 0
        seq.publish_cursor = 0

    def reset(self, holders: "list[Sequence]") -> None:
        """Start afresh after a fault that may have left the bookkeeping or the KV half-updated: holders
        lose their pages without releasing them, and the cache is forgotten (counters are kept)."""
        for seq in holders:
            self.forget(seq)
        self.pool = self._new_pool(self.pool.counters)

    def clear_cache(self) -> None:
        self.pool.clear_cache()

    # -- invariants -----------------------------------------------------------------------------------
    def check_invariants(self, holders: "list[Sequence]") -> None:
        """The pool's own invariants, and: the pages in use are exactly those the holders' tables hold."""
        self.pool.check_invariants()
        in_use = sum(self.pool.refcount)
        held = sum(len(s.page_table) for s in holders)
        assert in_use == held, f"pages referenced {in_use} != pages held by running requests {held}"
        free = set(self.pool.free)
        for seq in holders:
            assert not free.intersection(seq.page_table), f"{seq.request_id} holds a free page"
