"""Prefix-cache trace replay: token hit rates of eviction policies on Mooncake-style traces.

A trace is JSON lines, one request each: ``hash_ids`` (chained block hashes,
512-token blocks), ``input_length`` and optionally ``timestamp``.

Accounting (policy-independent): for each request, k is the number of blocks
resident from index 0 up to the first miss, checked *before* the request
touches the cache; hit tokens += min(k * block_size, input_length). Then every
block of the request is accessed against the policy in order, with the previous
block as its parent (and the last one flagged partial when input_length does not
fill it), and once the request is done its blocks are released tail first: the
same calls the engine's page pool makes.

Policies: "adaptive" (the engine's default, also reachable as "default"),
"s3fifo", "lru", "fifo" come from :mod:`minivllm.cache.eviction` (the very
classes the engine runs); "belady", "belady-prefix" (offline optima) and
"infinite" (never evicts) live here because they need the whole trace.

Each run also reports ``unreachable_blocks``: blocks still cached at the end
whose prefix is not (a block whose parent, or its parent's parent, ... was
evicted can never be hit again; a prefix-aware policy leaves none).

Two tiers: ``--disk-capacity D`` adds a disk tier of D blocks under the RAM cache, as the engine's disk
tier (minivllm.cache.disk_tier) runs it: a lookup walks the request's blocks through RAM, then continues on
disk; the blocks found on disk are read back into RAM. ``--disk-writes behind`` (the engine's rule) writes
every full block a request computes as soon as it is published; ``eviction`` writes a block when RAM evicts
it instead. The disk's policy (``--disk-policy``, the engine's: LRU) sees every write and every disk hit,
never a RAM hit. Partial last blocks never reach the disk (the engine never publishes one). The result
splits hits by tier and counts the blocks written, read and evicted on disk.

Replicas: ``--replicas N --routing affinity|round-robin|least-loaded`` routes every request to one of N
replicas with :mod:`minivllm.cluster.routing` (the rule the live router runs), then replays each replica's
requests against its own cache of ``--capacity`` blocks. The rule never looks at the caches, so routing
first and replaying each replica afterwards is exact, and works for every policy, belady included.

CLI: ``python -m minivllm.replay TRACE --policy default --capacity 10000 [--json]``,
``--replicas 4 --routing affinity`` (capacity per replica), ``--disk-capacity 100000`` (two tiers), or
``--sweep --policies adaptive,s3fifo,lru --capacities 1000,10000 [--plot out.png]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from minivllm.cache.disk_tier import EVICTION as DISK_EVICTION
from minivllm.cache.eviction import POLICIES, EvictionPolicy, make_policy
from minivllm.cluster.routing import ROUTINGS, Router, RoutingConfig
from minivllm.config import DEFAULT_EVICTION

logger = logging.getLogger(__name__)

OFFLINE_POLICIES = ("belady", "belady-prefix", "infinite")
DISK_WRITE_RULES = ("behind", "eviction")  # the engine writes behind: docs/disk-tier.md has the measurement
REPLAY_POLICIES = POLICIES + OFFLINE_POLICIES
DEFAULT = "default"  # resolves to the engine's default policy


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(slots=True)
class TraceRequest:
    hash_ids: list[int]
    input_length: int
    timestamp: float | None = None


@dataclass(slots=True)
class ReplayResult:
    policy: str  # the policy's name ("default" resolved)
    hit_tokens: int
    total_tokens: int
    token_hit_rate: float
    hit_blocks: int  # sum over requests of the prefix hit length k
    total_blocks: int  # sum over requests of len(hash_ids)
    unreachable_blocks: int  # cached at the end, but some block of their prefix is not


@dataclass(slots=True)
class ReplicasReplayResult:
    """The single-cache keys summed over replicas, and how evenly the requests were spread."""

    policy: str
    hit_tokens: int
    total_tokens: int
    token_hit_rate: float
    hit_blocks: int
    total_blocks: int
    unreachable_blocks: int
    load_imbalance: float  # max / mean requests per replica (1.0: perfectly even)
    requests_per_replica: list[int]
    replicas: int
    routing: str


@dataclass(slots=True)
class TieredReplayResult:
    """A replay with a disk tier under the RAM cache: hits split by tier, and the disk's traffic."""

    policy: str
    disk_policy: str
    disk_writes: str  # the write rule: "behind" or "eviction"
    capacity: int
    disk_capacity: int
    hit_tokens: int
    ram_hit_tokens: int
    disk_hit_tokens: int
    total_tokens: int
    token_hit_rate: float
    ram_hit_rate: float
    disk_hit_rate: float
    blocks_written: int  # blocks written to disk
    blocks_read: int  # blocks read back from disk (the disk hits)
    blocks_evicted: int  # blocks the disk gave up


