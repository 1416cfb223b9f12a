"""Eviction policies for the prefix cache: S3FIFO, LRU and FIFO.

One module, shared by the engine's page pool and by the trace replay, so that
the replay's hit rates are the numbers of the very class the engine runs.

Every policy tracks *keys* (any hashable: a block hash, an int). It holds no
payload: the caller owns the pages and asks the policy which key to drop.

- ``access(key)`` is the access rule: a hit updates the policy's state, a miss
  admits the key. It returns the keys that stopped being resident because of
  this call, in the order they left.
- ``remove(key)`` forgets a resident key silently (no ghost, not an eviction).
- ``evict(can_evict)`` frees one resident key now, skipping keys the caller
  has pinned; returns it, or None if every resident key is pinned.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

POLICIES = ("s3fifo", "lru", "fifo")


class EvictionPolicy:
    """The interface every policy implements. ``capacity`` counts resident keys."""

    capacity: int

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def access(self, key: Hashable) -> list:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def evict(self, can_evict: Callable[[Any], bool]) -> Any:
        raise NotImplementedError


def _check_capacity(capacity: int) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")


class _OrderedPolicy(EvictionPolicy):
    """LRU and FIFO: one ordered dict, head = next victim."""

    reorder_on_hit = False

    def __init__(self, capacity: int):
        _check_capacity(capacity)
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def keys(self) -> list:
        """Resident keys, next victim first."""
        return list(self._keys)

    def access(self, key: Hashable) -> list:
        if key in self._keys:
            if self.reorder_on_hit:
                self._keys.move_to_end(key)
            return []
        evicted = []
        while len(self._keys) >= self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        return evicted

    def remove(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def evict(self, can_evict: Callable[[Any], bool]) -> Any:
        for key in self._keys:
            if can_evict(key):
                del self._keys[key]  # safe: we stop iterating right away
                return key
        return None


class LRU(_OrderedPolicy):
    """Least recently used: a hit moves the key to the most-recent end."""

    reorder_on_hit = True


class FIFO(_OrderedPolicy):
    """First in, first out: insertion order only, hits do not reorder."""

    reorder_on_hit = False


class S3FIFO(EvictionPolicy):
    """S3FIFO (Yang et al., SOSP 2023), exactly as the seed spells it out.

    Queues (all FIFO, head = oldest): small S, main M, ghost G (keys only, not
    resident). ``freq`` is a per-key counter saturating at ``max_freq``.

    Sizes: ``small_cap = round(capacity * small_ratio)`` with Python's ``round``
    (banker's rounding: capacity 25, ratio 0.1 -> round(2.5) = 2), then clamped
    to ``[1, capacity - 1]`` when ``capacity >= 2`` so that neither S nor M is
    empty (the literal rule would loop forever popping an empty S when
    small_cap == 0). ``capacity == 1`` gives S = 1, M = 0, G = 0: a block
    promoted out of S has nowhere to go and is evicted (no ghost either).
    ``main_cap = capacity - small_cap``; ``ghost_cap = main_cap``.

    Forced eviction (``evict``, not in the seed; the engine needs a page now
    and some pages are pinned): walk S from the head and send the first
    evictable key to G whatever its freq (we need the space now, promoting it
    to M would free nothing). If S has none, run M's second chance over the
    evictable keys only: pinned keys stay in place, an evictable key with
    freq >= 1 is requeued at M's tail with freq - 1, and the first evictable key
    met with freq 0 goes to G. Each full pass lowers every evictable key's
    freq, so at most ``max_freq + 1`` passes find a victim; if a pass sees no
    evictable key at all the answer is None.
    """

    def __init__(self, capacity: int, small_ratio: float = 0.1, max_freq: int = 3):
        _check_capacity(capacity)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio!r}")
        if isinstance(max_freq, bool) or not isinstance(max_freq, int) or max_freq < 0:
            raise ValueError(f"max_freq must be an integer >= 0, got {max_freq!r}")
        self.capacity = capacity
        self.max_freq = max_freq
        if capacity == 1:
            self.small_cap = 1
        else:
            self.small_cap = min(max(round(capacity * small_ratio), 1), capacity - 1)
        self.main_cap = capacity - self.small_cap
        self.ghost_cap = self.main_cap
        # Both resident queues map key -> freq; the ghost holds keys only.
        self._small: OrderedDict[Hashable, int] = OrderedDict()
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()

    # --- read-only views (tests, metrics) ---
    def __contains__(self, key: Hashable) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def small_keys(self) -> list:
        return list(self._small)

    def main_keys(self) -> list:
        return list(self._main)

    def ghost_keys(self) -> list:
        return list(self._ghost)

    def freq(self, key: Hashable) -> int | None:
        """The key's freq if resident, else None."""
        if key in self._small:
            return self._small[key]
        return self._main.get(key)

    # --- the access rule ---
    def access(self, key: Hashable) -> list:
        evicted: list = []
        if key in self._small:
            self._small[key] = min(self._small[key] + 1, self.max_freq)
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, self.max_freq)
        elif key in self._ghost:
            del self._ghost[key]
            self._admit_to_main(key, 0, evicted)
        else:
            self._admit_to_small(key, evicted)
        return evicted

    def _admit_to_small(self, key: Hashable, evicted: list) -> None:
        while len(self._small) >= self.small_cap:
            victim, vf = self._small.popitem(last=False)
            if vf >= 1:
                self._admit_to_main(victim, vf, evicted)  # freq kept, not reset
            else:
                self._insert_to_ghost(victim)
                evicted.append(victim)
        self._small[key] = 0

    def _admit_to_main(self, key: Hashable, freq: int, evicted: list) -> None:
        if self.main_cap == 0:  # capacity 1: no main queue, the key just leaves
            evicted.append(key)
            return
        while len(self._main) >= self.main_cap:
            victim, vf = self._main.popitem(last=False)
            if vf >= 1:
                self._main[victim] = vf - 1  # second chance: requeue at the tail
                continue
            self._insert_to_ghost(victim)
            evicted.append(victim)
            break  # exactly one real eviction
        self._main[key] = freq

    def _insert_to_ghost(self, key: Hashable) -> None:
        if self.ghost_cap == 0:
            return
        if key in self._ghost:
            del self._ghost[key]  # re-append at the tail with fresh recency
        elif len(self._ghost) >= self.ghost_cap:
            self._ghost.popitem(last=False)
        self._ghost[key] = None

    # --- engine hooks ---
    def remove(self, key: Hashable) -> None:
        """Forget a resident key: no ghost entry, not an eviction. Ghost entries are left alone."""
        if self._small.pop(key, None) is None:
            self._main.pop(key, None)

    def evict(self, can_evict: Callable[[Any], bool]) -> Any:
        for key in self._small:
            if can_evict(key):
                del self._small[key]  # safe: we stop iterating right away
                self._insert_to_ghost(key)
                return key
        for _ in range(self.max_freq + 1):
            victim = None
            requeue = []
            for key in self._main:  # no mutation while iterating
                if not can_evict(key):
                    continue  # pinned: stays in place
                if self._main[key] == 0:
                    victim = key
                    break
                requeue.append(key)
            for key in requeue:  # same order the sequential second chance would produce
                self._main[key] -= 1
                self._main.move_to_end(key)
            if victim is not None:
                del self._main[victim]
                self._insert_to_ghost(victim)
                return victim
            if not requeue:
                return None  # nothing evictable in M
        return None  # only reached if can_evict changed its mind between passes


def make_policy(name: str, capacity: int, *, small_ratio: float = 0.1, max_freq: int = 3) -> EvictionPolicy:
    """Build a policy by name: "s3fifo", "lru" or "fifo"."""
    if name == "s3fifo":
        return S3FIFO(capacity, small_ratio=small_ratio, max_freq=max_freq)
    if name == "lru":
        return LRU(capacity)
    if name == "fifo":
        return FIFO(capacity)
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
