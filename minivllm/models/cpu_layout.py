"""The layout of float32 weight matrices on the CPU backend, chosen by measurement.

`nn.Linear` keeps its weight as [out, in] and computes `x @ W.T`; OpenBLAS reads the same matrix at a
different speed when it is stored transposed, [in, out], and computed as `x @ W`. At batch 1 and small
batches a decode step is one pass over every weight matrix, so the faster layout is the faster decode.
Which one is faster depends on the machine, its BLAS and the matrix shape, so each distinct shape is
measured once per machine (both layouts, interleaved, at 1 and 8 rows for decode and 512 rows for a
prefill chunk) and the result cached in the model cache directory; a shape goes transposed only when
that is faster for decode and no slower for prefill. Matrices under 1 MiB stay native unmeasured.

Swapped layers become `TransposedLinear`, which computes the same function (OpenBLAS gives the same
bits either way), so a family's forward still calls `attn.q_proj(x)`. The swap goes one matrix at a
time and lets each old weight go before the next is copied: no second copy of the weights is kept.
A tied embedding used as the output layer stays as it is: a transposed copy would add the vocabulary
matrix (a quarter of a 0.5B model) to memory. Quantized layers (GPU backends) are never touched.
"""

import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from minivllm.models.backend import processor_name

logger = logging.getLogger(__name__)

LAYOUTS = ("auto", "transposed", "native")
DECODE_ROWS = (1, 8)
PREFILL_ROWS = 512
DECODE_PROBE_BYTES = 64 << 20  # per layout: matrices enough to outgrow the caches, as a model's weights do
PREFILL_PROBE_BYTES = 8 << 20
PROBE_MAX_MATRICES = 256  # small matrices cost their calls more than their bytes: fewer of them will do
# a smaller matrix stays native under "auto", unmeasured: it fits the caches, so its layout cannot change a
# weight-streaming decode, and a measurement of it is noise (a tiny test model's every matrix)
MIN_MEASURED_BYTES = 1 << 20
DECODE_GAIN = 0.95  # transposed only when its decode pass takes at most this share of the native one
PREFILL_SLACK = 1.02  # ... and its prefill pass at most this much longer (within the measurement's noise)
CACHE_VERSION = 1


class TransposedLinear(nn.Module):
    """nn.Linear's function with the weight stored as [in, out]: x @ weight_t (+ bias)."""

    def __init__(self, weight_t: mx.array, bias: mx.array | None = None):
        super().__init__()
        self.weight_t = weight_t
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


@dataclass
class ShapeTiming:
    """Milliseconds of one pass over a set of [out, in] matrices (measure_shape), per layout and row count."""

    native: dict[str, float]  # rows (as text, JSON keys) -> ms
    transposed: dict[str, float]

    def prefers_transposed(self) -> bool:
        decode = [str(r) for r in DECODE_ROWS]
        native, transposed = sum(self.native[r] for r in decode), sum(self.transposed[r] for r in decode)
        prefill = str(PREFILL_ROWS)
        return (
            transposed <= DECODE_GAIN * native
            and self.transposed[prefill] <= PREFILL_SLACK * self.native[prefill]
        )


