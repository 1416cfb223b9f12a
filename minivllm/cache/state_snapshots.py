"""Snapshots of a hybrid model's recurrent state, kept beside the pages whose end they mark.

A linear-attention layer sees a prefix only through its state at the prefix's end, so a hybrid model
restores a cached prefix of pages only where a snapshot of the state at the last page's end is kept
(minivllm.models.linear_attention). A snapshot is keyed by that page's chained hash, so it is found by the
same lookup as the pages, and it lives no longer than its page: when the pool's eviction policy gives
the page up, its snapshot goes with it. The snapshots' own memory has a budget; past it, the least
recently used snapshot goes (its pages stay cached: they still serve a longer prefix's restore).

The state itself is the engine's (arrays): the cache keeps it as an opaque object with its size.
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class Snapshot:
    tokens: int  # the state is after this many tokens: the end of the page it is kept for
    state: object  # the engine's, opaque here
    nbytes: int


@dataclass
class SnapshotCounters:
    snapshots_kept: int = 0
    snapshots_dropped: int = 0  # over the budget (their page stays)
    snapshots_restored: int = 0


class StateSnapshots:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.by_hash: OrderedDict[bytes, Snapshot] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.counters = SnapshotCounters()

    def __len__(self) -> int:
        return len(self.by_hash)

    def __contains__(self, h: bytes) -> bool:
        return h in self.by_hash

    def get(self, h: bytes) -> Snapshot | None:
        """The snapshot kept for page hash h, now the most recently used."""
        snapshot = self.by_hash.get(h)
        if snapshot is not None:
            self.by_hash.move_to_end(h)
        return snapshot

    def put(self, h: bytes, snapshot: Snapshot) -> None:
        """Keep a snapshot for page hash h (one there already stays: the same tokens give the same state)."""
        if h in self.by_hash or snapshot.nbytes > self.capacity_bytes:
            return
        self.by_hash[h] = snapshot
        self.nbytes += snapshot.nbytes
        self.counters.snapshots_kept += 1
        while self.nbytes > self.capacity_bytes:
            self.counters.snapshots_dropped += 1
            self.drop(next(iter(self.by_hash)))

    def drop(self, h: bytes) -> None:
        """Forget h's snapshot, if any (its page was evicted, or the budget is full)."""
        snapshot = self.by_hash.pop(h, None)
        if snapshot is not None:
            self.nbytes -= snapshot.nbytes

    def clear(self) -> None:
        self.by_hash.clear()
        self.nbytes = 0
