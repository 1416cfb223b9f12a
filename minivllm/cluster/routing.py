"""Which engine replica a request goes to: prefix affinity by chained page hashes, with a load fallback.

A request is described by the chained hashes of its full prompt pages: equal keys at page i mean equal
prompts up to the end of page i, which is exactly what a replica's prefix cache matches on. The router
cannot see the replicas' caches, so it remembers where it sent pages: a bounded index maps each page key
to the replicas it was routed to recently (a bit mask). A replica that was sent a prefix recently most
likely still holds it.

The affinity rule, for a request with page keys k_0 .. k_{n-1}:

1. the deepest page some live replica was sent: the least-loaded of those replicas (the longest cached
   prefix; a shared system prompt held everywhere then spreads by load);
2. no page seen: the less loaded of k_0's two rendezvous-hash candidates, the owner when loads tie (two
   choices balance cold prefixes far better than one, and the candidates are the same in every router
   process and move only when one of them goes);
3. no full page at all: the least-loaded replica;

then, if that replica's load exceeds `mean load * imbalance + slack`, the least-loaded replica instead.
Identical concurrent prompts get the same answer, so they meet on one replica and its single flight.

Load is what a replica has to do now. The live router knows it: the requests it has in flight on each
replica (`load="in-flight"`, it calls `finish` as each ends). A trace has no durations, so the replay counts
the requests routed to each replica among the last `window` routed (`load="window"`). Counting history
live would be wrong: a replica that was busy a minute ago would get no new conversations now.

`round-robin` and `least-loaded` ignore the keys: the baselines the replay compares against.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

ROUTINGS = ("affinity", "round-robin", "least-loaded")
LOADS = ("window", "in-flight")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "affinity"
    window: int = 256  # with load="window": requests routed to each replica among the last `window`
    imbalance: float = 1.2  # affinity yields once a replica's load passes mean * imbalance + slack
    slack: int = 8  # requests a replica may be ahead before affinity yields (small windows, bursts)
    index_pages: int = 1 << 18  # bound of the page -> replicas index (about 30 MB at the bound)

    def __post_init__(self) -> None:
        if self.policy not in ROUTINGS:
            raise ValueError(f"unknown routing {self.policy!r}; expected one of {', '.join(ROUTINGS)}")
        for name in ("window", "index_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.imbalance < 1.0:
            raise ValueError(f"imbalance must be >= 1, got {self.imbalance}")
        if self.slack < 0:
            raise ValueError(f"slack must be >= 0, got {self.slack}")


class NoReplicaError(LookupError):
    """There is no live replica to route to."""


def rendezvous_order(key: Hashable, replicas: Iterable[str]) -> list[str]:
    """Replicas by descending hash of (key, replica), the owner first: stable across processes and runs (no
    use of Python's salted hash), and removing a replica leaves the others' order unchanged."""
    text = repr(key).encode()
    return sorted(
        replicas,
        key=lambda r: hashlib.blake2b(text + b"\0" + r.encode(), digest_size=8).digest(),
        reverse=True,
    )


class Router:
    """The routing state of one router process: live replicas, the page index and the load."""

    def __init__(
        self, config: RoutingConfig | None = None, replicas: Iterable[str] = (), load: str = "window"
    ):
        if load not in LOADS:
            raise ValueError(f"unknown load {load!r}; expected one of {', '.join(LOADS)}")
        self.config = config or RoutingConfig()
        self.load = load
        self._bits: dict[str, int] = {}  # live replica -> its bit in the index masks (bits never reused)
        self._next_bit = 0
        self._live_mask = 0
        self._index: OrderedDict[Hashable, int] = OrderedDict()  # page key -> replicas sent it, LRU order
        self._recent: deque[str] = deque()  # load="window": the replicas of the last `window` routed
        self._load: Counter[str] = Counter()
        self._turn = 0  # round-robin position
        self.routed: Counter[str] = Counter()  # requests routed to each replica, ever
        for replica in replicas:
            self.add_replica(replica)

    # -- membership ---------------------------------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        return list(self._bits)

    def add_replica(self, replica: str) -> None:
        if replica not in self._bits:
            self._bits[replica] = 1 << self._next_bit
            self._next_bit += 1
            self._live_mask |= self._bits[replica]

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it died or was scaled down): the pages it held route elsewhere from now on."""
        bit = self._bits.pop(replica, 0)
        self._live_mask &= ~bit
        self._load.pop(replica, None)
        self._recent = deque(r for r in self._recent if r != replica)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        live = list(replicas)
        for replica in [r for r in self._bits if r not in live]:
            self.remove_replica(replica)
        for replica in live:
            self.add_replica(replica)

    # -- routing ------------------------------------------------------------------------------------------
    def choose(self, page_keys: Sequence[Hashable]) -> list[str]:
        """Rank the live replicas for a request and record it as routed to the first.

        The rest follow by load, as fallbacks for a caller whose first choice turns out to be full."""
        if not self._bits:
            raise NoReplicaError("no live replica to route to")
        by_load = sorted(self._bits, key=lambda r: self._load[r])  # stable: ties keep insertion order
        policy = self.config.policy
        if policy == "round-robin":
            first = list(self._bits)[self._turn % len(self._bits)]
            self._turn += 1
        elif policy == "least-loaded":
            first = by_load[0]
        else:
            first = self._affine(page_keys, by_load)
        self._record(page_keys, first)
        return [first] + [r for r in by_load if r != first]

    def finish(self, replica: str) -> None:
        """A request routed to `replica` has ended (load="in-flight")."""
        if self.load != "in-flight":
            raise ValueError(
                'finish() counts requests in flight; this router counts a window (load="window")'
            )
        if self._load.get(replica, 0) > 0:
            self._load[replica] -= 1

    def reassign(self, page_keys: Sequence[Hashable], chosen: str, served: str) -> None:
        """A request ranked first for `chosen` went to `served` instead (chosen was full): its load and
        its pages move there (load="in-flight")."""
        if chosen == served:
            return
        self.finish(chosen)
        if served in self._bits:
            self._load[served] += 1
        self.remember(page_keys, served)

    def remember(self, page_keys: Sequence[Hashable], replica: str) -> None:
        """Record that these pages went to `replica` after all (the caller overrode the first choice)."""
        if replica in self._bits:
            self._index_pages(page_keys, self._bits[replica])

    def loads(self) -> dict[str, int]:
        return {r: self._load[r] for r in self._bits}

    def holders(self, page_keys: Sequence[Hashable]) -> list[str]:
        """The live replicas sent the deepest of these pages that any live replica was sent."""
        mask = self._deepest_mask(page_keys)
        return [r for r, bit in self._bits.items() if mask & bit]

    # -- internals ----------------------------------------------------------------------------------------
    def _affine(self, page_keys: Sequence[Hashable], by_load: list[str]) -> str:
        mask = self._deepest_mask(page_keys)
        if mask:
            first = next(r for r in by_load if self._bits[r] & mask)
        elif page_keys:
            first = min(rendezvous_order(page_keys[0], self._bits)[:2], key=lambda r: self._load[r])
        else:
            first = by_load[0]
        return by_load[0] if self._overloaded(first) else first

    def _deepest_mask(self, page_keys: Sequence[Hashable]) -> int:
        for key in reversed(page_keys):  # chained keys: a hit at page i covers pages 0..i
            mask = self._index.get(key, 0) & self._live_mask
            if mask:
                return mask
        return 0

    def _overloaded(self, replica: str) -> bool:
        mean = sum(self._load[r] for r in self._bits) / len(self._bits)
        return self._load[replica] > mean * self.config.imbalance + self.config.slack

    def _record(self, page_keys: Sequence[Hashable], replica: str) -> None:
        self._index_pages(page_keys, self._bits[replica])
        self._load[replica] += 1
        self.routed[replica] += 1
        if self.load == "window":
            self._recent.append(replica)
            if len(self._recent) > self.config.window:
                old = self._recent.popleft()
                if old in self._load:
                    self._load[old] -= 1

    def _index_pages(self, page_keys: Sequence[Hashable], bit: int) -> None:
        index = self._index
        for key in page_keys:
            index[key] = index.pop(key, 0) | bit  # pop + insert: most recently used last
        while len(index) > self.config.index_pages:
            index.popitem(last=False)
