"""Sweep eviction policies x cache capacities over the shared Mooncake traces.

Every policy the engine offers (the default first), the offline optima (belady, belady-prefix) and the
infinite cache, at 0.5k-20k blocks. Writes benchmarks/results/replay_sweep.{json,md} and
replay_sweep_<trace>.png.

    python benchmarks/replay_sweep.py [--traces-dir ../shared/traces] [--capacities 1000,2000,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from minivllm.cache.eviction import POLICIES as ENGINE_POLICIES  # noqa: E402
from minivllm.replay import OFFLINE_POLICIES, format_table, load_trace, plot_sweep, replay, sweep  # noqa: E402

TRACES = ("mooncake_conversation_trace", "mooncake_synthetic_trace")
POLICIES = ENGINE_POLICIES + OFFLINE_POLICIES
CAPACITIES = (500, 1000, 2000, 3000, 5000, 10000, 20000)
TIMING_CAPACITY = 10000  # capacity for the per-policy timing of one full conversation replay


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def time_full_replays(requests, capacity: int) -> dict[str, float]:
    """Seconds for one full replay of the trace, per policy (belady includes its next-use precompute)."""
    seconds = {}
    for policy in POLICIES:
        start = time.perf_counter()
        replay(requests, policy, capacity)
        seconds[policy] = round(time.perf_counter() - start, 4)
    return seconds


def traces_missing(traces_dir: Path) -> bool:
    """True, after an error on stderr, if a shared trace is not in traces_dir."""
    paths = [traces_dir / f"{name}.jsonl" for name in TRACES]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        print(f"error: trace files not found: {', '.join(missing)} (pass --traces-dir)", file=sys.stderr)
    return bool(missing)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces-dir", type=Path, default=REPO.parent / "shared" / "traces")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    args = p.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",")]

    if traces_missing(args.traces_dir):
        return 2
    traces = {name: load_trace(args.traces_dir / f"{name}.jsonl") for name in TRACES}

    conversation = traces["mooncake_conversation_trace"]
    timing = time_full_replays(conversation, TIMING_CAPACITY)
    for policy, secs in timing.items():
        print(f"full conversation trace, {policy} @ {TIMING_CAPACITY} blocks: {secs:.3f} s")
    slowest = max(timing.values())
    print(f"slowest policy: {slowest:.3f} s ({'under' if slowest < 5 else 'OVER'} the 5 s target)")

    results = {}
    with tqdm(total=len(traces) * len(POLICIES) * len(capacities), desc="replay sweep") as bar:
        for name, requests in traces.items():
            rows = sweep(requests, POLICIES, capacities, progress=bar.update)
            blocks = {h for r in requests for h in r.hash_ids}
            results[name] = {"requests": len(requests), "unique_blocks": len(blocks), "rows": rows}

    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": machine(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "block_size": 512,
        "s3fifo": {"small_ratio": 0.1, "max_freq": 3},
        "adaptive": {"history": 4.0},
        "policies": list(POLICIES),
        "capacities": capacities,
        "conversation_full_replay_seconds": {"capacity": TIMING_CAPACITY, **timing},
        "traces": results,
    }
    (args.out_dir / "replay_sweep.json").write_text(json.dumps(record, indent=2) + "\n")

    md = [
        "# Prefix-cache replay sweep",
        "",
        f"Commit {record['git_commit']}. Token hit rate (block size 512; adaptive history 4; S3FIFO",
        "small_ratio 0.1, max_freq 3). `adaptive` is the engine's default. S3FIFO follows the seed literally:",
        "S drains (freq-0 blocks to the ghost) whenever S is full, even while M has room. `belady` is the",
        "offline optimum over the flattened block stream (ties: the deeper block); `belady-prefix` restricts",
        "it to tails of cached prefixes, so it never caches a block its prefix cannot reach.",
        "",
    ]
    for name, res in results.items():
        md += [f"## {name}", "", f"{res['requests']} requests, {res['unique_blocks']} unique blocks.", ""]
        md += [format_table(res["rows"]), ""]
        md += ["Blocks cached at the end that no lookup can reach (a block of their prefix was evicted):", ""]
        md += [format_table(res["rows"], "unreachable_blocks"), ""]
        plot_sweep(res["rows"], args.out_dir / f"replay_sweep_{name}.png", title=name)
    (args.out_dir / "replay_sweep.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
