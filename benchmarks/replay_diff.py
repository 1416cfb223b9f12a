"""Which requests decide the hit rates of two eviction policies on one trace.

Replays a trace against two policies side by side (the replay's own accounting, minivllm.replay) and lists
the requests whose prefix hits differ: for each, its blocks, each policy's hit, and what the trace showed
of its prompt before (how many earlier requests started with the same block, and how many requests ago
the last one did). The summary compares the net gap between the policies with the sum of the
differences: a gap made of a few long prompts that one policy happened to hold and the other did not is
a coin flip, not a rule. It also gives the net in standard deviations of its noise, the root of the summed
squares of the differences: how far the net would spread were each request a coin flip between the two
policies' hits. A net within about two of them is one the trace cannot tell from chance.

TRACE is a JSON-lines trace or a drawn one, FAMILY#SEED (benchmarks/trace_families.py, e.g. mooncake#2).
Writes benchmarks/results/replay_diff-<trace>-<capacity>.md.

    python -m benchmarks.replay_diff TRACE --capacity 1000 [--policies adaptive,lru]
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.replay_sweep import REPO, git_commit, machine
from benchmarks.trace_families import FAMILIES, draw
from minivllm.cache.eviction import CONFIGURATION_NAMES, EvictionPolicy
from minivllm.replay import (
    DEFAULT,
    REPLAY_POLICIES,
    TraceRequest,
    load_trace,
    make_cache,
    prefix_hits,
    resolve_policy,
)


@dataclass(frozen=True)
class Difference:
    request: int  # index in the trace
    blocks: int
    hits: tuple[int, int]  # each policy's prefix hit, in blocks
    earlier: int  # earlier requests that started with the same block
    since: int | None  # requests since the last of them (None: the first)


@dataclass(frozen=True)
class Switch:
    request: int  # the index of the request after which the cache runs another configuration
    before: str
    after: str


def recording_switches(cache: EvictionPolicy, hits: Iterator[int], switches: list[Switch]) -> Iterator[int]:
    """hits, passed on; where the cache follows one of its configurations (the default), each change of
    configuration is appended to switches."""
    mode = getattr(cache, "mode", None)
    for i, hit in enumerate(hits):
        if getattr(cache, "mode", None) != mode:
            switches.append(Switch(i, CONFIGURATION_NAMES[mode], CONFIGURATION_NAMES[cache.mode]))
            mode = cache.mode
        yield hit


def write_result(out_dir: Path, kind: str, trace: str, capacity: int, md: str) -> None:
    """Write and print a per-trace result, out_dir/<kind>-<trace>-<capacity>.md (a drawn trace is named by
    its FAMILY#SEED, a file by its stem)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "", Path(trace).stem if "#" not in trace else trace)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{kind}-{name}-{capacity}.md").write_text(md)
    print(md)


def load(trace: str) -> list[TraceRequest]:
    family, _, seed = trace.partition("#")
    if family in FAMILIES and seed.isdigit():
        return draw(family, int(seed)).requests()
    return load_trace(trace)


def differences(
    requests: Sequence[TraceRequest], policies: Sequence[str], capacity: int, switches: dict | None = None
) -> list[Difference]:
    """The requests whose prefix hits differ between the two policies, in trace order. switches: a list
    per policy, to which each change of the configuration its cache follows is appended."""
    switches = {p: [] for p in policies} if switches is None else switches
    caches = [make_cache(requests, resolve_policy(p), capacity) for p in policies]
    a, b = (recording_switches(c, prefix_hits(requests, c), switches[p]) for c, p in zip(caches, policies))
    starts: dict = {}  # first block -> the requests that started with it so far
    out = []
    for i, (req, hit_a, hit_b) in enumerate(zip(requests, a, b)):
        before = starts.setdefault(req.hash_ids[0], []) if req.hash_ids else []
        if hit_a != hit_b:
            since = i - before[-1] if before else None
            out.append(Difference(i, len(req.hash_ids), (hit_a, hit_b), len(before), since))
        before.append(i)
    return out


def net_and_noise(diffs: Sequence[Difference]) -> tuple[int, float]:
    """The net of the first policy's hits over the second's, in blocks, and its noise: the root of the
    summed squares of the differences, the spread of the net were each request a coin flip between them."""
    net = sum(d.hits[0] - d.hits[1] for d in diffs)
    return net, sum((d.hits[0] - d.hits[1]) ** 2 for d in diffs) ** 0.5


def markdown(
    trace: str, capacity: int, policies: Sequence[str], n: int, diffs: list[Difference], switches: dict
) -> str:
    a, b = policies
    net, noise = net_and_noise(diffs)
    gross = sum(abs(d.hits[0] - d.hits[1]) for d in diffs)
    won = [d for d in diffs if d.hits[0] > d.hits[1]]
    lines = [
        f"# Requests that decide `{a}` against `{b}`: {trace} at {capacity} blocks",
        "",
        f"Commit {git_commit()}, {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
        f"{machine()['processor']}.",
        "",
        f"- {len(diffs)} of {n} requests differ: `{a}` hits more blocks on {len(won)}, `{b}` on "
        f"{len(diffs) - len(won)}",
        f"- net `{a}` - `{b}`: {net:+d} blocks, out of {gross} blocks of differences",
        f"- the net is {net / noise if noise else 0.0:+.2f} standard deviations of its noise ({noise:.0f} blocks, "
        "the root of the summed squares of the differences)",
        *(
            f"- `{p}` switched configuration after request "
            + ", ".join(f"{s.request} ({s.before} -> {s.after})" for s in switches[p])
            for p in policies
            if switches[p]
        ),
        "",
        f"| request | blocks | `{a}` hit | `{b}` hit | earlier requests with its first block "
        "| requests since the last |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {d.request} | {d.blocks} | {d.hits[0]} | {d.hits[1]} | {d.earlier} | "
        + ("-" if d.since is None else str(d.since))
        + " |"
        for d in diffs
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a JSON-lines trace, or FAMILY#SEED from benchmarks/trace_families.py")
    p.add_argument("--capacity", type=int, required=True, help="cache capacity in blocks")
    p.add_argument("--policies", default="adaptive,lru", help="two policies, comma-separated")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    policies = args.policies.split(",")
    if len(policies) != 2 or not set(policies) <= {*REPLAY_POLICIES, DEFAULT}:
        p.error(f"--policies: two of {', '.join(REPLAY_POLICIES)}")
    requests = load(args.trace)
    switches = {p: [] for p in policies}
    diffs = differences(requests, policies, args.capacity, switches)
    md = markdown(args.trace, args.capacity, policies, len(requests), diffs, switches)
    write_result(args.out_dir, "replay_diff", args.trace, args.capacity, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