# --- loading ---


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # bool is an int subclass


def _parse_line(text: str) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("hash_ids", "input_length"):
        if key not in obj:
            raise ValueError(f"missing key {key!r}")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        raise ValueError("hash_ids must be a list of integers")
    length = obj["input_length"]
    if not _is_int(length) or length < 0:
        raise ValueError(f"input_length must be a non-negative integer, got {length!r}")
    ts = obj.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise ValueError(f"timestamp must be a number, got {ts!r}")
    return TraceRequest(hash_ids, length, None if ts is None else float(ts))


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON-lines trace; blank lines are skipped. Raises TraceError with file:line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror or e}") from None
    requests = []
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            requests.append(_parse_line(text))
        except ValueError as e:
            raise TraceError(f"{path}:{lineno}: {e}") from None
    return requests


# --- offline policies ---


class Infinite(EvictionPolicy):
    """Never evicts: the upper bound any finite cache can reach."""

    def __init__(self) -> None:
        self._keys: set = set()

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator:
        return iter(self._keys)

    def access(self, key: object, parent: object = None, partial: bool = False) -> list:
        self._keys.add(key)
        return []


class Belady(EvictionPolicy):
    """Offline optimum (MIN): on a miss when full, evict the resident block used farthest in the future.

    Ties (typically blocks never used again) go to the deeper block first, the one
    with the larger position in its request, so a prefix's tail leaves before its head.
    Heap entries are (-next_use, -position, access_index, key); an entry is stale once
    the key has been accessed again or evicted (lazy deletion).
    """

    def __init__(self, capacity: int, requests: Sequence[TraceRequest]):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._next_use = _next_uses(requests)
        self._clock = 0  # index of the next access in the flattened trace
        self._position = -1  # position of the latest access in its request
        self._last: dict = {}  # resident key -> access index of its latest access
        self._heap: list = []

    def __contains__(self, key: object) -> bool:
        return key in self._last

    def __len__(self) -> int:
        return len(self._last)

    def __iter__(self) -> Iterator:
        return iter(self._last)

    def access(self, key: object, parent: object = None, partial: bool = False) -> list:
        i = self._clock
        self._clock += 1
        self._position = 0 if parent is None else self._position + 1
        evicted = []
        if key not in self._last and len(self._last) >= self.capacity:
            evicted.append(self._pop_farthest())
        self._last[key] = i
        heapq.heappush(self._heap, (-self._next_use[i], -self._position, i, key))
        return evicted

    def _pop_farthest(self) -> object:
        while True:
            _, _, i, key = heapq.heappop(self._heap)
            if self._last.get(key) == i:  # still the key's live entry
                del self._last[key]
                return key


