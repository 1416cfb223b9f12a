"""How far can one replay number be trusted, and how much does the adaptive split leave on the table?

On both full Mooncake traces at 1k, 3k and 10k blocks:

1. Neighbourhood: the default policy, LRU and the seed's S3FIFO at capacities 4% and 2% either side of
   each point. A difference between two policies smaller than the spread a 2% change of the pool
   causes is not a property of the policy.
2. Split: the segmented cache (minivllm.cache.eviction.Segmented, frequency within FREQUENT) with
   RECENT's target adapted against the same cache with the target fixed at a share of the capacity. The best fixed share is chosen in hindsight,
   per trace and capacity, so it bounds what any rule that only moves the split could reach there.

Writes benchmarks/results/replay_sensitivity.{json,md}.

    python -m benchmarks.replay_sensitivity [--traces-dir ../shared/traces]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from benchmarks.replay_robustness import TRACES_DIR, trace
from benchmarks.replay_sweep import REPO, TRACES, git_commit, machine, traces_missing
from minivllm.cache.eviction import Segmented
from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import replay, replay_cache

CAPACITIES = (1000, 3000, 10000)
FACTORS = (0.96, 0.98, 1.0, 1.02, 1.04)
POLICIES = (DEFAULT_EVICTION, "lru", "s3fifo")
SHARES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # fixed RECENT targets, share of the capacity


def hit_rate(job: tuple) -> tuple:
    """(trace, capacity, policy, share, traces_dir): share None replays the policy as shipped."""
    name, capacity, policy, share, traces_dir = job
    reqs = trace(name, traces_dir)
    if share is None:
        result = replay(reqs, policy, capacity)
    else:
        result = replay_cache(reqs, Segmented(capacity, recent_share=share), f"{policy}@{share}")
    return job[:4], result.token_hit_rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces-dir", type=Path, default=TRACES_DIR)
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    if traces_missing(args.traces_dir):
        return 2
    td = str(args.traces_dir)
    near = [
        (t, round(c * f), pol, None, td)
        for t in TRACES
        for c in CAPACITIES
        for f in FACTORS
        for pol in POLICIES
    ]
    split = [(t, c, "adaptive", s, td) for t in TRACES for c in CAPACITIES for s in (None, *SHARES)]
    jobs = sorted(dict.fromkeys(near + split), key=lambda j: -j[1])  # the long replays first
    with ProcessPoolExecutor(args.workers) as pool:
        rates = dict(tqdm(pool.map(hit_rate, jobs), total=len(jobs), desc="replays"))

    neighbourhood = []
    for t in TRACES:
        for c in CAPACITIES:
            for pol in POLICIES:
                around = [rates[t, round(c * f), pol, None] for f in FACTORS]
                drop = max(max(a - b for a, b in zip(around, around[1:])), 0.0)
                neighbourhood.append(
                    {
                        "trace": t,
                        "capacity": c,
                        "policy": pol,
                        "rate": rates[t, c, pol, None],
                        "factors": list(FACTORS),
                        "around": around,
                        "drop": drop,
                        "min": min(around),
                        "max": max(around),
                    }
                )
    splits = []
    for t in TRACES:
        for c in CAPACITIES:
            fixed = {str(s): rates[t, c, "adaptive", s] for s in SHARES}
            best = max(SHARES, key=lambda s: rates[t, c, "adaptive", s])
            splits.append(
                {
                    "trace": t,
                    "capacity": c,
                    "adaptive": rates[t, c, "adaptive", None],
                    "fixed": fixed,
                    "best_share": best,
                    "best_fixed": fixed[str(best)],
                }
            )
    record = {
        "machine": machine(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "policy": DEFAULT_EVICTION,
        "neighbourhood": neighbourhood,
        "split": splits,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "replay_sensitivity.json").write_text(json.dumps(record, indent=2) + "\n")
    md = markdown(record)
    (args.out_dir / "replay_sensitivity.md").write_text(md)
    print(md)
    return 0


def markdown(record: dict) -> str:
    factors = record["neighbourhood"][0]["factors"]
    lines = [
        "# How stable are the replay numbers?",
        "",
        f"Commit {record['git_commit']}, {record['date']}. Token hit rate, 512-token blocks, full Mooncake traces.",
        "",
        "## Neighbourhood: the same policy with a slightly smaller or larger pool (capacity x factor)",
        "",
        "Spread: max - min over the row. Largest drop: the most the hit rate falls when the pool grows one step;",
        "a drop is how far this point moves with a change that is not a change of the policy, so a difference",
        "between two policies smaller than it is not evidence for either.",
        "",
        "| trace | capacity | policy | "
        + " | ".join(f"x{f:g}" for f in factors)
        + " | spread | largest drop |",
        "|---|---:|---|" + "---:|" * (len(factors) + 2),
    ]
    for r in record["neighbourhood"]:
        lines.append(
            f"| {r['trace']} | {r['capacity']} | {r['policy']} | "
            + " | ".join(f"{v:.4f}" for v in r["around"])
            + f" | {r['max'] - r['min']:.4f} | {r['drop']:.4f} |"
        )
    shares = list(record["split"][0]["fixed"])
    lines += [
        "",
        "## Split: `adaptive` as shipped (RECENT's target adapted) against fixed targets",
        "",
        "Fixed target as a share of the capacity; the best fixed share is chosen in hindsight per row.",
        "",
        "| trace | capacity | adapted | " + " | ".join(shares) + " | best fixed |",
        "|---|---:|---:|" + "---:|" * (len(shares) + 1),
    ]
    for r in record["split"]:
        lines.append(
            f"| {r['trace']} | {r['capacity']} | {r['adaptive']:.4f} | "
            + " | ".join(f"{r['fixed'][s]:.4f}" for s in shares)
            + f" | {r['best_fixed']:.4f} ({r['best_share']:g}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
