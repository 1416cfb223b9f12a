"""Prefix-cache hit rates over engine replicas: the Mooncake traces routed over N replicas (each with its
own cache) by affinity, least-loaded and round-robin routing, against one cache of the same total size.

Writes benchmarks/results/replay_replicas.{json,md}. The acceptance check of the routing rule (4 replicas
of 2,500 blocks vs one of 10,000): affinity >= 0.9x the single cache, >= 1.5x round-robin, max/mean load
<= 1.3.

    python -m benchmarks.replay_replicas [--traces-dir ../shared/traces] [--policies adaptive,lru,s3fifo]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness.results import DirtyTree, require_clean_tree
from benchmarks.replay_sweep import REPO, TRACES, git_commit, machine, traces_missing
from minivllm.cluster.routing import ROUTINGS, RoutingConfig
from minivllm.replay import load_trace, replay_replicas

TOTAL_BLOCKS = 10_000
REPLICAS = (1, 2, 4, 8)  # each with TOTAL_BLOCKS / replicas blocks


def rows_for(requests, policy: str) -> list[dict]:
    rows = []
    single = replay_replicas(requests, policy, TOTAL_BLOCKS, 1).token_hit_rate
    for n in REPLICAS[1:]:
        by_routing = {
            routing: replay_replicas(requests, policy, TOTAL_BLOCKS // n, n, routing) for routing in ROUTINGS
        }
        rr = by_routing["round-robin"].token_hit_rate
        for routing, r in by_routing.items():
            rows.append(
                {
                    "policy": policy,
                    "replicas": n,
                    "blocks per replica": TOTAL_BLOCKS // n,
                    "routing": routing,
                    "token hit rate": round(r.token_hit_rate, 4),
                    "vs one cache": round(r.token_hit_rate / single, 3) if single else None,
                    "vs round-robin": round(r.token_hit_rate / rr, 3) if rr else None,
                    "load imbalance": round(r.load_imbalance, 3),
                }
            )
    rows.insert(0, {"policy": policy, "replicas": 1, "blocks per replica": TOTAL_BLOCKS, "routing": "—",
                    "token hit rate": round(single, 4), "vs one cache": 1.0, "vs round-robin": None,
                    "load imbalance": 1.0})  # fmt: skip
    return rows


def acceptance(rows: list[dict]) -> dict:
    """The issue's check at 4 replicas, per policy."""
    out = {}
    for row in rows:
        if row["replicas"] == 4 and row["routing"] == "affinity":
            ok = row["vs one cache"] >= 0.9 and row["vs round-robin"] >= 1.5 and row["load imbalance"] <= 1.3
            out[row["policy"]] = ok
    return out


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("—" if row[c] is None else str(row[c]) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces-dir", type=Path, default=REPO.parent / "shared" / "traces")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--policies", default="adaptive,lru,s3fifo", help="comma list of eviction policies")
    p.add_argument("--allow-dirty", action="store_true", help="run from uncommitted code; writes *-DIRTY.*")
    args = p.parse_args(argv)
    try:
        require_clean_tree()
        out_name = "replay_replicas"
    except DirtyTree as e:
        if not args.allow_dirty:
            p.error(str(e))
        out_name = "replay_replicas-DIRTY"
    policies = [x for x in args.policies.split(",") if x]
    if traces_missing(args.traces_dir):
        return 2
    paths = {name: args.traces_dir / f"{name}.jsonl" for name in TRACES}

    results = {}
    for name, path in tqdm(paths.items(), desc="traces"):
        requests = load_trace(path)
        rows = [row for policy in policies for row in rows_for(requests, policy)]
        results[name] = {"requests": len(requests), "rows": rows, "acceptance (4 replicas)": acceptance(rows)}

    config = RoutingConfig()
    record = {
        "machine": machine(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "block_size": 512,
        "total_blocks": TOTAL_BLOCKS,
        "routing": {k: getattr(config, k) for k in ("window", "imbalance", "slack", "index_pages")},
        "traces": results,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{out_name}.json").write_text(json.dumps(record, indent=2) + "\n")
    md = [
        "# Prefix-cache replay over replicas",
        "",
        f"{TOTAL_BLOCKS} blocks in total (512-token blocks), split evenly over the replicas; each replica runs",
        "its own cache. Load imbalance: max / mean requests per replica. Routing parameters: "
        + ", ".join(f"{k} {v}" for k, v in record["routing"].items())
        + f"; commit {record['git_commit'][:7]}.",
        "",
    ]
    for name, res in results.items():
        md += [f"## {name}", "", f"{res['requests']} requests. Acceptance at 4 replicas (affinity >= 0.9x one cache,",
               f">= 1.5x round-robin, imbalance <= 1.3): {res['acceptance (4 replicas)']}.", "",
               markdown(res["rows"]), ""]  # fmt: skip
    (args.out_dir / f"{out_name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
