"""Does the default eviction policy hold up beyond the two shared traces? And how much does its one parameter matter?

1. Robustness: on adversarial traces (benchmarks/adversarial_traces.py: agent sessions on shared system
   prompts with one-off scans, rotating prompts, many long prompts, recency-heavy conversation forests)
   and on quarter and third windows of both Mooncake traces, the default policy's token hit rate
   against the better of LRU and the seed's S3FIFO, at 1k, 3k and 10k blocks. The bar: at least 97% everywhere.
2. Sensitivity: the adaptive policy's history length (evicted keys remembered, times the capacity) on the
   full traces, and its worst ratio on the robustness suite for a few lengths.

Writes benchmarks/results/replay_robustness.{json,md}.

    python -m benchmarks.replay_robustness [--traces-dir ../shared/traces] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from pathlib import Path

from tqdm import tqdm

from benchmarks.adversarial_traces import SUITE, windows
from benchmarks.replay_sweep import REPO, TRACES, git_commit, machine, traces_missing
from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import load_trace, replay

CAPACITIES = (1000, 3000, 10000)
BASELINES = ("lru", "s3fifo")
BAR = 0.97
HISTORIES = (2.0, 4.0, 8.0)  # on the full traces
SUITE_HISTORIES = (2.0, 4.0)  # on the robustness suite
DEFAULT_HISTORY = 4.0
TRACES_DIR = REPO.parent / "shared" / "traces"


@cache
def trace(name: str, traces_dir: str) -> list:
    """A suite trace, a full Mooncake trace ("<trace>"), or a window of one ("<trace>@<i>/<parts>")."""
    if name in SUITE:
        return SUITE[name]()
    base, _, window = name.partition("@")
    requests = load_trace(Path(traces_dir) / f"{base}.jsonl")
    if not window:
        return requests
    i, parts = map(int, window.split("/"))
    return windows(requests, parts)[i]


def hit_rate(job: tuple) -> tuple:
    name, capacity, policy, history, traces_dir = job
    return job, replay(trace(name, traces_dir), policy, capacity, history=history).token_hit_rate


def run_jobs(jobs: list[tuple], workers: int) -> dict[tuple, float]:
    with ProcessPoolExecutor(workers) as pool:
        out = {}
        for job, rate in tqdm(pool.map(hit_rate, jobs, chunksize=2), total=len(jobs), desc="replays"):
            out[job[:4]] = rate
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces-dir", type=Path, default=TRACES_DIR)
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument(
        "--quick", action="store_true", help="two suite traces, one window, 1k blocks: a smoke test"
    )
    args = p.parse_args(argv)
    if traces_missing(args.traces_dir):
        return 2
    td = str(args.traces_dir)
    suite = list(SUITE) + [f"{t}@{i}/{n}" for n in (4, 3) for t in TRACES for i in range(n)]
    capacities, histories, suite_histories = CAPACITIES, HISTORIES, SUITE_HISTORIES
    if args.quick:
        suite, capacities, histories, suite_histories = suite[:2] + suite[-1:], (1000,), (4.0,), (4.0,)

    jobs = [(n, c, b, DEFAULT_HISTORY, td) for n in suite for c in capacities for b in BASELINES]
    jobs += [(n, c, "adaptive", h, td) for n in suite for c in capacities for h in suite_histories]
    jobs += [(t, c, pol, DEFAULT_HISTORY, td) for t in TRACES for c in capacities for pol in BASELINES]
    jobs += [(t, c, "adaptive", h, td) for t in TRACES for c in capacities for h in histories]
    rates = run_jobs(list(dict.fromkeys(jobs)), args.workers)

    def ratio(name: str, capacity: int, history: float) -> float:
        best = max(rates[name, capacity, b, DEFAULT_HISTORY] for b in BASELINES)
        return rates[name, capacity, "adaptive", history] / best if best else 1.0

    robustness = [
        {
            "trace": n,
            "capacity": c,
            **{b: rates[n, c, b, DEFAULT_HISTORY] for b in BASELINES},
            DEFAULT_EVICTION: rates[n, c, "adaptive", DEFAULT_HISTORY],
            "ratio": ratio(n, c, DEFAULT_HISTORY),
        }
        for n in suite
        for c in capacities
    ]
    sensitivity = [
        {
            "history": h,
            **{f"{t}@{c}": rates[t, c, "adaptive", h] for t in TRACES for c in capacities},
            "worst ratio on the suite": min(ratio(n, c, h) for n in suite for c in capacities)
            if h in suite_histories
            else None,
        }
        for h in histories
    ]
    baselines = {
        f"{t}@{c}": {b: rates[t, c, b, DEFAULT_HISTORY] for b in BASELINES}
        for t in TRACES
        for c in capacities
    }
    record = {
        "machine": machine(),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "policy": DEFAULT_EVICTION,
        "default_history": DEFAULT_HISTORY,
        "bar": BAR,
        "robustness": robustness,
        "sensitivity": sensitivity,
        "full_trace_baselines": baselines,
    }
    name = "replay_robustness" + ("-quick" if args.quick else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    md = markdown(record)
    (args.out_dir / f"{name}.md").write_text(md)
    print(md)
    return 0


def markdown(record: dict) -> str:
    policy, rows = record["policy"], record["robustness"]
    worst = min(rows, key=lambda r: r["ratio"])
    lines = [
        "# Eviction policy robustness",
        "",
        f"Commit {record['git_commit']}, {record['date']}. Token hit rate (512-token blocks) of `{policy}` "
        f"(history {record['default_history']}) against LRU and the seed's S3FIFO; ratio = {policy} / "
        f"max(lru, s3fifo), bar {record['bar']}. Worst: {worst['ratio']:.3f} ({worst['trace']}, "
        f"{worst['capacity']} blocks); below the bar: {sum(r['ratio'] < record['bar'] for r in rows)} of {len(rows)}.",
        "",
        f"| trace | capacity | lru | s3fifo | {policy} | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        flag = " **below**" if r["ratio"] < record["bar"] else ""
        lines.append(
            f"| {r['trace']} | {r['capacity']} | {r['lru']:.4f} | {r['s3fifo']:.4f} | {r[policy]:.4f} "
            f"| {r['ratio']:.3f}{flag} |"
        )
    sens = record["sensitivity"]
    cols = [k for k in sens[0] if k not in ("history", "worst ratio on the suite")]
    lines += [
        "",
        "## Sensitivity to the history length (evicted keys remembered, times the capacity)",
        "",
        "| history | " + " | ".join(cols) + " | worst ratio on the suite |",
        "|---:|" + "---:|" * (len(cols) + 1),
    ]
    base = record["full_trace_baselines"]
    lines.append(
        "| lru / s3fifo | "
        + " | ".join(f"{base[c]['lru']:.4f} / {base[c]['s3fifo']:.4f}" for c in cols)
        + " | |"
    )
    for s in sens:
        w = s["worst ratio on the suite"]
        lines.append(
            f"| {s['history']:g} | "
            + " | ".join(f"{s[c]:.4f}" for c in cols)
            + f" | {'' if w is None else f'{w:.3f}'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
