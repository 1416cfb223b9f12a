"""What each configuration of the default reaches alone on one trace: whether a shortfall is reachable.

The default follows one of its configurations at a time (minivllm.cache.eviction.Adaptive), so on a
trace whose traffic keeps one shape it can at best match the configuration that suits it from the start.
This replays, side by side, the seed's baselines (LRU and S3FIFO), each configuration run alone as a
cache (``Segmented``), S3FIFO as the default's cache would hold it (``FollowedS3FIFO``: S3FIFO's keys in a
cache whose pages in use cannot leave, where the seed's S3FIFO gives up a long prompt's first blocks while
it reads the rest) and the default with its switches. Each is given as a token hit rate and
as a ratio to max(LRU, S3FIFO), the robustness bar's baseline. Where no configuration alone reaches the
bar, following the best of them cannot either; where one does, the default's shortfall is the cost of
finding it.

TRACE is a JSON-lines trace or a drawn one, FAMILY#SEED (benchmarks/trace_families.py).
Writes benchmarks/results/replay_alone-<trace>-<capacity>.md. With --span N it adds each policy's hits, in
blocks, per span of N requests: where in the trace the default loses (a late switch, a costly one, a
streak it followed). With --around it adds the default and the baselines at capacities 2% and 4% either
side (benchmarks/replay_sensitivity.py's factors): a shortfall that comes and goes with a pool a few
percent larger or smaller is one prompt held or not, not a property of the policy.

    python -m benchmarks.replay_alone TRACE --capacity 1000 [--span 100] [--around]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.replay_diff import Switch, load, recording_switches, write_result
from benchmarks.replay_sensitivity import FACTORS
from benchmarks.replay_sweep import REPO, git_commit, machine
from minivllm.cache.eviction import CONFIGURATION_NAMES, CONFIGURATIONS, FollowedS3FIFO, Segmented
from minivllm.replay import (
    DEFAULT,
    TraceRequest,
    make_cache,
    prefix_hits,
    replay,
    replay_cache,
    resolve_policy,
)

BAR = 0.97  # the robustness bar: the default's hits over max(LRU, S3FIFO)
FOLLOWED = "S3FIFO as the cache follows it"


def hit_rates(
    requests: Sequence[TraceRequest],
    capacity: int,
    switches: list[Switch],
    blocks: dict[str, list[int]] | None = None,
) -> dict[str, float]:
    """Token hit rate per policy: the baselines, each configuration alone, the followed S3FIFO, the default
    (whose changes of configuration are appended to switches). blocks, if given, gets each policy's block
    hits per request."""
    caches = {p: make_cache(requests, p, capacity) for p in ("lru", "s3fifo")}
    # the last configuration's expert is S3FIFO itself, as the cache follows it; its rules are the one before
    for name, configuration in zip(CONFIGURATION_NAMES[:-1], CONFIGURATIONS[:-1]):
        caches[f"{name}, alone"] = Segmented(capacity, 4.0, *configuration)
    caches[FOLLOWED] = FollowedS3FIFO(capacity)
    caches[DEFAULT] = make_cache(requests, resolve_policy(DEFAULT), capacity)
    rates = {}
    for name, cache in caches.items():
        hits = prefix_hits(requests, cache)
        if name == DEFAULT:
            hits = recording_switches(cache, hits, switches)
        per_request = list(hits)  # the whole replay first: replay_cache reads the cache's final state
        if blocks is not None:
            blocks[name] = per_request
        rates[name] = replay_cache(requests, cache, name, hits=iter(per_request)).token_hit_rate
    return rates


def span_table(blocks: dict[str, list[int]], span: int) -> list[str]:
    """Each policy's block hits per span of requests, a column per policy, then the totals."""
    names = list(blocks)
    n = len(next(iter(blocks.values())))
    lines = [
        f"Block hits per {span} requests (the first request of each span; the default's switches above):",
        "",
        "| requests | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for start in range(0, n, span):
        lines.append(
            f"| {start} | " + " | ".join(str(sum(blocks[p][start : start + span])) for p in names) + " |"
        )
    lines.append("| all | " + " | ".join(str(sum(blocks[p])) for p in names) + " |")
    return lines


def around(requests: Sequence[TraceRequest], capacity: int, at_capacity: dict[str, float]) -> list[dict]:
    """The default and the baselines at each of FACTORS times the capacity (at the capacity itself, their rates
    in at_capacity, from hit_rates); the ratio is None where neither baseline hits (no bar to fall under)."""
    policies = ("lru", "s3fifo", DEFAULT)
    rows = []
    for factor in FACTORS:
        size = round(capacity * factor)
        if size == capacity:  # replayed already, beside the configurations
            rates = {p: at_capacity[p] for p in policies}
        else:
            rates = {p: replay(requests, p, size).token_hit_rate for p in policies}
        base = max(rates["lru"], rates["s3fifo"])
        rows.append({"capacity": size, **rates, "ratio": rates[DEFAULT] / base if base else None})
    return rows


def around_table(rows: list[dict]) -> list[str]:
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    spread = f"{min(ratios):.3f}x to {max(ratios):.3f}x max(LRU, S3FIFO), " if ratios else ""
    return [
        f"The default at capacities {rows[0]['capacity']}-{rows[-1]['capacity']} (x{FACTORS[0]:g} to "
        f"x{FACTORS[-1]:g}): {spread}{sum(r < BAR for r in ratios)} of {len(rows)} below the bar "
        "(-: neither baseline hits):",
        "",
        f"| capacity | lru | s3fifo | {DEFAULT} | / max(LRU, S3FIFO) |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {r['capacity']} | {r['lru']:.4f} | {r['s3fifo']:.4f} | {r[DEFAULT]:.4f} | "
            + ("-" if r["ratio"] is None else f"{r['ratio']:.3f}")
            + " |"
            for r in rows
        ),
    ]


def markdown(
    trace: str,
    capacity: int,
    rates: dict[str, float],
    switches: list[Switch],
    blocks: dict[str, list[int]] | None = None,
    span: int = 0,
    near: list[dict] | None = None,
) -> str:
    base = max(rates["lru"], rates["s3fifo"])
    ratio = {p: r / base if base else 0.0 for p, r in rates.items()}
    # the configurations alone; the last one's expert is S3FIFO as the cache follows it
    alone = [p for p in rates if p.endswith(", alone")] + [FOLLOWED]
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
        f"- {FOLLOWED}: {ratio[FOLLOWED]:.3f}x",
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
    if blocks and span:
        lines += ["", *span_table(blocks, span)]
    if near:
        lines += ["", *around_table(near)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a JSON-lines trace, or FAMILY#SEED from benchmarks/trace_families.py")
    p.add_argument("--capacity", type=int, required=True, help="cache capacity in blocks")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--span", type=int, default=0, help="also give block hits per span of this many requests")
    p.add_argument(
        "--around",
        action="store_true",
        help="also replay the default and the baselines 2%% and 4%% either side of the capacity",
    )
    args = p.parse_args(argv)
    if args.span < 0:
        p.error(f"--span must be >= 0, got {args.span}")
    switches: list[Switch] = []
    blocks: dict[str, list[int]] = {}
    requests = load(args.trace)
    rates = hit_rates(requests, args.capacity, switches, blocks)
    near = around(requests, args.capacity, rates) if args.around else None
    md = markdown(args.trace, args.capacity, rates, switches, blocks, args.span, near)
    write_result(args.out_dir, "replay_alone", args.trace, args.capacity, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
