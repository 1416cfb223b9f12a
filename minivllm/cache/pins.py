"""Pins: prompt prefixes a client asked to keep cached for a while (an Anthropic `cache_control` breakpoint,
or POST /v1/cache/pin).

A pin holds the chained hashes of a published prefix, from page 0, until it expires; a later request that
restores the whole pinned prefix refreshes it for its TTL again. The page pool never evicts a pinned page,
whatever the eviction policy (it skips them when it asks the policy for a victim) and does not count them
as available. Pins together hold at most `limit` pages (half the pool, so that they can never starve the
requests running): a new pin that would pass it makes the least recently refreshed pins give way first,
and so does a request that could not fit the pool even if every unpinned page were free.
This module only keeps the book (what is pinned, until when, in which order); the pool is told which
pages became pinned or unpinned.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

TTL_DEFAULT_S = 300.0  # Anthropic's "ephemeral" cache: 5 minutes
TTL_MAX_S = 3600.0  # its longest, "1h"


@dataclass
class Pin:
    hashes: tuple[bytes, ...]  # the prefix's pages, from page 0
    ttl_s: float
    expires: float  # on the clock


@dataclass(frozen=True)
class PinInfo:
    """What a request pinned: its first `tokens` prompt tokens, in `pages` pages, for `ttl_s` more seconds."""

    tokens: int
    pages: int
    ttl_s: float


@dataclass
class PinCounters:
    pins_made: int = 0  # new pins (a pin of a prefix already pinned refreshes it instead)
    pins_refreshed: int = 0  # by a pin request or by a hit on the whole prefix
    pins_expired: int = 0
    pins_given_way: int = 0  # dropped before their time to make room for newer ones (the limit)


@dataclass
class PinChange:
    """Pages whose pinned state changed: the pool's bookkeeping follows."""

    pinned: list[bytes]
    unpinned: list[bytes]


class Pins:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit  # pages
        self.clock = clock
        self._pins: OrderedDict[bytes, Pin] = (
            OrderedDict()
        )  # by last page hash, least recently refreshed first
        self._holders: dict[bytes, int] = {}  # page hash -> pins holding it
        self.counters = PinCounters()

    def __contains__(self, h: bytes) -> bool:
        return h in self._holders

    @property
    def num_pages(self) -> int:
        return len(self._holders)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def add(self, hashes: list[bytes], ttl_s: float) -> PinChange:
        """Pin the prefix `hashes` (at most `limit` pages of it) for ttl_s; a pin of the same prefix is
        refreshed, with the longer TTL of the two."""
        hashes = hashes[: self.limit]
        change = PinChange([], [])
        if not hashes:
            return change
        key = hashes[-1]
        pin = self._pins.get(key)
        if pin is not None:
            pin.ttl_s = max(pin.ttl_s, ttl_s)
            self._refresh(key, pin)
            return change
        new = sum(1 for h in hashes if h not in self._holders)
        while self._pins and self.num_pages + new > self.limit:
            change.unpinned += self.give_way()
            new = sum(1 for h in hashes if h not in self._holders)
        self._pins[key] = Pin(tuple(hashes), ttl_s, self.clock() + ttl_s)
        for h in hashes:
            self._holders[h] = self._holders.get(h, 0) + 1
            if self._holders[h] == 1:
                change.pinned.append(h)
        self.counters.pins_made += 1
        return change

    def held(self) -> list[Pin]:
        """The pins, least recently refreshed first."""
        return list(self._pins.values())

    def give_way(self) -> list[bytes]:
        """Drop the least recently refreshed pin before its time; the pages no pin holds any more."""
        self.counters.pins_given_way += 1
        return self._drop(next(iter(self._pins)))

    def refresh(self, hashes: list[bytes]) -> None:
        """A request restored the prefix `hashes`: every pin wholly within it starts its TTL again."""
        for h in hashes:
            pin = self._pins.get(h)
            if pin is not None:
                self._refresh(h, pin)

    def _refresh(self, key: bytes, pin: Pin) -> None:
        pin.expires = self.clock() + pin.ttl_s
        self._pins.move_to_end(key)
        self.counters.pins_refreshed += 1

    def expire(self) -> list[bytes]:
        """Drop the pins whose time is up; the pages no pin holds any more."""
        now = self.clock()
        unpinned = []
        for key in [k for k, pin in self._pins.items() if pin.expires <= now]:
            unpinned += self._drop(key)
            self.counters.pins_expired += 1
        return unpinned

    def remaining_s(self, key: bytes) -> float:
        return max(0.0, self._pins[key].expires - self.clock())

    def _drop(self, key: bytes) -> list[bytes]:
        unpinned = []
        for h in self._pins.pop(key).hashes:
            self._holders[h] -= 1
            if self._holders[h] == 0:
                del self._holders[h]
                unpinned.append(h)
        return unpinned

    def clear(self) -> list[bytes]:
        """Drop every pin (the cache is being cleared); the pages that were pinned."""
        unpinned = list(self._holders)
        self._pins.clear()
        self._holders.clear()
        return unpinned