class BeladyPrefix(EvictionPolicy):
    """The prefix-aware optimum: Belady over the tails of cached prefixes only.

    The victim is the block used farthest in the future among blocks with no cached child (ties:
    the deeper one), and a block whose parent is not cached is not admitted, so the cache never
    keeps a child without its parent. Every use of a block follows a use of its parent in the same
    request, so a parent is never needed later than its child and the victim is a tail anyway; it
    differs from ``belady`` where that one evicts the parent of the block it is admitting (the
    farthest block when both are needed no more): ``belady`` caches the child, unreachable, while
    this one leaves the slot free.
    """

    def __init__(self, capacity: int, requests: Sequence[TraceRequest]):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._next_use = _next_uses(requests)
        self._clock = 0
        self._resident: dict = {}  # key -> [next use, depth, parent, cached children, access index]
        self._heap: list = []  # (-next use, -depth, access index, key) of childless blocks

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def __iter__(self) -> Iterator:
        return iter(self._resident)

    def access(self, key: object, parent: object = None, partial: bool = False) -> list:
        i = self._clock
        self._clock += 1
        node = self._resident.get(key)
        if node is not None:
            node[0], node[4] = self._next_use[i], i
            self._push(key, node)
            return []
        if parent is not None and parent not in self._resident:
            return []  # unreachable if admitted: not cached
        evicted = []
        if len(self._resident) >= self.capacity:
            evicted.append(self._evict())
            if parent is not None and parent not in self._resident:
                return evicted  # the parent itself was the farthest: the child is needed no sooner
        depth = 0 if parent is None else self._resident[parent][1] + 1
        node = [self._next_use[i], depth, parent, 0, i]
        self._resident[key] = node
        if parent is not None:
            self._resident[parent][3] += 1  # no longer a tail: its heap entry goes stale
        self._push(key, node)
        return evicted

    def _push(self, key: object, node: list) -> None:
        if node[3] == 0:
            heapq.heappush(self._heap, (-node[0], -node[1], node[4], key))

    def _evict(self) -> object:
        while True:
            _, _, i, key = heapq.heappop(self._heap)
            node = self._resident.get(key)
            if node is None or node[4] != i or node[3]:
                continue  # stale: accessed again, evicted, or has a cached child now
            del self._resident[key]
            if node[2] is not None:
                parent = self._resident[node[2]]
                parent[3] -= 1
                self._push(node[2], parent)
            return key


def _next_uses(requests: Sequence[TraceRequest]) -> list[float]:
    """For each access in the flattened trace, the index of the same key's next access (inf if none)."""
    keys = [h for r in requests for h in r.hash_ids]
    nxt: list[float] = [math.inf] * len(keys)
    seen: dict = {}
    for i in range(len(keys) - 1, -1, -1):
        nxt[i] = seen.get(keys[i], math.inf)
        seen[keys[i]] = i
    return nxt


# --- replay ---


def resolve_policy(name: str) -> str:
    """Resolve "default" to the engine's default policy; other names pass through."""
    return DEFAULT_EVICTION if name == DEFAULT else name


def make_cache(
    requests: Sequence[TraceRequest], policy_name: str, capacity: int, **options: float
) -> EvictionPolicy:
    """The policy to replay: an online one from the engine's module, or an offline one over the trace."""
    if policy_name == "belady":
        return Belady(capacity, requests)
    if policy_name == "belady-prefix":
        return BeladyPrefix(capacity, requests)
    if policy_name == "infinite":
        return Infinite()
    if policy_name in POLICIES:
        return make_policy(policy_name, capacity, **options)
    raise ValueError(f"unknown policy {policy_name!r}; expected one of {', '.join(REPLAY_POLICIES)}")


def replay(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity: int,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    history: float = 4.0,
) -> ReplayResult:
    """Replay the trace against one policy and capacity (in blocks)."""
    policy_name = resolve_policy(policy_name)
    options = {"small_ratio": small_ratio, "max_freq": max_freq, "history": history}
    cache = make_cache(requests, policy_name, capacity, **options)
    return replay_cache(requests, cache, policy_name, block_size)


