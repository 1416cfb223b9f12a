"""Pins: prompt prefixes a client asked to keep cached for a while (an Anthropic `cache_control` breakpoint,
or POST /v1/cache/pin).

A pin holds the chained hashes of a published prefix, from page 0, until it expires; a later request that
restores the whole pinned prefix refreshes it for its TTL again. The page pool never evicts a pinned page,
whatever the eviction policy (it skips them when it asks the policy for a victim) and does not count them
as available. Pins together hold at most `limit` pages (half the pool, so that they can never starve the
requests running).

Pins belong to the cache domain (API key / cache_salt) of the request that made them, as their pages do.
A new pin that would pass the limit makes room from its own domain's pins first (least recently refreshed
first), then from domains holding more than a fair share (the limit split evenly among the domains that
pin, the new one included), largest first; a domain within its share keeps its pins, and the new pin is
cut to the room left. So one key cannot unpin another's pages. A request that could not fit the pool even
if every unpinned page were free takes room in the same order, and only as a last resort from pins within
their shares (a request is never kept out for good).
This module only keeps the book (what is pinned, until when, in which order); the pool is told which
pages became pinned or unpinned.
"""

import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

TTL_DEFAULT_S = 300.0  # Anthropic's "ephemeral" cache: 5 minutes
TTL_MAX_S = 3600.0  # its longest, "1h"


@dataclass
class Pin:
    hashes: tuple[bytes, ...]  # the prefix's pages, from page 0
    ttl_s: float
    expires: float  # on the clock
    domain: str | None = None  # the cache domain of the request that pinned it


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
    """Pages whose pinned state changed: the pool's bookkeeping follows; kept: the pages of the prefix
    asked for that the pin holds (from page 0)."""

    pinned: list[bytes]
    unpinned: list[bytes]
    kept: list[bytes] = field(default_factory=list)


class Pins:
    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic):
        self.limit = limit  # pages
        self.clock = clock
        self._pins: OrderedDict[bytes, Pin] = (
            OrderedDict()
        )  # by last page hash, least recently refreshed first
        self._holders: dict[bytes, int] = {}  # page hash -> pins holding it
        self._domain_pages: Counter[str | None] = Counter()  # domain -> pages its pins hold
        self.counters = PinCounters()

    def __contains__(self, h: bytes) -> bool:
        return h in self._holders

    @property
    def num_pages(self) -> int:
        return len(self._holders)

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    def add(self, hashes: list[bytes], ttl_s: float, domain: str | None = None) -> PinChange:
        """Pin the prefix `hashes` of `domain` for ttl_s, as much of it as fits (module docstring); a pin of
        the same prefix is refreshed, with the longer TTL of the two."""
        hashes = hashes[: self.limit]
        change = PinChange([], [], list(hashes))
        if not hashes:
            return change
        key = hashes[-1]
        pin = self._pins.get(key)
        if pin is not None:
            pin.ttl_s = max(pin.ttl_s, ttl_s)
            self._refresh(key, pin)
            return change
        while self.num_pages + self._new_pages(hashes) > self.limit:
            victim = self._pin_to_give_way(domain, last_resort=False)
            if victim is None:
                break
            change.unpinned += self._give_way(victim)
        held = len(hashes) - self._new_pages(hashes)  # pages held already: a prefix (pins start at page 0)
        change.kept = hashes = hashes[: held + max(0, self.limit - self.num_pages)]
        if not hashes:
            return change
        self._pins[hashes[-1]] = Pin(tuple(hashes), ttl_s, self.clock() + ttl_s, domain)
        for h in hashes:
            self._holders[h] = self._holders.get(h, 0) + 1
            if self._holders[h] == 1:
                change.pinned.append(h)
                self._domain_pages[domain] += 1
        self.counters.pins_made += 1
        return change

    def _new_pages(self, hashes: list[bytes]) -> int:
        return sum(1 for h in hashes if h not in self._holders)

    def _pin_to_give_way(self, domain: str | None, last_resort: bool) -> bytes | None:
        """The pin that makes room for `domain`: its own least recently refreshed, else the least recently
        refreshed of the domain most over its fair share; with last_resort, of the largest domain."""
        own = next((k for k, pin in self._pins.items() if pin.domain == domain), None)
        if own is not None or not self._pins:
            return own
        share = self.limit // len(self._domain_pages.keys() | {domain})
        largest, pages = self._domain_pages.most_common(1)[0]
        if pages <= share and not last_resort:
            return None
        return next(k for k, pin in self._pins.items() if pin.domain == largest)

    def held(self) -> list[Pin]:
        """The pins, least recently refreshed first."""
        return list(self._pins.values())

    def give_way(self, domain: str | None = None) -> list[bytes]:
        """Drop a pin before its time to make room for a request of `domain` (the order of the module
        docstring, last resort included); the pages no pin holds any more."""
        return self._give_way(self._pin_to_give_way(domain, last_resort=True))

    def _give_way(self, key: bytes) -> list[bytes]:
        self.counters.pins_given_way += 1
        return self._drop(key)

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
        pin = self._pins.pop(key)
        for h in pin.hashes:
            self._holders[h] -= 1
            if self._holders[h] == 0:
                del self._holders[h]
                unpinned.append(h)
        self._domain_pages[pin.domain] -= len(unpinned)
        if self._domain_pages[pin.domain] == 0:
            del self._domain_pages[pin.domain]
        return unpinned

    def clear(self) -> list[bytes]:
        """Drop every pin (the cache is being cleared); the pages that were pinned."""
        unpinned = list(self._holders)
        self._pins.clear()
        self._holders.clear()
        self._domain_pages.clear()
        return unpinned