def apply_layout(model: nn.Module, layout: str, cache_file: Path, blas: str) -> dict[str, str]:
    """Swap the model's float32 nn.Linear layers for TransposedLinear where `layout` says so ("auto":
    where the measurement says so). Returns the layout chosen per shape, "OUTxIN" -> layout."""
    if layout not in LAYOUTS:
        raise ValueError(f"cpu_weight_layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    names = [name for name, module in model.named_modules() if _swappable(module)]
    shapes = sorted({_shape_key(_module_at(model, name).weight.shape) for name in names})
    if layout == "auto":
        measured = [s for s in shapes if _shape_bytes(s) >= MIN_MEASURED_BYTES]
        timings = measured_timings(measured, cache_file, blas) if measured else {}
        chosen = {
            s: "transposed" if s in timings and timings[s].prefers_transposed() else "native" for s in shapes
        }
    else:
        chosen = dict.fromkeys(shapes, layout)
    for name in names:
        if chosen[_shape_key(_module_at(model, name).weight.shape)] == "transposed":
            _transpose(model, name)
    return chosen


def _swappable(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.weight.dtype == mx.float32


def _shape_key(shape: tuple[int, ...]) -> str:
    return f"{shape[0]}x{shape[1]}"


def _shape_bytes(key: str) -> int:
    out_features, in_features = map(int, key.split("x"))
    return 4 * out_features * in_features  # float32


def _module_at(model: nn.Module, name: str) -> nn.Module:
    module = model
    for part in name.split("."):
        module = module[int(part)] if isinstance(module, list) else getattr(module, part)
    return module


def _transpose(model: nn.Module, name: str) -> None:
    """Replace one Linear; its [out, in] weight is freed before the next layer is copied."""
    old = _module_at(model, name)
    layer = TransposedLinear(mx.contiguous(old.weight.T), old.get("bias"))
    mx.eval(layer.weight_t)
    parent, _, attr = name.rpartition(".")
    owner = _module_at(model, parent) if parent else model
    if isinstance(owner, list):
        owner[int(attr)] = layer
    else:
        setattr(owner, attr, layer)


# -- measuring ---------------------------------------------------------------------------------------------
def machine_key(blas: str) -> str:
    """What the measurement depends on: the processor, the cores, MLX's version and the BLAS."""
    return f"{platform.machine()} {processor_name()} x{os.cpu_count()} | mlx {mx.__version__} | {blas}"


def measured_timings(shapes: list[str], cache_file: Path, blas: str) -> dict[str, ShapeTiming]:
    """The timings of each shape on this machine: from the cache file, or measured now and added to it."""
    key = machine_key(blas)
    cached = _read_cache(cache_file).get(key, {})
    timings = {}
    timings = {shape: timing for shape in shapes if (timing := _cached_timing(cached.get(shape)))}
    missing = [shape for shape in shapes if shape not in timings]
    for shape in missing:
        out_features, in_features = map(int, shape.split("x"))
        timings[shape] = measure_shape(out_features, in_features)
        logger.info("weight layout %s: %s", shape, timings[shape])
    if missing:
        _write_cache(cache_file, key, {**cached, **{s: asdict(t) for s, t in timings.items()}})
    return timings


def _cached_timing(entry: object) -> ShapeTiming | None:
    """A cache entry as a ShapeTiming, or None when it is absent or not one (every row count's ms)."""
    rows = {str(r) for r in (*DECODE_ROWS, PREFILL_ROWS)}
    if not isinstance(entry, dict) or set(entry) != {"native", "transposed"}:
        return None
    for times in entry.values():
        if not isinstance(times, dict) or not rows <= set(times):
            return None
        if not all(isinstance(times[r], (int, float)) for r in rows):
            return None
    return ShapeTiming(**entry)


def _read_cache(path: Path) -> dict:
    """The cache's measurements by machine key; an unreadable or malformed file counts as empty."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    machines = data.get("machines")
    return (
        machines if isinstance(machines, dict) and all(isinstance(v, dict) for v in machines.values()) else {}
    )


def _write_cache(path: Path, key: str, entries: dict) -> None:
    machines = {**_read_cache(path), key: entries}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "machines": machines}, indent=1))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        logger.warning("cannot cache the weight layout measurement in %s: %s", path, e)


def measure_shape(out_features: int, in_features: int, repeats: int = 3) -> ShapeTiming:
    """Both layouts of matrices shaped like [out_features, in_features] (a larger one is measured with
    fewer output rows), each pass the fastest of `repeats`, the two layouts alternating so that a busy
    machine slows them alike. Decode reads DECODE_PROBE_BYTES of them (more than the caches hold, as a
    model's weights); a prefill is compute-bound, so a smaller set measures it."""
    timing = ShapeTiming({}, {})
    decode = _probe_matrices(out_features, in_features, DECODE_PROBE_BYTES)
    prefill = _probe_matrices(out_features, in_features, PREFILL_PROBE_BYTES)
    for rows, (native, transposed) in [(r, decode) for r in DECODE_ROWS] + [(PREFILL_ROWS, prefill)]:
        x = mx.random.normal((rows, in_features))
        mx.eval(x)
        best = {"native": float("inf"), "transposed": float("inf")}
        for r in range(repeats):
            for name in ("native", "transposed") if r % 2 == 0 else ("transposed", "native"):
                if name == "native":
                    best[name] = min(best[name], _pass_ms([x @ w.T for w in native]))
                else:
                    best[name] = min(best[name], _pass_ms([x @ w for w in transposed]))
        timing.native[str(rows)], timing.transposed[str(rows)] = best["native"], best["transposed"]
    return timing


def _probe_matrices(out_features: int, in_features: int, budget: int) -> tuple[list, list]:
    rows_per_matrix = min(out_features, max(1, budget // (4 * in_features)))
    count = min(PROBE_MAX_MATRICES, max(1, budget // (4 * in_features * rows_per_matrix)))
    native = [mx.random.normal((rows_per_matrix, in_features)) for _ in range(count)]
    transposed = [mx.contiguous(w.T) for w in native]
    mx.eval(native, transposed)
    return native, transposed


def _pass_ms(products: list[mx.array]) -> float:
    """The lazy products evaluated one at a time, as a step's layers run one after another."""
    start = time.perf_counter()
    for y in products:
        mx.eval(y)
    return (time.perf_counter() - start) * 1e3
