"""The KV cache manager: the one owner of which pages each request holds, which prefix is cached, and what
may be evicted.

The scheduler decides who runs and asks this manager whether the pages are there ("can this request be
admitted", "give it room for N tokens", "publish what the step computed", "release"). A request's page
table lives on its Sequence (the runner reads it to build the step's layout) but only this manager
changes it. The PagePool is the storage bookkeeping (refcounts, free list, the chained-hash index); the
eviction policy (minivllm.cache.eviction) picks victims inside it.

With a disk tier (minivllm.cache.disk_tier) under the pool, a prefix lookup continues on disk where RAM
stops: admission allocates pool pages for the pages found there and starts reading them; the request is
"restoring" (the scheduler skips it) until the engine copies the bytes into the pools (`apply_restores`),
and then they are published and count as cached. Every page published is also handed to the disk's writer
after the step (`write_behind`). The KV bytes move between the pools and numpy on the engine's side (the
callbacks): nothing here touches MLX.

Pins (minivllm.cache.pins) keep a prefix cached for a TTL: the pool never evicts a pinned page. A request
that asks for pins (SamplingParams.pins) pins its published prompt prefixes when it ends; a restore of a
pinned prefix refreshes its pin. With a disk tier, pinned pages are also written to disk (if the disk lacks
them), and the disk keeps them while they are pinned. At a request's first admission its restore is
explained: where it stopped short, and why (PrefixMiss).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from minivllm.cache.disk_tier import DiskRead, DiskTier, PageRecord
from minivllm.cache.eviction import make_policy
from minivllm.cache.page_pool import PagePool, PoolCounters
from minivllm.cache.pins import PinChange, PinCounters, PinInfo, Pins

if TYPE_CHECKING:  # the engine's request state: page_table, token_ids, num_computed_tokens, ...
    from minivllm.engine.sequence import Sequence


@dataclass
class PoolState:
    """What the pool holds now: every page is free, in use or cached."""

    total: int
    free: int
    in_use: int
    cached: int


@dataclass(eq=False)
class DiskRestore:
    """A request's prefix pages being read from disk into the pool pages page_table[first:] holds."""

    seq: "Sequence"
    first: int
    read: DiskRead


@dataclass(frozen=True)
class PrefixMiss:
    """Why a prompt restored less than it could: the first page of it the cache did not hold."""

    token: int  # the first token that differs from the cached prompts (new), or the page's first (evicted)
    reason: str  # "evicted": cached once and given up lately; "new": never cached (or long ago); "off"


@dataclass
class PageWrite:
    """A page published in this step, to be copied to disk after it."""

    page: int
    record: PageRecord


class KVManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        eviction: str,
        enable_prefix_caching: bool = True,
        disk: DiskTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.eviction = eviction
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock  # the pins' TTLs run on it
        self.pool = self._new_pool(PoolCounters())
        self.pins = self._new_pins(PinCounters())
        self.disk = disk
        self.restores: dict[Sequence, DiskRestore] = {}  # requests waiting for pages from disk
        self._disk_writes: list[PageWrite] = []

    def _new_pool(self, counters: PoolCounters) -> PagePool:
        pool = PagePool(self.num_pages, self.page_size, make_policy(self.eviction, self.num_pages))
        pool.counters = counters
        return pool

    def _new_pins(self, counters: PinCounters) -> Pins:
        pins = Pins(self.num_pages // 2, self.clock)  # half the pool: pins never starve running requests
        pins.counters = counters
        return pins

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
        hashes = seq.full_page_hashes(self.page_size)
        return self.pool.lookup(hashes, seq.token_ids, self._restorable_pages(seq))

    def _restorable_pages(self, seq: "Sequence") -> int:
        return (len(seq.token_ids) - 1) // self.page_size

    def _on_disk(self, seq: "Sequence", first: int) -> list[PageRecord]:
        """The pages on disk that continue seq's cached prefix from page `first` on."""
        if self.disk is None or not self.enable_prefix_caching:
            return []
        hashes = seq.full_page_hashes(self.page_size)[first : self._restorable_pages(seq)]
        return self.disk.lookup(hashes, seq.token_ids, first)

    # -- a request's pages ----------------------------------------------------------------------------
    def admit(self, seq: "Sequence") -> int | None:
        """Restore seq's longest cached prefix and allocate pages for the rest of its tokens; the tokens
        restored from RAM, or None (nothing changed) when the pool cannot hold it now. Pages the disk
        tier continues the prefix with start being read into the first allocated pages: seq is
        restoring until apply_restores."""
        hits = self._cached_prefix(seq)
        need = self.pages_for(len(seq.token_ids)) - len(hits)
        self._unblock(hits, need)
        # acquiring un-caches them (pinned ones were not counted as available)
        taken_off_cache = sum(1 for p in hits if self.pool.refcount[p] == 0 and not self.pool.is_idle_pin(p))
        if need > self.num_available() - taken_off_cache:
            return None
        on_disk = self._on_disk(seq, len(hits))
        if seq.num_admissions == 0:  # before the allocation evicts what the prompt is compared with
            seq.prefix_miss = self._miss(seq, len(hits) + len(on_disk))
        self.pool.acquire(hits)
        self.pins.refresh(seq.full_page_hashes(self.page_size)[: len(hits)])
        seq.page_table = hits + self.pool.allocate(need, after=hits[-1] if hits else None)
        seq.num_computed_tokens = len(hits) * self.page_size
        seq.publish_cursor = len(hits)
        if on_disk:
            self.restores[seq] = DiskRestore(seq, len(hits), self.disk.read(on_disk))
        return seq.num_computed_tokens

    def _unblock(self, hits: list[int], need: int) -> None:
        """Pins never keep a request out for good: while it could not fit even with every unpinned page
        free (hits and need new pages), the least recently refreshed pins give way."""
        if len(hits) + need <= self.num_pages - self.pins.num_pages:
            return  # fits beside every pin (the common case: no count of pinned hits)
        hit = set(hits)
        while self.pins.num_pins:
            blocking = sum(1 for h in self.pool.pinned if self.pool.index[h] not in hit)
            if len(hits) + need <= self.num_pages - blocking:
                return
            self._unpin(self.pins.give_way())

    def _miss(self, seq: "Sequence", found: int) -> PrefixMiss | None:
        """Why seq's restore stops at page `found` (RAM and disk together), or None if it restores all
        it may. A page the pool evicted lately is "evicted" (a bounded memory: long ago counts as new)."""
        if found >= self._restorable_pages(seq):
            return None
        if not self.enable_prefix_caching:
            return PrefixMiss(0, "off")
        hashes = seq.full_page_hashes(self.page_size)
        if hashes[found] in self.pool.evicted:
            return PrefixMiss(found * self.page_size, "evicted")
        return PrefixMiss(self._divergence(seq, found, hashes), "new")

    def _divergence(self, seq: "Sequence", found: int, hashes: list[bytes]) -> int:
        """The first token of page `found` that no cached continuation of the pages before it has: where
        seq's prompt differs from the cached ones (the page's start if nothing continues them)."""
        start = found * self.page_size
        mine = seq.token_ids[start : start + self.page_size]
        same = 0
        for child in self.pool.children.get(hashes[found - 1], ()) if found else ():
            theirs = self.pool.page_tokens[self.pool.index[child]]
            same = max(same, next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine)))
        return start + same

    def is_restoring(self, seq: "Sequence") -> bool:
        return seq in self.restores

    def wait_for_restores(self, timeout: float) -> None:
        """Until a pending disk read is done (the engine has nothing else to step), at most timeout s."""
        if self.restores:
            self.disk.wait_for_reads([r.read for r in self.restores.values()], timeout)

    def apply_restores(
        self, write_pages: Callable[[list[int], np.ndarray], None]
    ) -> list[tuple["Sequence", int]]:
        """Finish the disk reads that are done: write_pages(pages, payloads) puts the bytes into the pools
        (the engine's runner, on the stepping thread), then the pages are published and computed. Each
        request with the tokens it got from disk (a prefix of what it asked for: the first page the
        disk could not serve, and those after it, are computed instead)."""
        restored = []
        for r in [r for r in self.restores.values() if r.read.done]:
            del self.restores[r.seq]
            n = r.read.num_ok
            if n:
                write_pages(r.seq.page_table[r.first : r.first + n], r.read.payloads[:n])
            self._publish_restored(r.seq, r.first, n)
            restored.append((r.seq, n * self.page_size))
        return restored

    def _publish_restored(self, seq: "Sequence", first: int, n: int) -> None:
        hashes = seq.full_page_hashes(self.page_size)
        for i in range(first, first + n):
            tokens = seq.token_ids[i * self.page_size : (i + 1) * self.page_size]
            parent = hashes[i - 1] if i else None
            self.pool.publish(seq.page_table[i], hashes[i], parent, tokens)  # a twin stays private
        seq.num_computed_tokens = (first + n) * self.page_size
        seq.publish_cursor = first + n
        self.pool.counters.pages_from_disk += n

    def _cancel_restore(self, seq: "Sequence") -> None:
        r = self.restores.pop(seq, None)
        if r is not None:
            r.read.cancelled = True  # the reader stops; its bytes are never applied

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
                self._write_to_disk(seq, i, seq.page_table[i])
        seq.publish_cursor = max(seq.publish_cursor, full)

    def _write_to_disk(self, seq: "Sequence", i: int, page: int) -> None:
        """Queue page i of seq's tokens, held by pool page `page`, for the disk tier (written after the
        step, if the disk lacks it)."""
        if self.disk is None:
            return
        hashes = seq.full_page_hashes(self.page_size)
        tokens = tuple(seq.token_ids[i * self.page_size : (i + 1) * self.page_size])
        record = PageRecord(hashes[i], hashes[i - 1] if i else None, tokens)
        self._disk_writes.append(PageWrite(page, record))

    # -- pins -----------------------------------------------------------------------------------------
    def pin(self, seq: "Sequence") -> None:
        """Pin the prompt prefixes seq asked for (params.pins: tokens, TTL), as far as they are published;
        seq.pins says what each got. Called before seq releases its pages."""
        for tokens, ttl_s in seq.params.pins:
            n = min(tokens, seq.num_prompt_tokens) // self.page_size
            hashes = seq.full_page_hashes(self.page_size)[:n]
            pages = self.pool.lookup(hashes, seq.token_ids, min(n, self.pins.limit))
            kept = hashes[: len(pages)]
            self._pin_change(self.pins.add(kept, ttl_s))
            for i, page in enumerate(pages):  # the disk tier's budget may still evict them later
                self._write_to_disk(seq, i, page)
            left = self.pins.remaining_s(kept[-1]) if kept else 0.0
            seq.pins.append(PinInfo(len(kept) * self.page_size, len(kept), left))

    def expire_pins(self) -> None:
        """Release the pins whose TTL is up (the engine calls it every step)."""
        self._unpin(self.pins.expire())

    def _pin_change(self, change: PinChange) -> None:
        self._unpin(change.unpinned)
        self.pool.pin(change.pinned)
        if self.disk is not None:
            self.disk.pin(change.pinned)

    def _unpin(self, hashes: list[bytes]) -> None:
        self.pool.unpin(hashes)
        if self.disk is not None:
            self.disk.unpin(hashes)

    @property
    def pin_counters(self) -> PinCounters:
        return self.pins.counters

    def write_behind(self, read_pages: Callable[[list[int]], np.ndarray]) -> None:
        """Hand the pages published since the last call, and not on disk yet, to the disk's writer:
        read_pages(pages) copies their KV out of the pools (the engine's runner, after the step's
        evaluation). A page that stopped holding its hash since (evicted, reused) is skipped."""
        writes = [
            w
            for w in self._disk_writes
            if self.pool.page_hash[w.page] == w.record.hash and not self.disk.contains(w.record.hash)
        ]
        self._disk_writes = []
        if writes:
            self.disk.write([w.record for w in writes], read_pages([w.page for w in writes]))

    def release(self, seq: "Sequence") -> None:
        """seq gives all its pages back (what it published stays cached) and has no KV any more."""
        self.pool.release(seq.page_table)
        self.forget(seq)

    def forget(self, seq: "Sequence") -> None:
        self._cancel_restore(seq)
        seq.page_table = []
        seq.num_computed_tokens = 0
        seq.publish_cursor = 0

    def reset(self, holders: "list[Sequence]") -> None:
        """Start afresh after a fault that may have left the bookkeeping or the KV half-updated: holders
        lose their pages without releasing them, and the cache is forgotten (counters are kept). The disk
        tier stays: its pages were verified when written, and are again when read."""
        for seq in holders:
            self.forget(seq)
        for seq in list(self.restores):
            self._cancel_restore(seq)
        self._disk_writes = []
        if self.disk is not None:
            self.disk.unpin(self.pins.clear())  # the pins go with the pool
        self.pool = self._new_pool(self.pool.counters)
        self.pins = self._new_pins(self.pins.counters)

    def clear_cache(self) -> None:
        self._unpin(self.pins.clear())
        self.pool.clear_cache()

    def disk_stats(self) -> dict:
        return self.disk.stats() if self.disk is not None else {}

    def close(self) -> None:
        """Write what the disk tier has queued and release its directory; from now on RAM alone (a request
        still waiting for disk pages computes them)."""
        if self.disk is None:
            return
        for seq in list(self.restores):
            self._cancel_restore(seq)
        self._disk_writes = []
        self.disk.close()
        self.disk = None

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
        assert set(self.restores) <= set(holders), "a request restores pages it does not hold"
