"""What each configuration of the default reaches alone on one trace: whether a shortfall is reachable.

The default follows one of its configurations at a time (minivllm.cache.eviction.Adaptive), so on a
trace whose traffic keeps one shape it can at best match the configuration that suits it from the start.
This replays, side by side, the seed's baselines (LRU and S3FIFO), each configuration run alone as a
cache (``Segmented``), S3FIFO with the pins an engine keeps (``PinnedS3FIFO``: a request's pages are its
KV, so no page a request in flight uses can leave, where the seed's S3FIFO gives up a long prompt's first
blocks while it reads the rest) and the default with its switches. Each is given as a token hit rate and
as a ratio to max(LRU, S3FIFO), the robustness bar's baseline. Where no configuration alone reaches the
bar, following the best of them cannot either; where one does, the default's shortfall is the cost of
finding it.

TRACE is a JSON-lines trace or a drawn one, FAMILY#SEED (benchmarks/trace_families.py).
Writes benchmarks/results/replay_alone-<trace>-<capacity>.md.

    python -m benchmarks.replay_alone TRACE --capacity 1000
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.replay_diff import Switch, load, recording_switches, write_result
from benchmarks.replay_sweep import REPO, git_commit, machine
from minivllm.cache.eviction import CONFIGURATION_NAMES, CONFIGURATIONS, PinnedS3FIFO, Segmented
from minivllm.replay import DEFAULT, TraceRequest, make_cache, prefix_hits, replay_cache, resolve_policy

BAR = 0.97  # the robustness bar: the default's hits over max(LRU, S3FIFO)
PINNED = "S3FIFO with the engine's pins"


def hit_rates(requests: Sequence[TraceRequest], capacity: int, switches: list[Switch]) -> dict[str, float]:
    """Token hit rate per policy: the baselines, each configuration alone, the pinned S3FIFO, the default
    (whose changes of configuration are appended to switches)."""
    rates = {
        p: replay_cache(requests, make_cache(requests, p, capacity), p).token_hit_rate
        for p in ("lru", "s3fifo")
    }
    # the last configuration's expert is S3FIFO itself, run pinned (below); its rules are the one before it
    for name, configuration in zip(CONFIGURATION_NAMES[:-1], CONFIGURATIONS[:-1]):
        rates[f"{name}, alone"] = replay_cache(
            requests, Segmented(capacity, 4.0, *configuration), name
        ).token_hit_rate
    rates[PINNED] = replay_cache(requests, PinnedS3FIFO(capacity), PINNED).token_hit_rate
    cache = make_cache(requests, resolve_policy(DEFAULT), capacity)
    hits = recording_switches(cache, prefix_hits(requests, cache), switches)
    rates[DEFAULT] = replay_cache(requests, cache, DEFAULT, hits=hits).token_hit_rate
    return rates


def markdown(trace: str, capacity: int, rates: dict[str, float], switches: list[Switch]) -> str:
    base = max(rates["lru"], rates["s3fifo"])
    ratio = {p: r / base if base else 0.0 for p, r in rates.items()}
    # the configurations alone; the last one's expert is S3FIFO run pinned
    alone = [p for p in rates if p.endswith(", alone")] + [PINNED]
    best = max(alone, key=rates.__getitem__)
    lines = [
        f"# What each configuration of the default reaches alone: {trace} at {capacity} blocks",
        "",
        f"Commit {git_commit()}, {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, "
        f"{machine()['processor']}.",
        "",
        f"- the default: {ratio[DEFAULT]:.3f}x max(LRU, S3FIFO)",
        f"- the best configuration alone, {best.removesuffix(', alone')}: {ratio[best]:.3f}x; "
        + ("none reaches" if ratio[best] < BAR else "it reaches")
        + f" the bar of {BAR}x",
        f"- {PINNED}: {ratio[PINNED]:.3f}x",
        (
            "- the default switched configuration after request "
            + ", ".join(f"{s.request} ({s.before} -> {s.after})" for s in switches)
            if switches
            else "- the default never switched configuration"
        ),
        "",
        "| policy | token hit rate | / max(LRU, S3FIFO) |",
        "|---|---:|---:|",
        *(f"| {p} | {r:.4f} | {ratio[p]:.3f} |" for p, r in rates.items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a JSON-lines trace, or FAMILY#SEED from benchmarks/trace_families.py")
    p.add_argument("--capacity", type=int, required=True, help="cache capacity in blocks")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    switches: list[Switch] = []
    rates = hit_rates(load(args.trace), args.capacity, switches)
    md = markdown(args.trace, args.capacity, rates, switches)
    write_result(args.out_dir, "replay_alone", args.trace, args.capacity, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
