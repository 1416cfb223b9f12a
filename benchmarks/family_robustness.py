"""The default eviction policy over a distribution of traces, not a list of cases.

Draws many traces from every family of benchmarks/trace_families.py (forests of growing conversations,
conversation and recency forests, agent sessions, scans, Zipf prompts, Mooncake windows), each with its own
seed and parameters, and replays each at 1k, 3k and 10k blocks against LRU, the seed's S3FIFO and the
infinite cache. It prints the worst ratio of the default to max(LRU, S3FIFO) (the bar: 0.97), the worst
ratio to the infinite cache where LRU reaches 99.5% of it (the bar: 0.985), and any unreachable block. The bars hold
where the trace's largest request fits in a third of the cache, as in the real traces (the Mooncake
traces' largest request is under a third of 1k blocks); cases outside are listed apart. For each case under
the first bar it also gives the default's net against the better baseline in standard deviations of the
noise of their per-request differences (benchmarks/replay_diff.py): a net within TELLS_APART of them is one
the trace cannot tell from chance. The bar stays the bar; this says which misses a rule could have avoided.

Writes benchmarks/results/family_robustness.{json,md}.

    python -m benchmarks.family_robustness [--seeds 40] [--mooncake-seeds 8] [--workers 2]
    python -m benchmarks.family_robustness --wide --name family_robustness-wide   # the wide ranges
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

from benchmarks.replay_diff import differences, net_and_noise
from benchmarks.replay_sweep import REPO, git_commit, machine
from benchmarks.trace_families import FAMILIES, WIDE_PARAMS, Drawn, draw, mooncake_present
from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import replay

CAPACITIES = (1000, 3000, 10000)
POLICIES = ("infinite", "lru", "s3fifo", DEFAULT_EVICTION)
BAR = 0.97  # the default against max(LRU, S3FIFO)
INFINITE_BAR = 0.985  # the default against the infinite cache, where LRU reaches LRU_HOLDS of it
LRU_HOLDS = 0.995
TELLS_APART = 2.0  # deviations of the noise of the per-request differences beyond which a net is not chance


def replay_all(job: tuple[Drawn, tuple[int, ...]]) -> list[dict]:
    """One drawn trace at each capacity: every policy's token hit rate, and the default's unreachable blocks."""
    drawn, capacities = job
    requests = drawn.requests()
    largest = max(len(r.hash_ids) for r in requests)
    rows = []
    for capacity in capacities:
        row = {"trace": drawn.name, "family": drawn.family, "capacity": capacity}
        row["in_scope"] = 3 * largest <= capacity
        for policy in POLICIES:
            result = replay(requests, policy, capacity)
            row[policy] = result.token_hit_rate
        row["unreachable"] = result.unreachable_blocks  # the default's, replayed last
        baseline = max(("lru", "s3fifo"), key=row.__getitem__)  # the better of the two (LRU on a tie)
        best = row[baseline]
        row["ratio"] = row[DEFAULT_EVICTION] / best if best else 1.0
        row["to_infinite"] = row[DEFAULT_EVICTION] / row["infinite"] if row["infinite"] else 1.0
        row["lru_holds"] = row["lru"] >= LRU_HOLDS * row["infinite"]
        if row["ratio"] < BAR:
            row.update(against_the_noise(requests, baseline, capacity))
        rows.append(row)
        if row["infinite"] == row["lru"] == row[DEFAULT_EVICTION]:
            # a larger cache holds the working set just the same: the larger capacities add nothing
            rows += [{**row, "capacity": c, "in_scope": 3 * largest <= c} for c in capacities if c > capacity]
            break
    return rows


def against_the_noise(requests: list, baseline: str, capacity: int) -> dict:
    """The default's net against the baseline on this case, in blocks, and in standard deviations of the
    noise of their per-request differences (both replayed once more, with their hits per request: only the
    few cases under the bar need them)."""
    net, noise = net_and_noise(differences(requests, (DEFAULT_EVICTION, baseline), capacity))
    return {"baseline": baseline, "net_blocks": net, "net_deviations": net / noise if noise else 0.0}


def summary(all_rows: list[dict]) -> dict:
    rows = [r for r in all_rows if r["in_scope"]]
    out = [r for r in all_rows if not r["in_scope"]]
    worst = min(rows, key=lambda r: r["ratio"])
    held = [r for r in rows if r["lru_holds"]]
    worst_inf = min(held, key=lambda r: r["to_infinite"]) if held else None
    return {
        "cases": len(rows),
        "traces": len({r["trace"] for r in rows}),
        "worst_ratio": worst["ratio"],
        "worst_ratio_case": f"{worst['trace']} @ {worst['capacity']}",
        "below_bar": sum(r["ratio"] < BAR for r in rows),
        "below_bar_beyond_noise": sum(r["ratio"] < BAR and r["net_deviations"] < -TELLS_APART for r in rows),
        "lru_holds_cases": len(held),
        "worst_to_infinite": worst_inf["to_infinite"] if worst_inf else None,
        "worst_to_infinite_case": f"{worst_inf['trace']} @ {worst_inf['capacity']}" if worst_inf else None,
        "below_infinite_bar": sum(r["to_infinite"] < INFINITE_BAR for r in held),
        "unreachable": sum(r["unreachable"] for r in all_rows),
        "out_of_scope_cases": len(out),
        "out_of_scope_worst_ratio": min((r["ratio"] for r in out), default=None),
        "per_family": {
            f: min(r["ratio"] for r in rows if r["family"] == f)
            for f in dict.fromkeys(r["family"] for r in rows)
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40, help="traces drawn per synthetic family")
    p.add_argument("--mooncake-seeds", type=int, default=8, help="Mooncake windows drawn (0: none)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--name", default="family_robustness", help="results file name (without extension)")
    p.add_argument(
        "--wide",
        action="store_true",
        help="forests, conversations and agents from the wide ranges of parameters",
    )
    args = p.parse_args(argv)
    capacities = tuple(int(c) for c in args.capacities.split(","))
    drawn = []
    for family in WIDE_PARAMS if args.wide else FAMILIES:
        n = args.seeds if family != "mooncake" else args.mooncake_seeds * mooncake_present()
        drawn += [draw(family, seed, args.wide) for seed in range(args.first_seed, args.first_seed + n)]
    jobs = [(d, capacities) for d in drawn]
    rows: list[dict] = []
    with ProcessPoolExecutor(args.workers) as pool:
        for out in tqdm(pool.map(replay_all, jobs), total=len(jobs), desc="traces"):
            rows += out
    record = {
        "machine": machine(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "policy": DEFAULT_EVICTION,
        "seeds": args.seeds,
        "mooncake_seeds": 0 if args.wide else args.mooncake_seeds,
        "wide": args.wide,
        "first_seed": args.first_seed,
        "capacities": capacities,
        "summary": summary(rows),
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    md = markdown(record)
    (args.out_dir / f"{args.name}.md").write_text(md)
    print(md)
    return 0


def markdown(record: dict) -> str:
    s, policy = record["summary"], record["policy"]
    inf = "n/a" if s["worst_to_infinite"] is None else f"{s['worst_to_infinite']:.4f}"
    wide = "'s wide ranges of parameters" if record.get("wide") else ""
    lines = [
        "# Eviction policy over drawn traces",
        "",
        f"Commit {record['git_commit']}, {record['date']}. {s['traces']} traces drawn from "
        f"benchmarks/trace_families.py{wide} ({record['seeds']} seeds per synthetic family from seed "
        f"{record['first_seed']}, {record['mooncake_seeds']} Mooncake windows), at "
        f"{', '.join(map(str, record['capacities']))} blocks: {s['cases']} cases.",
        "",
        f"- worst `{policy}` / max(lru, s3fifo): **{s['worst_ratio']:.4f}** ({s['worst_ratio_case']}); "
        f"below {BAR}: {s['below_bar']} of {s['cases']}, of which {s['below_bar_beyond_noise']} by more than "
        f"{TELLS_APART:g} deviations of the noise of their per-request differences",
        f"- worst `{policy}` / infinite where LRU reaches {LRU_HOLDS:.1%} of the infinite cache "
        f"({s['lru_holds_cases']} cases): **{inf}** ({s['worst_to_infinite_case']}); below {INFINITE_BAR}: "
        f"{s['below_infinite_bar']}",
        f"- unreachable blocks left by `{policy}`: {s['unreachable']}",
        f"- cases whose largest request exceeds a third of the cache (not under the bars): "
        f"{s['out_of_scope_cases']}, worst ratio "
        + ("n/a" if s["out_of_scope_worst_ratio"] is None else f"{s['out_of_scope_worst_ratio']:.4f}"),
        "",
        "| family | worst ratio to max(lru, s3fifo) |",
        "|---|---:|",
    ]
    lines += [f"| {f} | {r:.4f} |" for f, r in s["per_family"].items()]
    worst = sorted((r for r in record["rows"] if r["in_scope"]), key=lambda r: r["ratio"])[:15]
    lines += [
        "",
        "The 15 lowest ratios (within the bars' scope):",
        "",
        f"| trace | capacity | infinite | lru | s3fifo | {policy} | ratio | net under {BAR}, blocks (deviations) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['trace']} | {r['capacity']} | {r['infinite']:.4f} | {r['lru']:.4f} | {r['s3fifo']:.4f} "
        f"| {r[policy]:.4f} | {r['ratio']:.3f} | "
        + (f"{r['net_blocks']:+d} ({r['net_deviations']:+.2f})" if "net_blocks" in r else "")
        + " |"
        for r in worst
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
