"""The disk tier on a real model, in one process: what a long prompt's time to first token is cold, warm in
RAM and warm from disk, how fast the tier reads, and what writing behind costs the decode.

1. TTFT of one --prompt-tokens prompt: cold (computed); warm in RAM; warm from disk after its pages left
   the RAM pool (KVManager.clear_cache: what eviction does to them, without an hour of other prefills);
   warm from disk in a new engine on the same directory (a restart). Before each disk run the tier's files
   are evicted from the OS page cache (posix_fadvise; where it is missing the detail says so), so the
   reads come from the disk.
2. The tier's read rate (one prompt's pages, reader thread), with the OS page cache dropped and warm; the
   index rebuild at start, for the pages written and for a full default tier (as many files as 20 GiB of
   this model's pages); how long the writer trails the cold prefill.
3. Decode tok/s of --batch requests with the disk tier (every published page copied out after its step
   and written behind) against without, alternating; and the stepping thread's time per page copied out.
4. The file layout: write rate of one file per page (the tier's) against files of 32 pages, at the model's
   page size.

Writes benchmarks/results/kv_tier.{json,md} (kv_tier-quick.* with --quick, the tiny-model smoke run).

    python -m benchmarks.kv_tier [--model DIR] [--prompt-tokens 8192] [--runs 3] [--allow-dirty]
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import gc
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.harness import models, results
from benchmarks.harness.engine_timing import decode_rate
from minivllm import EngineConfig, SamplingParams
from minivllm.cache.disk_tier import DEFAULT_MAX_BYTES, DiskTier, PageRecord
from minivllm.cache.page_file import TierIdentity, checksum, encode_header, with_checksum
from minivllm.cache.page_hash import extend_page_hashes
from minivllm.engine.llm_engine import LLMEngine

BATCHED_PAGES = 32  # pages per file in the layout comparison
LAYOUT_PAGES = 256


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 30000)) for _ in range(n)]


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to the first token, cached tokens, of which from disk (stats delta)."""
    disk_before = engine.stats().prefix_hit_tokens_disk
    start = time.perf_counter()
    seq = engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while not seq.output_token_ids:
        engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, seq.num_cached_tokens, engine.stats().prefix_hit_tokens_disk - disk_before


def drop_page_cache(directory: Path) -> bool:
    """Evict the tier's files from the OS page cache, so that reads come from the disk (Linux: fsync, then
    POSIX_FADV_DONTNEED). False where the OS offers no way."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in (directory / "pages").iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_rate(tier: DiskTier, prompt: list[int], directory: Path, cold: bool) -> tuple[float, int]:
    """GB/s of one read of the prompt's pages by the tier's reader thread, and the pages read."""
    hashes: list[bytes] = []
    extend_page_hashes(hashes, prompt, tier.identity.page_size)
    records = tier.lookup(hashes, prompt, 0)
    if cold:
        drop_page_cache(directory)
    start = time.perf_counter()
    read = tier.read(records)
    tier.wait_for_reads([read], timeout=3600)
    seconds = time.perf_counter() - start
    return read.num_ok * tier.identity.page_bytes / seconds / 1e9, read.num_ok


def timed_copies(engine: LLMEngine) -> list[tuple[int, float]]:
    """Record (pages, seconds) of every copy of published pages out of the pools (the stepping thread's
    share of writing behind)."""
    copies: list[tuple[int, float]] = []
    page_payloads = engine.runner.page_payloads

    def timed(pages: list[int]) -> np.ndarray:
        start = time.perf_counter()
        out = page_payloads(pages)
        copies.append((len(pages), time.perf_counter() - start))
        return out

    engine.runner.page_payloads = timed
    return copies


def decode_rates(with_disk: LLMEngine, without: LLMEngine, args, vocab: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"with": [], "without": []}
    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
    for run in range(args.runs):
        for label, engine in (("with", with_disk), ("without", without)):
            prompts = [
                prompt_ids(args.decode_prompt_tokens, vocab, 1000 + 100 * run + i) for i in range(args.batch)
            ]
            seqs = [engine.add_request(f"decode-{label}-{run}-{i}", p, params) for i, p in enumerate(prompts)]
            rates[label].append(decode_rate(engine, seqs))
    return rates


def layout_rates(directory: Path, identity: TierIdentity) -> dict[str, float]:
    """MB/s writing LAYOUT_PAGES pages as one file each (temp + rename, as the tier does) and as files of
    BATCHED_PAGES pages (no fsync in either: the tier leaves write-back to the OS)."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = np.random.default_rng(0).integers(0, 256, identity.page_bytes, dtype=np.uint8)
    pages = []
    for i in range(LAYOUT_PAGES):
        head = encode_header(identity, i.to_bytes(16, "little"), None, tuple(range(identity.page_size)))
        pages.append(with_checksum(head, checksum(head, memoryview(payload))) + payload.tobytes())
    out = {}
    for label, per_file in (("one page per file", 1), (f"{BATCHED_PAGES} pages per file", BATCHED_PAGES)):
        start = time.perf_counter()
        for first in range(0, LAYOUT_PAGES, per_file):
            temp, final = directory / f".{label}-{first}.tmp", directory / f"{per_file}-{first}.kv"
            with open(temp, "wb") as f:
                for page in pages[first : first + per_file]:
                    f.write(page)
            os.replace(temp, final)
        out[label] = sum(map(len, pages)) / (time.perf_counter() - start) / 1e6
    shutil.rmtree(directory)
    return out