def replay_cache(
    requests: Sequence[TraceRequest],
    cache: EvictionPolicy,
    policy_name: str,
    block_size: int = 512,
    hits: Iterator[int] | None = None,
) -> ReplayResult:
    """Replay the trace against a policy object (for one built with options that `replay` does not pass).
    hits: the prefix hits, if the caller watches them pass (by default, prefix_hits of the cache)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if hits is None:
        hits = prefix_hits(requests, cache, block_size)
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    for req, k in zip(requests, hits):
        hit_tokens += min(k * block_size, req.input_length)
        total_tokens += req.input_length
        hit_blocks += k
        total_blocks += len(req.hash_ids)
    rate = hit_tokens / total_tokens if total_tokens else 0.0
    unreachable = count_unreachable(cache, trace_parents(requests))
    return ReplayResult(policy_name, hit_tokens, total_tokens, rate, hit_blocks, total_blocks, unreachable)


def prefix_hits(
    requests: Iterable[TraceRequest], cache: EvictionPolicy, block_size: int = 512
) -> Iterator[int]:
    """Replay each request against the cache and yield its prefix hit in blocks: the blocks it found
    cached, up to the first miss, checked before any access. The request's accesses and releases are
    done when its count is yielded, so the cache has seen the whole trace once the last one is."""
    for req in requests:
        k = 0
        for h in req.hash_ids:  # residency check before any access: stop at the first miss
            if h not in cache:
                break
            k += 1
        parent, last = None, len(req.hash_ids) - 1
        partial_tail = req.input_length < len(req.hash_ids) * block_size  # the last block is not full
        for i, h in enumerate(req.hash_ids):
            cache.access(h, parent, partial_tail and i == last)
            parent = h
        for h in reversed(req.hash_ids):  # the request is done: its blocks are released tail first
            cache.release(h)
        yield k


def trace_parents(requests: Iterable[TraceRequest]) -> dict:
    """Each block's parent, the block before it, as the trace first showed it."""
    parents: dict = {}
    for req in requests:
        for parent, h in zip([None, *req.hash_ids], req.hash_ids):
            parents.setdefault(h, parent)
    return parents


class _DiskModel:
    """The disk tier's bookkeeping in a replay: the engine's policy class, and the traffic it causes."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self.written = self.read = self.evicted = 0

    def put(self, key: object, parent: object) -> None:
        """A write of a block the disk lacks (if the policy admits it), or a touch of one it holds. The
        engine's disk tier pins nothing: every access is released at once."""
        new = key not in self.policy
        self.evicted += len(self.policy.access(key, parent))
        self.policy.release(key)
        self.written += new and key in self.policy


def replay_tiers(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity: int,
    disk_capacity: int,
    disk_policy: str = DISK_EVICTION,
    disk_writes: str = "behind",
    block_size: int = 512,
) -> TieredReplayResult:
    """Replay the trace against a RAM cache of `capacity` blocks over a disk tier of `disk_capacity` blocks
    (0: none). Hit accounting as `replay_cache`, with the prefix k extended on disk: RAM blocks from index 0,
    then disk blocks, up to the first block in neither."""
    if disk_writes not in DISK_WRITE_RULES:
        raise ValueError(f"disk_writes must be one of {DISK_WRITE_RULES}, got {disk_writes!r}")
    if disk_capacity < 0 or block_size < 1:
        raise ValueError("disk_capacity must be >= 0 and block_size >= 1")
    policy_name = resolve_policy(policy_name)
    ram = make_cache(requests, policy_name, capacity)
    disk = _DiskModel(make_policy(disk_policy, disk_capacity)) if disk_capacity else None
    parents = trace_parents(requests)
    partials: set = set()  # blocks some request had as a partial last block: never written to disk
    ram_tokens = disk_tokens = total_tokens = 0
    for req in requests:
        blocks = req.hash_ids
        k = 0
        while k < len(blocks) and blocks[k] in ram:
            k += 1
        d = k
        while disk is not None and d < len(blocks) and blocks[d] in disk.policy:
            d += 1
        ram_hit = min(k * block_size, req.input_length)
        ram_tokens += ram_hit
        disk_tokens += min(d * block_size, req.input_length) - ram_hit
        total_tokens += req.input_length
        parent, last = None, len(blocks) - 1
        partial_tail = req.input_length < len(blocks) * block_size
        for i, h in enumerate(blocks):
            partial = partial_tail and i == last
            if partial:
                partials.add(h)
            evicted = ram.access(h, parent, partial)
            if disk is not None:
                if k <= i < d:  # read back from disk: a use of the disk copy
                    disk.read += 1
                    disk.put(h, parent)
                elif i >= d and disk_writes == "behind" and not partial:
                    disk.put(h, parent)  # computed and published: written behind
                if disk_writes == "eviction":
                    for e in evicted:
                        if e not in partials:
                            disk.put(e, parents[e])
            parent = h
        for h in reversed(blocks):
            ram.release(h)
    hits = ram_tokens + disk_tokens

    def rate(tokens: int) -> float:
        return tokens / total_tokens if total_tokens else 0.0

    return TieredReplayResult(
        policy=policy_name,
        disk_policy=disk_policy,
        disk_writes=disk_writes,
        capacity=capacity,
        disk_capacity=disk_capacity,
        hit_tokens=hits,
        ram_hit_tokens=ram_tokens,
        disk_hit_tokens=disk_tokens,
        total_tokens=total_tokens,
        token_hit_rate=rate(hits),
        ram_hit_rate=rate(ram_tokens),
        disk_hit_rate=rate(disk_tokens),
        blocks_written=disk.written if disk else 0,
        blocks_read=disk.read if disk else 0,
        blocks_evicted=disk.evicted if disk else 0,
    )


