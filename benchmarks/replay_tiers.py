"""Two-tier prefix-cache replay: a disk tier under the RAM cache on the Mooncake traces.

1. The engine's rules (RAM: the default policy; disk: LRU, written behind) at 1k and 10k RAM blocks with
   0, 20k and 100k disk blocks: token hit rate by tier, against the infinite cache, and the disk's traffic.
   Acceptance: with 100k disk blocks and 1k RAM blocks, >= 95% of the infinite cache on both traces.
2. The design choices, at the same sizes: write behind (every published block, when published) against
   write on eviction (a block when RAM evicts it), and the disk's policy (LRU against adaptive, s3fifo).

Writes benchmarks/results/replay_tiers.{json,md} and replay_tiers_design.{json,md}.

    python -m benchmarks.replay_tiers [--traces-dir ../shared/traces] [--allow-dirty]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness import results
from benchmarks.replay_sweep import REPO, TRACES, git_commit, machine, traces_missing
from minivllm.cache.disk_tier import EVICTION as DISK_EVICTION
from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import load_trace, replay, replay_tiers

RAM_BLOCKS = (1000, 10000)
DISK_BLOCKS = (0, 20000, 100000)
ACCEPTANCE = (1000, 100000, 0.95)  # RAM blocks, disk blocks, share of the infinite cache's hit rate
DESIGN_SIZES = ((1000, 20000), (10000, 20000), (1000, 100000), (10000, 100000))
DESIGN = (  # (variant label, disk policy, write rule)
    ("lru, behind (the engine's)", DISK_EVICTION, "behind"),
    ("lru, on eviction", DISK_EVICTION, "eviction"),
    ("adaptive, behind", "adaptive", "behind"),
    ("s3fifo, behind", "s3fifo", "behind"),
)


def tier_rows(name: str, requests, infinite: float) -> list[dict]:
    rows = []
    for ram in RAM_BLOCKS:
        for disk in DISK_BLOCKS:
            r = replay_tiers(requests, DEFAULT_EVICTION, ram, disk)
            rows.append(
                {
                    "trace": name,
                    "RAM blocks": ram,
                    "disk blocks": disk,
                    "token hit rate": f"{r.token_hit_rate:.4f}",
                    "from RAM": f"{r.ram_hit_rate:.4f}",
                    "from disk": f"{r.disk_hit_rate:.4f}",
                    "vs infinite": f"{r.token_hit_rate / infinite:.3f}",
                    "blocks written": r.blocks_written,
                    "blocks read": r.blocks_read,
                    "blocks evicted on disk": r.blocks_evicted,
                }
            )
    return rows


def design_rows(name: str, requests) -> list[dict]:
    rows = []
    for ram, disk in DESIGN_SIZES:
        for label, policy, writes in DESIGN:
            r = replay_tiers(requests, DEFAULT_EVICTION, ram, disk, policy, writes)
            rows.append(
                {
                    "trace": name,
                    "RAM blocks": ram,
                    "disk blocks": disk,
                    "disk policy, writes": label,
                    "token hit rate": f"{r.token_hit_rate:.4f}",
                    "from disk": f"{r.disk_hit_rate:.4f}",
                    "blocks written": r.blocks_written,
                    "disk hits per block written": f"{r.blocks_read / r.blocks_written:.3f}"
                    if r.blocks_written
                    else None,
                }
            )
    return rows


def acceptance(rows: list[dict]) -> dict[str, bool]:
    ram, disk, share = ACCEPTANCE
    return {
        row["trace"]: float(row["vs infinite"]) >= share
        for row in rows
        if row["RAM blocks"] == ram and row["disk blocks"] == disk
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces-dir", type=Path, default=REPO.parent / "shared" / "traces")
    p.add_argument("--out-dir", type=Path, default=results.RESULTS_DIR)
    p.add_argument("--allow-dirty", action="store_true", help="run from uncommitted code; writes *-DIRTY.*")
    args = p.parse_args(argv)
    try:
        results.require_clean_tree()
        dirty = False
    except results.DirtyTree as e:
        if not args.allow_dirty:
            p.error(str(e))
        dirty = True
    if traces_missing(args.traces_dir):
        return 2
    tiers, design, infinite = [], [], {}
    for name in tqdm(TRACES, desc="traces"):
        requests = load_trace(args.traces_dir / f"{name}.jsonl")
        infinite[name] = replay(requests, "infinite", 1).token_hit_rate
        tiers += tier_rows(name, requests, infinite[name])
        design += design_rows(name, requests)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "git": {"commit": git_commit()[:7], "dirty": dirty},
        "block size": 512,
        "RAM policy": DEFAULT_EVICTION,
        "infinite cache hit rate": {name: round(rate, 4) for name, rate in infinite.items()},
        "acceptance (1k RAM, 100k disk blocks, >= 0.95x infinite)": acceptance(tiers),
    }
    notes = (
        "RAM: the engine's default policy; disk: LRU, every full block written behind when published (the "
        "engine's rules). A lookup walks RAM from block 0, then continues on disk; blocks found on disk are "
        "read back into RAM. vs infinite: the token hit rate over the infinite cache's."
    )
    written = results.write_results("replay_tiers", tiers, meta, out_dir=args.out_dir, notes=notes,
                                    allow_dirty=args.allow_dirty)  # fmt: skip
    results.print_report(written)
    notes = (
        "Write rules: behind writes every full block a request computes when it is published; on eviction "
        "writes a block when RAM evicts it (the disk then holds mostly what RAM does not). The disk's policy "
        "sees every write and every disk hit, never a RAM hit. Disk hits per block written: disk traffic "
        "in over traffic out."
    )
    written = results.write_results("replay_tiers_design", design, meta, out_dir=args.out_dir, notes=notes,
                                    allow_dirty=args.allow_dirty)  # fmt: skip
    results.print_report(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