def full_tier_rebuild(directory: Path, identity: TierIdentity, pages: int) -> float:
    """Seconds to rebuild the index of a tier of `pages` page files: the real header and token ids with a
    64-byte payload (a start reads headers only, so the payload's size does not enter; the files' metadata
    is in the OS cache, as after writing them)."""
    small = replace(identity, page_bytes=64)
    capacity = pages * tier_block_bytes(directory, small)
    tier = DiskTier(directory, capacity, small)
    payloads = np.zeros((1024, small.page_bytes), dtype=np.uint8)
    tokens = tuple(range(small.page_size))
    for first in range(0, pages, len(payloads)):
        n = min(len(payloads), pages - first)
        tier.write(
            [PageRecord(i.to_bytes(16, "little"), None, tokens) for i in range(first, first + n)],
            payloads[:n],
        )
        tier.flush()
    tier.close()
    start = time.perf_counter()
    rebuilt = DiskTier(directory, capacity, small)
    seconds = time.perf_counter() - start
    assert rebuilt.num_pages == pages, (rebuilt.num_pages, pages)
    rebuilt.close()
    shutil.rmtree(directory)
    return seconds


def tier_block_bytes(directory: Path, identity: TierIdentity) -> int:
    """What one page file occupies: its size rounded up to the file system's block."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.statvfs(directory).f_frsize or 4096
    return -(-identity.file_bytes // block) * block


def run(args, model: Path, disk_dir: Path) -> tuple[list[dict], dict]:
    config = dict(
        model=str(model), single_flight="off", kv_disk_dir=str(disk_dir), kv_disk_bytes=args.disk_bytes
    )
    engine = LLMEngine(EngineConfig(**config))
    vocab, page = engine.vocab_size, engine.config.page_size
    prompt = prompt_ids(args.prompt_tokens, vocab, seed=0)
    raw: dict = {"cold": [], "ram": [], "disk": [], "restart": []}
    raw["cold"].append(ttft(engine, "cold", prompt))
    start = time.perf_counter()
    engine.kv.disk.flush()
    drain = time.perf_counter() - start
    for i in range(args.runs):
        raw["ram"].append(ttft(engine, f"ram-{i}", prompt))
    dropped = True
    for i in range(args.runs):
        engine.kv.clear_cache()
        dropped = drop_page_cache(disk_dir)
        raw["disk"].append(ttft(engine, f"disk-{i}", prompt))
    cold_reads = [read_rate(engine.kv.disk, prompt, disk_dir, cold=True) for _ in range(args.runs)]
    warm_reads = [read_rate(engine.kv.disk, prompt, disk_dir, cold=False) for _ in range(args.runs)]
    identity, capacity = engine.kv.disk.identity, engine.kv.disk.capacity_bytes
    engine.close()
    del engine
    gc.collect()  # its pools and weights, before two more engines load
    start = time.perf_counter()
    tier = DiskTier(disk_dir, capacity, identity)
    rebuild, indexed = time.perf_counter() - start, tier.num_pages
    tier.close()
    restarted = LLMEngine(EngineConfig(**config))
    drop_page_cache(disk_dir)
    raw["restart"].append(ttft(restarted, "restart", prompt))
    copies = timed_copies(restarted)
    without = LLMEngine(EngineConfig(**{**config, "kv_disk_dir": None}))
    rates = decode_rates(restarted, without, args, vocab)
    restarted.close()
    layout = layout_rates(disk_dir / "layout", identity)
    full_pages = args.full_tier_bytes // tier_block_bytes(disk_dir, identity)
    full_rebuild = full_tier_rebuild(disk_dir / "full", identity, full_pages)
    rows = [
        ttft_row("TTFT, cold", raw["cold"]),
        ttft_row("TTFT, warm in RAM", raw["ram"]),
        ttft_row("TTFT, warm from disk (RAM cache dropped)", raw["disk"], dropped),
        ttft_row("TTFT, warm from disk after a restart", raw["restart"], dropped),
        rate_row("disk tier read, OS page cache dropped", cold_reads, dropped),
        rate_row("disk tier read, OS page cache warm", warm_reads, True),
        row("index rebuild at start", f"{rebuild:.3f}", "s", f"{indexed} pages"),
        row(
            "index rebuild at start, full tier",
            f"{full_rebuild:.3f}",
            "s",
            f"{full_pages} pages ({args.full_tier_bytes / 2**30:.2f} GiB of this model's pages)",
        ),
        row("writer behind the cold prefill, at its end", f"{drain:.3f}", "s", "until every page is written"),
        row("decode, no disk tier", fmt_rate(rates["without"]), "tok/s", f"batch {args.batch}"),
        row(
            "decode, with the disk tier (write-behind)",
            fmt_rate(rates["with"]),
            "tok/s",
            f"batch {args.batch}",
        ),
        row(
            "write-behind / no disk tier, decode",
            f"{statistics.fmean(rates['with']) / statistics.fmean(rates['without']):.3f}",
            "x",
            "",
        ),
        row(
            "stepping thread per page copied out",
            f"{1e3 * sum(s for _, s in copies) / max(1, sum(n for n, _ in copies)):.3f}",
            "ms",
            f"{sum(n for n, _ in copies)} pages in {len(copies)} copies",
        ),
    ]
    rows += [
        row(f"page files written, {label}", f"{mbs:,.1f}", "MB/s", f"{LAYOUT_PAGES} pages")
        for label, mbs in layout.items()
    ]
    extra = {
        "prompt_tokens": args.prompt_tokens,
        "restorable_tokens": (args.prompt_tokens - 1) // page * page,
        "page_bytes": identity.page_bytes,
        "runs": args.runs,
        "os_page_cache_dropped": dropped,
    }
    return rows, {
        "raw": {**raw, "cold_reads": cold_reads, "warm_reads": warm_reads, "decode": rates, "layout": layout},
        **extra,
    }


def row(measurement: str, value: str, unit: str, detail: str) -> dict:
    return {"measurement": measurement, "value": value, "unit": unit, "detail": detail}


def ttft_row(label: str, runs: list[tuple[float, int, int]], dropped: bool = True) -> dict:
    cached, disk = runs[0][1], runs[0][2]
    detail = f"{cached} tokens cached, {disk} from disk" + ("" if dropped else " (OS page cache not dropped)")
    return row(label, results.fmt_ms([s for s, _, _ in runs]), "ms", detail)


def rate_row(label: str, reads: list[tuple[float, int]], dropped: bool) -> dict:
    detail = f"{reads[0][1]} pages per read" + ("" if dropped else " (OS page cache not dropped)")
    return row(label, fmt_rate([r for r, _ in reads], digits=2), "GB/s", detail)


def fmt_rate(values: list[float], digits: int = 1) -> str:
    mean, sd = results.mean_sd(values)
    return f"{mean:,.{digits}f} ± {sd:,.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model dir (default: the offline default model)")
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument(
        "--runs", type=int, default=3, help="runs of each warm measurement (the cold one runs once)"
    )
    p.add_argument(
        "--batch", type=int, default=4, help="requests decoding together in the write-behind check"
    )
    p.add_argument("--decode-prompt-tokens", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--disk-bytes", type=int, default=4 << 30)
    p.add_argument(
        "--full-tier-bytes", type=int, default=DEFAULT_MAX_BYTES, help="the full tier whose rebuild is timed"
    )
    p.add_argument(
        "--disk-dir", type=Path, help="where the tier lives while measuring (default: a temporary one)"
    )
    p.add_argument("--quick", action="store_true", help="a short smoke run (kv_tier-quick.*)")
    p.add_argument("--out", type=Path, default=results.RESULTS_DIR)
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.runs, args.batch = 200, 1, 2
        args.decode_prompt_tokens, args.decode_tokens = 40, 24
        args.full_tier_bytes = 2000 * 12288
    results.require_clean_tree(args.allow_dirty)
    model = models.resolve_model(args.model)
    disk_dir = args.disk_dir or Path(tempfile.mkdtemp(prefix="minivllm-kv-tier-"))
    try:
        rows, extra = run(args, model, disk_dir)
    finally:
        if args.disk_dir is None:
            shutil.rmtree(disk_dir, ignore_errors=True)
    raw = extra.pop("raw")
    meta = results.metadata(model, page_size=16, **extra)
    name = "kv_tier-quick" if args.quick else "kv_tier"
    notes = (
        "TTFT: add_request to the first token, in this process (no server). Warm from disk: the prompt's "
        "pages were dropped from the RAM pool, then read back by the reader thread into free pool pages. "
        "Disk read rate: one read of the prompt's pages, bytes over seconds until the reader is done."
    )
    paths = results.write_results(
        name, rows, meta, out_dir=args.out, raw=raw, notes=notes, allow_dirty=args.allow_dirty
    )
    results.print_report(paths)


if __name__ == "__main__":
    main()
