"""The KV cache manager: the one owner of which pages each request holds, which prefix is cached, and what
may be evicted.

The scheduler decides who runs and asks this manager whether the pages are there ("can this request be
admitted", "give it room for N tokens", "publish what the step computed", "release"). A request's page
table lives in its KVRequest (minivllm.cache.kv_request), which the engine's request holds (the runner
reads the table to build the step's layout), but only this manager changes it. The PagePool is the storage bookkeeping (refcounts, free list, the chained-hash index); the
eviction policy (minivllm.cache.eviction) picks victims inside it.

With a disk tier (minivllm.cache.disk_tier) under the pool, a prefix lookup continues on disk where RAM
stops: admission allocates pool pages for the pages found there and starts reading them; the request is
"restoring" (the scheduler skips it) until the engine copies the bytes into the pools (`apply_restores`),
and then they are published and count as cached. Every page published is also handed to the disk's writer
after the step (`write_behind`). The KV bytes move between the pools and numpy on the engine's side (the
callbacks): nothing here touches MLX.

Pins (minivllm.cache.pins) keep a prefix cached for a TTL: the pool never evicts a pinned page. A request
that asks for pins (CacheHints.pins) pins its published prompt prefixes when it ends; a restore of a
pinned prefix refreshes its pin. With a disk tier, pinned pages are also written to disk (if the disk lacks
them), and the disk keeps them while they are pinned. At a request's first admission its restore is
explained: where it stopped short, and why (PrefixMiss).

A hybrid model (linear-attention layers with a recurrent state) restores a prefix only up to a page
whose end has a snapshot of that state (minivllm.cache.state_snapshots): the runner keeps the state at
the points `state_points` names (every snapshot_every tokens, the end of what a prompt may restore, the
pages a prefix flight's waiter stops at) and `publish_states` keeps them beside their published pages.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minivllm.cache.disk_tier import DiskRead, DiskTier, PageRecord
from minivllm.cache.eviction import make_policy
from minivllm.cache.kv_request import KVRequest, MissReason, PrefixMiss
from minivllm.cache.page_pool import PagePool, PoolCounters
from minivllm.cache.pins import PinChange, PinCounters, PinInfo, Pins
from minivllm.cache.state_snapshots import Snapshot, StateSnapshots

MAX_WANTED_STATES = 4096  # page hashes waiting requests want a snapshot at, at most (then forgotten)


@dataclass
class PoolState:
    """What the pool holds now: every page is free, in use or cached."""

    total: int
    free: int
    in_use: int
    cached: int


@dataclass(eq=False)
class DiskRestore:
    """A request's prefix pages being read from disk into the pool pages page_table[first:] holds, and a
    hybrid model's recurrent state at their end (from the state tier: `state`)."""

    req: KVRequest
    first: int
    read: DiskRead
    state: DiskRead | None = None

    @property
    def done(self) -> bool:
        return self.read.done and (self.state is None or self.state.done)

    @property
    def reads(self) -> list[DiskRead]:
        return [self.read] + ([self.state] if self.state is not None else [])


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
        snapshots: StateSnapshots | None = None,
        snapshot_every: int = 1024,  # tokens
        state_disk: DiskTier | None = None,
    ):
        """snapshots: a hybrid model's recurrent-state snapshots (None for other models); snapshot_every:
        tokens between the snapshots a long prompt or output keeps (a multiple of page_size); state_disk:
        the disk tier of those snapshots (one file per snapshot, named by its page's hash), beside `disk`."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.eviction = eviction
        self.enable_prefix_caching = enable_prefix_caching
        self.clock = clock  # the pins' TTLs run on it
        self.snapshots = snapshots
        self.snapshot_every = snapshot_every
        self.wanted_states: set[bytes] = set()
        self.state_disk = state_disk
        self._state_writes: list[tuple[PageRecord, object]] = []
        self.pool = self._new_pool(PoolCounters())
        self.pins = self._new_pins(PinCounters())
        self.disk = disk
        self.restores: dict[KVRequest, DiskRestore] = {}  # requests waiting for pages from disk
        self._disk_writes: list[PageWrite] = []

    def _new_pool(self, counters: PoolCounters) -> PagePool:
        pool = PagePool(self.num_pages, self.page_size, make_policy(self.eviction, self.num_pages))
        pool.counters = counters
        if self.snapshots is not None:
            self.snapshots.clear()
            pool.on_drop = self.snapshots.drop  # a snapshot lives no longer than its page
        return pool

    def _new_pins(self, counters: PinCounters) -> Pins:
        pins = Pins(self.num_pages // 2, self.clock)  # half the pool: pins never starve running requests
        pins.counters = counters
        return pins

    # -- questions ------------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_short(self, req: KVRequest, num_tokens: int) -> int:
        """Pages req lacks to hold num_tokens (<= 0: none)."""
        return self.pages_for(num_tokens) - len(req.page_table)

    def num_available(self) -> int:
        """Pages an allocation can get now: free ones plus cached ones it may evict."""
        return self.pool.num_available()

    def free_room(self, req: KVRequest) -> int:
        """Tokens req can hold in its pages and the free ones, evicting no cached page (a draft's room)."""
        return (len(req.page_table) + self.pool.num_free) * self.page_size

    def state(self) -> PoolState:
        p = self.pool
        return PoolState(p.num_pages, p.num_free, p.num_in_use, p.num_cached)

    @property
    def counters(self) -> PoolCounters:
        return self.pool.counters

    def cached_prefix_pages(self, req: KVRequest) -> int:
        """How many pages of req's longest cached prefix are in RAM now (a hybrid model's admission
        restores them up to the last one with a snapshot of its state: _resume_point)."""
        return len(self._cached_prefix(req))

    def _cached_prefix(self, req: KVRequest) -> list[int]:
        """The pages of req's longest cached prefix. The last token is always computed, for its logits:
        at most floor((N-1)/P) pages of N tokens."""
        if not self.enable_prefix_caching:
            return []
        hashes = req.full_page_hashes(self.page_size)
        return self.pool.lookup(hashes, req.token_ids, self._restorable_pages(req))

    def _restorable_pages(self, req: KVRequest) -> int:
        return (len(req.token_ids) - 1) // self.page_size

    def _on_disk(self, req: KVRequest, first: int) -> list[PageRecord]:
        """The pages on disk that continue req's cached prefix from page `first` on."""
        if self.disk is None or not self.enable_prefix_caching:
            return []
        hashes = req.full_page_hashes(self.page_size)[first : self._restorable_pages(req)]
        return self.disk.lookup(hashes, req.token_ids, first)

    # -- a request's pages ----------------------------------------------------------------------------
    def admit(self, req: KVRequest) -> int | None:
        """Restore req's longest cached prefix and allocate pages for the rest of its tokens; the tokens
        restored from RAM, or None (nothing changed) when the pool cannot hold it now. Pages the disk
        tier continues the prefix with start being read into the first allocated pages: req is
        restoring until apply_restores."""
        state_record = None
        if self.snapshots is None:
            hits = self._cached_prefix(req)
        else:
            hits, on_disk, state_record = self._resume_point(req)
        need = self.pages_for(len(req.token_ids)) - len(hits)
        self._unblock(req, hits, need)
        # acquiring un-caches them (pinned ones were not counted as available)
        taken_off_cache = sum(1 for p in hits if self.pool.refcount[p] == 0 and not self.pool.is_idle_pin(p))
        if need > self.num_available() - taken_off_cache:
            return None
        if self.snapshots is None:
            on_disk = self._on_disk(req, len(hits))
        if not req.admitted:  # before the allocation evicts what the prompt is compared with
            req.prefix_miss = self._miss(req, len(hits) + len(on_disk))
        req.admitted = True
        self.pool.acquire(hits)
        self.pins.refresh(req.full_page_hashes(self.page_size)[: len(hits)])
        req.page_table = hits + self.pool.allocate(need, after=hits[-1] if hits else None)
        req.num_computed_tokens = len(hits) * self.page_size
        req.publish_cursor = len(hits)
        req.restored_state = None
        if self.snapshots is not None and state_record is None and hits:  # a hybrid model's state, in RAM
            req.restored_state = self.snapshots.get(req.full_page_hashes(self.page_size)[len(hits) - 1]).state
            self.snapshots.counters.snapshots_restored += 1
        if on_disk or state_record is not None:
            state = self.state_disk.read([state_record]) if state_record is not None else None
            self.restores[req] = DiskRestore(req, len(hits), self.disk.read(on_disk), state)
        return req.num_computed_tokens

    def _resume_point(self, req: KVRequest) -> tuple[list[int], list[PageRecord], PageRecord | None]:
        """A hybrid model's restore: the deepest page of its cached prefix (RAM, then disk) whose end has a
        snapshot, in RAM or in the state tier. The RAM pages up to it, the disk pages up to it, and the
        state tier's record when the snapshot is read from there (None: it is in RAM, or no page is)."""
        pages = self._cached_prefix(req)
        on_disk = self._on_disk(req, len(pages))
        hashes = req.full_page_hashes(self.page_size)
        req.branch_pages = len(pages) + len(on_disk)  # where its prompt leaves the cached ones
        for k in range(len(pages) + len(on_disk), 0, -1):
            h = hashes[k - 1]
            record = None
            if h not in self.snapshots:
                if self.state_disk is None or not self.state_disk.contains(h):
                    continue
                tokens = tuple(req.token_ids[(k - 1) * self.page_size : k * self.page_size])
                record = PageRecord(h, hashes[k - 2] if k > 1 else None, tokens)
            return pages[:k], on_disk[: max(0, k - len(pages))], record
        return [], [], None

    # -- recurrent-state snapshots (hybrid models) --------------------------------------------------
    def state_points(self, req: KVRequest, start: int, end: int) -> list[int]:
        """The page boundaries in (start, end] where the runner keeps req's recurrent state for a
        snapshot: every snapshot_every tokens, the end of the pages a prompt may restore (a retry, a
        fan-out, the next turn find it), where its prompt leaves the cached prompts (the next request that
        shares as much resumes there), and pages a waiting request wants."""
        if self.snapshots is None or not self.enable_prefix_caching:
            return []
        size, n = self.page_size, req.num_prompt_tokens
        prompt_ends = ((n - 1) // size * size, n // size * size)  # a retry's restore, a longer prompt's
        hashes = req.full_page_hashes(size)
        return [
            p
            for p in range((start // size + 1) * size, end + 1, size)
            if p % self.snapshot_every == 0
            or p in prompt_ends
            or p == req.branch_pages * size
            or (
                self.wanted_states
                and p // size <= len(hashes)
                and hashes[p // size - 1] in self.wanted_states
            )
        ]

    def want_state(self, req: KVRequest, pages: int) -> None:
        """req waits for a prefix flight whose shared pages end at page `pages`: the prefill computing
        them keeps the state there."""
        if self.snapshots is not None and pages:
            if len(self.wanted_states) >= MAX_WANTED_STATES:
                self.wanted_states.clear()
            self.wanted_states.add(req.full_page_hashes(self.page_size)[pages - 1])

    def publish_states(self, req: KVRequest, states: list) -> list:
        """Keep the states (each with .tokens at a page boundary and .nbytes) whose pages are published as
        snapshots; those past what the evaluated steps computed are returned, to come back later."""
        if self.snapshots is None:
            return []
        hashes, later = req.full_page_hashes(self.page_size), []
        for state in states:
            if state.tokens > req.num_computed_tokens:
                later.append(state)
                continue
            h = hashes[state.tokens // self.page_size - 1]
            if h in self.pool.index:  # else the page is not cached (its prefix was evicted)
                self.snapshots.put(h, Snapshot(state.tokens, state, state.nbytes))
                self.wanted_states.discard(h)
                if self.state_disk is not None:
                    i = state.tokens // self.page_size - 1
                    tokens = tuple(req.token_ids[i * self.page_size : (i + 1) * self.page_size])
                    self._state_writes.append((PageRecord(h, hashes[i - 1] if i else None, tokens), state))
        return later

    def _unblock(self, req: KVRequest, hits: list[int], need: int) -> None:
        """Pins never keep a request out for good: while it could not fit even with every unpinned page
        free (hits and need new pages), pins give way (its own domain's first: minivllm.cache.pins)."""
        if len(hits) + need <= self.num_pages - self.pins.num_pages:
            return  # fits beside every pin (the common case: no count of pinned hits)
        hit = set(hits)
        while self.pins.num_pins:
            blocking = sum(1 for h in self.pool.pinned if self.pool.index[h] not in hit)
            if len(hits) + need <= self.num_pages - blocking:
                return
            self._unpin(self.pins.give_way(req.hints.salt))

    def _miss(self, req: KVRequest, found: int) -> PrefixMiss | None:
        """Why req's restore stops at page `found` (RAM and disk together), or None if it restores all
        it may. A page the pool evicted lately is "evicted" (a bounded memory: long ago counts as new)."""
        if found >= self._restorable_pages(req):
            return None
        if not self.enable_prefix_caching:
            return PrefixMiss(0, MissReason.OFF)
        if found < req.branch_pages:  # a hybrid model's pages, cached without a state at their end
            return PrefixMiss(found * self.page_size, MissReason.NO_STATE)
        hashes = req.full_page_hashes(self.page_size)
        if hashes[found] in self.pool.evicted:
            return PrefixMiss(found * self.page_size, MissReason.EVICTED)
        return PrefixMiss(self._divergence(req, found, hashes), MissReason.NEW)

    def _divergence(self, req: KVRequest, found: int, hashes: list[bytes]) -> int:
        """The first token of page `found` that no cached continuation of the pages before it has: where
        req's prompt differs from the cached ones (the page's start if nothing continues them)."""
        start = found * self.page_size
        mine = req.token_ids[start : start + self.page_size]
        same = 0
        for child in self.pool.children.get(hashes[found - 1], ()) if found else ():
            theirs = self.pool.page_tokens[self.pool.index[child]]
            same = max(same, next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine)))
        return start + same

    def is_restoring(self, req: KVRequest) -> bool:
        return req in self.restores

    def wait_for_restores(self, timeout: float) -> None:
        """Until a pending disk read is done (the engine has nothing else to step), at most timeout s."""
        pending = [
            (tier, read)
            for r in self.restores.values()
            for tier, read in ((self.disk, r.read), (self.state_disk, r.state))
            if read is not None and not read.done
        ]
        if pending:  # one tier's reads: each tier wakes its own waiters
            tier = pending[0][0]
            tier.wait_for_reads([read for t, read in pending if t is tier], timeout)

    def apply_restores(
        self,
        write_pages: Callable[[list[int], np.ndarray], None],
        read_state: Callable[[np.ndarray, int], object] | None = None,
    ) -> list[tuple[KVRequest, int | None]]:
        """Finish the disk reads that are done: write_pages(pages, payloads) puts the bytes into the pools
        (the engine's runner, on the stepping thread), then the pages are published and computed. Each
        request with the tokens it got from disk (a prefix of what it asked for: the first page the
        disk could not serve, and those after it, are computed instead).

        A hybrid model's restore resumes at its last page only, with the state read_state(payload, tokens)
        makes: if a page or the state could not be read, the request gives its pages back (those read
        stay cached) and gets None: the scheduler admits it again, and it restores what is still there."""
        restored = []
        for r in [r for r in self.restores.values() if r.done]:
            del self.restores[r.req]
            n = r.read.num_ok
            if n:
                write_pages(r.req.page_table[r.first : r.first + n], r.read.payloads[:n])
            self._publish_restored(r.req, r.first, n)
            if self.snapshots is not None:
                if n < len(r.read.records) or (r.state is not None and r.state.num_ok == 0):
                    restored.append((r.req, None))
                    continue
                if r.state is not None:
                    self._restore_state(r.req, r.state, read_state)
            restored.append((r.req, n * self.page_size))
        return restored

    def _restore_state(self, req: KVRequest, read: DiskRead, read_state: Callable) -> None:
        """A hybrid model's state read from the state tier: req resumes with it, and it is kept in RAM."""
        tokens = req.num_computed_tokens
        req.restored_state = read_state(read.payloads[0], tokens)
        self.snapshots.put(
            read.records[0].hash, Snapshot(tokens, req.restored_state, read.payloads[0].nbytes)
        )
        self.snapshots.counters.snapshots_restored += 1

    def _publish_restored(self, req: KVRequest, first: int, n: int) -> None:
        hashes = req.full_page_hashes(self.page_size)
        for i in range(first, first + n):
            tokens = req.token_ids[i * self.page_size : (i + 1) * self.page_size]
            parent = hashes[i - 1] if i else None
            self.pool.publish(req.page_table[i], hashes[i], parent, tokens)  # a twin stays private
        req.num_computed_tokens = (first + n) * self.page_size
        req.publish_cursor = first + n
        self.pool.counters.pages_from_disk += n

    def _cancel_restore(self, req: KVRequest) -> None:
        r = self.restores.pop(req, None)
        if r is not None:
            for read in r.reads:
                read.cancelled = True  # the reader stops; its bytes are never applied

    def grow(self, req: KVRequest, num_tokens: int) -> None:
        """Give req pages for num_tokens (the caller checked that they are available)."""
        need = self.pages_short(req, num_tokens)
        if need > 0:
            after = req.page_table[-1] if req.page_table else None
            req.page_table.extend(self.pool.allocate(need, after=after))

    def truncate(self, req: KVRequest, num_tokens: int) -> None:
        """Give back req's pages past those holding num_tokens tokens: after a verification, the pages
        only rejected drafted tokens were written to. They were allocated for this request alone and
        never published (publication stops at the accepted, computed tokens): they go back free."""
        keep = self.pages_for(num_tokens)
        tail = req.page_table[keep:]
        for page in tail:
            assert self.pool.refcount[page] == 1 and self.pool.page_hash[page] is None, (
                f"page {page} past the accepted tokens of {req.request_id} is shared or published"
            )
        self.pool.release(tail)
        del req.page_table[keep:]
        req.publish_cursor = min(req.publish_cursor, keep)

    def publish(self, req: KVRequest) -> None:
        """Publish every full page whose KV is computed (and evaluated: the engine calls this after the
        step's evaluation)."""
        if not self.enable_prefix_caching:
            return
        hashes = req.full_page_hashes(self.page_size)
        full = min(req.num_computed_tokens // self.page_size, len(hashes))
        for i in range(req.publish_cursor, full):
            end = (i + 1) * self.page_size
            tokens = req.token_ids[end - self.page_size : end]
            parent = hashes[i - 1] if i else None
            if self.pool.publish(req.page_table[i], hashes[i], parent, tokens):
                req.num_pages_published += 1
                # a page wholly within the prompt is prompt cache a later request can restore
                if end <= req.num_prompt_tokens:
                    req.num_published_prompt_tokens += self.page_size
                self._write_to_disk(req, i, req.page_table[i])
        req.publish_cursor = max(req.publish_cursor, full)

    def _write_to_disk(self, req: KVRequest, i: int, page: int) -> None:
        """Queue page i of req's tokens, held by pool page `page`, for the disk tier (written after the
        step, if the disk lacks it)."""
        if self.disk is None:
            return
        hashes = req.full_page_hashes(self.page_size)
        tokens = tuple(req.token_ids[i * self.page_size : (i + 1) * self.page_size])
        record = PageRecord(hashes[i], hashes[i - 1] if i else None, tokens)
        self._disk_writes.append(PageWrite(page, record))

    # -- pins -----------------------------------------------------------------------------------------
    def pin(self, req: KVRequest) -> None:
        """Pin the prompt prefixes req asked for (hints.pins: tokens, TTL), as far as they are published;
        req.pins says what each got. Called before req releases its pages."""
        for tokens, ttl_s in req.hints.pins:
            n = min(tokens, req.num_prompt_tokens) // self.page_size
            hashes = req.full_page_hashes(self.page_size)[:n]
            pages = self.pool.lookup(hashes, req.token_ids, min(n, self.pins.limit))
            change = self.pins.add(hashes[: len(pages)], ttl_s, req.hints.salt)
            self._pin_change(change)
            kept, pages = change.kept, pages[: len(change.kept)]
            for i, page in enumerate(pages):  # the disk tier's budget may still evict them later
                self._write_to_disk(req, i, page)
            left = self.pins.remaining_s(kept[-1]) if kept else 0.0
            req.pins.append(PinInfo(len(kept) * self.page_size, len(kept), left))

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

    def write_behind(
        self,
        read_pages: Callable[[list[int]], np.ndarray],
        state_payloads: Callable[[list[object]], np.ndarray] | None = None,
    ) -> None:
        """Hand the pages published since the last call, and not on disk yet, to the disk's writer:
        read_pages(pages) copies their KV out of the pools (the engine's runner, after the step's
        evaluation). A page that stopped holding its hash since (evicted, reused) is skipped. A hybrid
        model's snapshots kept since go to the state tier: state_payloads(states) makes their bytes."""
        states = [(rec, st) for rec, st in self._state_writes if not self.state_disk.contains(rec.hash)]
        self._state_writes = []
        if states:
            self.state_disk.write([rec for rec, _ in states], state_payloads([st for _, st in states]))
        writes = [
            w
            for w in self._disk_writes
            if self.pool.page_hash[w.page] == w.record.hash and not self.disk.contains(w.record.hash)
        ]
        self._disk_writes = []
        if writes:
            self.disk.write([w.record for w in writes], read_pages([w.page for w in writes]))

    def release(self, req: KVRequest) -> None:
        """req gives all its pages back (what it published stays cached) and has no KV any more."""
        self.pool.release(req.page_table)
        self.forget(req)

    def forget(self, req: KVRequest) -> None:
        self._cancel_restore(req)
        req.page_table = []
        req.num_computed_tokens = 0
        req.publish_cursor = 0
        req.restored_state = None

    def reset(self, holders: list[KVRequest]) -> None:
        """Start afresh after a fault that may have left the bookkeeping or the KV half-updated: holders
        lose their pages without releasing them, and the cache is forgotten (counters are kept). The disk
        tier stays: its pages were verified when written, and are again when read."""
        for req in holders:
            self.forget(req)
        for req in list(self.restores):
            self._cancel_restore(req)
        self._disk_writes, self._state_writes = [], []
        if self.disk is not None:
            self.disk.unpin(self.pins.clear())  # the pins go with the pool
        self.pool = self._new_pool(self.pool.counters)
        self.pins = self._new_pins(self.pins.counters)

    def clear_cache(self) -> None:
        self._unpin(self.pins.clear())
        self.pool.clear_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    def disk_stats(self) -> dict:
        return self.disk.stats() if self.disk is not None else {}

    def close(self) -> None:
        """Write what the disk tier has queued and release its directory; from now on RAM alone (a request
        still waiting for disk pages computes them)."""
        if self.disk is None:
            return
        for req in list(self.restores):
            self._cancel_restore(req)
        self._disk_writes, self._state_writes = [], []
        self.disk.close()
        self.disk = None
        if self.state_disk is not None:
            self.state_disk.close()
            self.state_disk = None

    # -- invariants -----------------------------------------------------------------------------------
    def check_invariants(self, holders: list[KVRequest]) -> None:
        """The pool's own invariants, and: the pages in use are exactly those the holders' tables hold."""
        self.pool.check_invariants()
        in_use = sum(self.pool.refcount)
        held = sum(len(s.page_table) for s in holders)
        assert in_use == held, f"pages referenced {in_use} != pages held by running requests {held}"
        free = set(self.pool.free)
        for req in holders:
            assert not free.intersection(req.page_table), f"{req.request_id} holds a free page"
        assert set(self.restores) <= set(holders), "a request restores pages it does not hold"
        if self.snapshots is not None:
            assert self.snapshots.by_hash.keys() <= self.pool.index.keys(), "a snapshot outlived its page"
            assert self.snapshots.nbytes <= self.snapshots.capacity_bytes, "snapshots over their budget"