def count_unreachable(cache: Iterable, parents: dict) -> int:
    """Cached blocks with some block of their prefix not cached: no lookup can reach them."""
    resident = set(cache)
    reachable: dict = {}
    for h in resident:
        path = []
        while h not in reachable:
            parent = parents.get(h)
            if parent is None:
                reachable[h] = True
                break
            if parent not in resident:
                reachable[h] = False
                break
            path.append(h)
            h = parent
        for p in path:
            reachable[p] = reachable[h]
    return sum(1 for h in resident if not reachable[h])


def route_trace(
    requests: Sequence[TraceRequest], replicas: int, routing: RoutingConfig
) -> list[list[TraceRequest]]:
    """Each replica's requests, in trace order, as the router sends them (keys: the trace's block hashes)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    names = [f"replica-{i}" for i in range(replicas)]
    router = Router(routing, names)
    shards: dict[str, list[TraceRequest]] = {name: [] for name in names}
    for req in requests:
        shards[router.choose(req.hash_ids)[0]].append(req)
    return list(shards.values())


def replay_replicas(
    requests: Sequence[TraceRequest],
    policy_name: str,
    capacity: int,
    replicas: int,
    routing: str | RoutingConfig = "affinity",
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    history: float = 4.0,
) -> ReplicasReplayResult:
    """Route the trace over `replicas` replicas, each with its own cache of `capacity` blocks, and replay."""
    config = routing if isinstance(routing, RoutingConfig) else RoutingConfig(policy=routing)
    shards = route_trace(requests, replicas, config)
    options = dict(block_size=block_size, small_ratio=small_ratio, max_freq=max_freq, history=history)
    results = [replay(shard, policy_name, capacity, **options) for shard in shards]
    hit_tokens = sum(r.hit_tokens for r in results)
    total_tokens = sum(r.total_tokens for r in results)
    counts = [len(shard) for shard in shards]
    return ReplicasReplayResult(
        policy=resolve_policy(policy_name),
        hit_tokens=hit_tokens,
        total_tokens=total_tokens,
        token_hit_rate=hit_tokens / total_tokens if total_tokens else 0.0,
        hit_blocks=sum(r.hit_blocks for r in results),
        total_blocks=sum(r.total_blocks for r in results),
        unreachable_blocks=sum(r.unreachable_blocks for r in results),
        load_imbalance=max(counts) * replicas / len(requests) if requests else 0.0,
        requests_per_replica=counts,
        replicas=replicas,
        routing=config.policy,
    )


def sweep(
    requests: Sequence[TraceRequest],
    policies: Iterable[str],
    capacities: Iterable[int],
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    history: float = 4.0,
    progress: Callable[[], None] | None = None,
) -> list[dict]:
    """One row per (policy, capacity): {"policy", "capacity", **ReplayResult}. ``progress`` is called after each."""
    rows = []
    for policy in policies:
        for capacity in capacities:
            result = replay(requests, policy, capacity, block_size, small_ratio, max_freq, history)
            rows.append({"capacity": capacity, **asdict(result)})
            if progress is not None:
                progress()
    return rows


def format_table(rows: Sequence[dict], key: str = "token_hit_rate") -> str:
    """Markdown table: one row per capacity, one column per policy, cells the rows' `key`."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    capacities = sorted({r["capacity"] for r in rows})
    value = {(r["policy"], r["capacity"]): r[key] for r in rows}
    lines = [
        "| capacity (blocks) | " + " | ".join(policies) + " |",
        "|---:|" + "---:|" * len(policies),
    ]
    for cap in capacities:
        cells = [_cell(value[p, cap]) if (p, cap) in value else "" for p in policies]
        lines.append(f"| {cap} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(v: float | int) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def plot_sweep(rows: Sequence[dict], path: str | Path, title: str = "") -> None:
    """PNG: token hit rate vs capacity (log x), one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["capacity"], r["token_hit_rate"]) for r in rows if r["policy"] == policy)
        ax.plot([c for c, _ in pts], [h for _, h in pts], marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (blocks)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_tiered(r: TieredReplayResult) -> str:
    """The text report of a two-tier replay."""
    return "\n".join(
        [
            f"policy: {r.policy} ({r.capacity} blocks in RAM); disk: {r.disk_policy} ({r.disk_capacity} blocks), "
            f"writes {r.disk_writes}",
            f"token hit rate: {r.token_hit_rate:.6f} (ram {r.ram_hit_rate:.6f}, disk {r.disk_hit_rate:.6f})",
            f"hit tokens: {r.hit_tokens} (ram {r.ram_hit_tokens}, disk {r.disk_hit_tokens})",
            f"total tokens: {r.total_tokens}",
            f"disk blocks written: {r.blocks_written}, read: {r.blocks_read}, evicted: {r.blocks_evicted}",
        ]
    )


# --- CLI ---


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # exit 2 with the message, no usage dump on stdout
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv(kind: Callable[[str], object]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad list {text!r}") from None

    return parse


def _parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="minivllm replay", description="Replay a prefix-cache trace against eviction policies."
    )
    p.add_argument("trace", help="JSON-lines trace (hash_ids, input_length[, timestamp])")
    p.add_argument(
        "--policy",
        choices=(DEFAULT, *REPLAY_POLICIES),
        help=f"policy for a single replay ({DEFAULT}: the engine's, {DEFAULT_EVICTION})",
    )
    p.add_argument("--capacity", type=int, help="cache capacity in blocks for a single replay (per replica)")
    p.add_argument(
        "--replicas", type=int, help="route the trace over this many replicas, each with its own cache"
    )
    p.add_argument(
        "--routing", choices=ROUTINGS, help="with --replicas: how requests are routed (default affinity)"
    )
    p.add_argument(
        "--disk-capacity", type=int, help="add a disk tier of this many blocks under the RAM cache (0: none)"
    )
    p.add_argument(
        "--disk-policy",
        choices=POLICIES,
        help=f"with --disk-capacity: the disk tier's eviction policy (default the engine's, {DISK_EVICTION})",
    )
    p.add_argument(
        "--disk-writes",
        choices=DISK_WRITE_RULES,
        help="with --disk-capacity: write blocks to disk when published (behind, the engine's) or when RAM "
        "evicts them (eviction)",
    )
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--small-ratio", type=float, default=0.1, help="S3FIFO small-queue share")
    p.add_argument("--max-freq", type=int, default=3, help="S3FIFO frequency cap")
    p.add_argument(
        "--history", type=float, default=4.0, help="adaptive: evicted keys remembered, times the capacity"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--sweep", action="store_true", help="replay every policy x capacity, print a Markdown table"
    )
    p.add_argument("--policies", type=_csv(str), default=list(REPLAY_POLICIES), help="comma list for --sweep")
    p.add_argument("--capacities", type=_csv(int), help="comma list of block capacities for --sweep")
    p.add_argument("--plot", help="with --sweep: write a PNG of hit rate vs capacity")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.block_size < 1:
        p.error("--block-size must be >= 1")
    if args.replicas is not None and (args.replicas < 1 or args.sweep):
        p.error("--replicas must be >= 1, and is for a single replay (not --sweep)")
    if args.routing is not None and args.replicas is None:
        p.error("--routing needs --replicas")
    if args.disk_capacity is not None and (args.disk_capacity < 0 or args.sweep or args.replicas is not None):
        p.error("--disk-capacity must be >= 0, and is for a single replay (not --sweep or --replicas)")
    if (args.disk_policy or args.disk_writes) and args.disk_capacity is None:
        p.error("--disk-policy and --disk-writes need --disk-capacity")
    if args.sweep:
        if not args.capacities:
            p.error("--sweep needs --capacities")
        bad = [x for x in args.policies if x not in (DEFAULT, *REPLAY_POLICIES)]
        if bad or not args.policies:
            p.error(f"--policies: unknown {bad}; choose from {DEFAULT}, {', '.join(REPLAY_POLICIES)}")
        caps = args.capacities
    else:
        if args.policy is None or args.capacity is None:
            p.error("--policy and --capacity are required (or use --sweep)")
        caps = [args.capacity]
    if any(c < 1 for c in caps):
        p.error("capacities must be >= 1")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        _check_args(p, args)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        requests = load_trace(args.trace)
        opts = dict(
            block_size=args.block_size,
            small_ratio=args.small_ratio,
            max_freq=args.max_freq,
            history=args.history,
        )
        if args.sweep:
            rows = sweep(requests, args.policies, args.capacities, **opts)
        elif args.disk_capacity is not None:
            result = replay_tiers(
                requests,
                args.policy,
                args.capacity,
                args.disk_capacity,
                args.disk_policy or DISK_EVICTION,
                args.disk_writes or "behind",
                args.block_size,
            )
        elif args.replicas is not None:
            routing = args.routing or "affinity"
            result = replay_replicas(requests, args.policy, args.capacity, args.replicas, routing, **opts)
        else:
            result = replay(requests, args.policy, args.capacity, **opts)
    except ValueError as e:  # TraceError, bad S3FIFO ratios or history
        print(f"minivllm replay: error: {e}", file=sys.stderr)
        return 2

    if args.sweep:
        print(json.dumps(rows, indent=2) if args.json else format_table(rows))
        if args.plot:
            try:
                plot_sweep(rows, args.plot, title=Path(args.trace).name)
            except OSError as e:
                print(f"minivllm replay: error: cannot write plot {args.plot}: {e}", file=sys.stderr)
                return 2
        return 0
    if args.json:
        print(json.dumps(asdict(result)))
    elif isinstance(result, TieredReplayResult):
        print(format_tiered(result))
    else:
        print(f"policy: {result.policy}")
        print(f"hit tokens: {result.hit_tokens}")
        print(f"total tokens: {result.total_tokens}")
        print(f"token hit rate: {result.token_hit_rate:.6f}")
        print(f"hit blocks: {result.hit_blocks}")
        print(f"total blocks: {result.total_blocks}")
        print(f"unreachable blocks: {result.unreachable_blocks}")
        if isinstance(result, ReplicasReplayResult):
            print(f"replicas: {result.replicas} ({result.routing})")
            print(f"load imbalance (max/mean requests): {result.load_imbalance:.4f}")
            print(f"requests per replica: {' '.join(map(str, result.requests_per_replica))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
