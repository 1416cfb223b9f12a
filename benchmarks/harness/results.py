"""Results: statistics, run metadata (machine, backend, model, commit), JSON + Markdown tables, plots."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, is_dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from benchmarks.harness.models import OPENBLAS, is_cpu_backend, model_dtype

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def mean_sd(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def fmt_ms(values: list[float]) -> str:
    """Seconds in, 'mean ± sd' in milliseconds out."""
    m, s = mean_sd(values)
    return f"{m * 1e3:,.1f} ± {s * 1e3:,.1f}"


def reduction(base: float, new: float) -> float:
    """Percent lower than base (negative: worse)."""
    return (1.0 - new / base) * 100.0 if base and not math.isnan(base) else math.nan


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _code_changed() -> bool:
    """Uncommitted changes outside benchmarks/results (results written by earlier scripts don't count)."""
    return bool(_git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"))


class DirtyTree(RuntimeError):
    """Results would not name the code that produced them."""


DIRTY_HELP = (
    "the tree has uncommitted changes outside benchmarks/results; commit them first, or pass --allow-dirty "
    "(results are then written as <name>-DIRTY.* with a warning, and must not be quoted)"
)
DIRTY_WARNING = (
    "DIRTY: written from a tree with uncommitted changes; the commit does not name the code that ran. "
    "Do not quote these numbers."
)


def require_clean_tree(allow_dirty: bool = False) -> None:
    """Called before a benchmark starts, so a dirty tree is refused before an hour of measuring."""
    if not allow_dirty and _code_changed():
        raise DirtyTree(DIRTY_HELP)


def _version(pkg: str) -> str:
    try:
        return importlib_metadata.version(pkg)
    except importlib_metadata.PackageNotFoundError:
        return "not installed"


def metadata(model_dir: Path, page_size: int | None = None, **extra: Any) -> dict[str, Any]:
    from minivllm.models.backend import detect_backend, processor_name  # noqa: I001  (first: it preloads OpenBLAS before mlx)
    import mlx.core as mx

    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": processor_name(),
            "cpu_count": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "mlx": {
            "default_device": str(mx.default_device()),
            "metal_available": mx.metal.is_available(),
            "backend": detect_backend().name,
            "mlx_version": _version("mlx"),
            "mlx_lm_version": _version("mlx-lm"),
            "openblas_preload_for_peer": is_cpu_backend() and OPENBLAS.exists(),
        },
        "model": {"dir": str(model_dir), "dtype": model_dtype(model_dir)},
        "page_size": page_size,
        "git": {"commit": _git("rev-parse", "--short", "HEAD"), "dirty": _code_changed()},
        **extra,
    }


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:,.1f}"
    return "—" if v is None else str(v)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(lines)


def engine_metadata(model_dir: Path, runs: int, **extra: Any) -> dict[str, Any]:
    """metadata() of a benchmark that runs minivllm's engine in its own process: the backend and BLAS."""
    from minivllm.models.backend import detect_backend

    backend = detect_backend()
    return metadata(model_dir, page_size=16, backend=backend.name, blas=backend.blas, runs=runs, **extra)


def write_results(
    name: str,
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    *,
    out_dir: Path = RESULTS_DIR,
    raw: Any = None,
    notes: str = "",
    allow_dirty: bool = False,
) -> tuple[Path, Path]:
    """Write <name>.json (rows, metadata, raw per-request data) and <name>.md (metadata header + table).

    Results from a dirty tree (meta["git"]["dirty"]) are refused unless allow_dirty; then they are written
    as <name>-DIRTY.* and both files open with a warning."""
    warning = []
    if meta["git"]["dirty"]:
        if not allow_dirty:
            raise DirtyTree(DIRTY_HELP)
        name, warning = f"{name}-DIRTY", [f"> **{DIRTY_WARNING}**", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    record = {"name": name, "metadata": meta, "rows": rows, "raw": raw}
    if warning:
        record = {"WARNING": DIRTY_WARNING, **record}
    json_path.write_text(json.dumps(record, indent=2, default=_json_default))
    header = [f"# {name}", ""] + warning + [f"- **{k}**: {_meta_line(v)}" for k, v in meta.items()]
    md_path.write_text("\n".join(header + ["", markdown_table(rows), ""] + ([notes, ""] if notes else [])))
    return json_path, md_path


def _meta_line(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={_meta_line(x)}" for k, x in v.items())
    return str(v)


def save_plot(
    name: str,
    groups: list[str],
    series: dict[str, list[float]],
    ylabel: str,
    *,
    out_dir: Path = RESULTS_DIR,
    log_y: bool = False,
) -> Path:
    """A grouped bar chart, <name>.png (log_y: a logarithmic value axis, for values spanning decades)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=label)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(name)
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _json_default(o: Any) -> Any:
    # Raw data may hold RequestResults and Paths: dataclasses become dicts, anything else a string.
    return asdict(o) if is_dataclass(o) and not isinstance(o, type) else str(o)


def print_report(paths: tuple[Path, Path]) -> None:
    """Print what write_results wrote: (json_path, md_path)."""
    json_path, md_path = paths
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
