"""Attention at long context on MLX's CPU backend: cpu_attention.cpp, built on this machine and called
through ctypes.

MLX's CPU backend runs each step of an unfused attention as its own pass over the scores, with `exp` one
element at a time (~12 ns an element): at 16k tokens of context that is most of a prefill chunk's time and
most of a decode step's attention. The kernel computes a sequence's attention in one call per layer: the
products with the BLAS MLX itself calls (OpenBLAS's cblas_sgemm), the masked softmax with glibc's
vectorised expf on every core, the context read in place from the pools (kernels/paged_attention.py
documents the layout). It is built the way MLX builds its own CPU kernels: the system C++ compiler, once
per machine (-march=native), into the cache directory; where there is no compiler or no OpenBLAS it is not
loaded, and attention stays on the MLX-ops path (the reference the tests check it against).

Calling it evaluates the layer's graph up to its queries and K/V (the host reads their buffers), so it is
used only where the scores are many (MIN_SCORES): there the kernel's time saved is far more than the lost
overlap of graph building and computing.
"""

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from kernels import build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
MIN_SCORES = 1 << 15  # queries x heads x keys below which MLX's lazy graph is cheaper than a host round trip
BLOCK = 128  # query rows per causal block
FEW_ROWS = 64  # a KV head's query rows (its query heads x a block's queries) computed without BLAS

# minivllm_attention's parameters, in cpu_attention.cpp's order
ARGUMENTS = [
    *[ctypes.c_void_p] * 3,  # q, k_pool, v_pool
    ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # slots, H, Hkv, D
    ctypes.c_int64, ctypes.c_int64,  # n, start
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # run_slot, run_len, n_runs
    ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,  # window, sinks, scale
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p,  # block, few_rows, out
]  # fmt: skip
_library: ctypes.CDLL | None = None


def load(sgemm_library: str | None, build_dir: Path) -> bool:
    """Build (once per machine) and load the kernel, with cblas_sgemm from `sgemm_library` (the OpenBLAS
    MLX resolved its BLAS in). False, with the reason logged, where it cannot be built or loaded."""
    global _library
    if _library is not None:
        return True
    compiler = build.compiler()
    if sgemm_library is None or compiler is None:
        logger.warning("CPU attention kernel off: %s", "no OpenBLAS" if compiler else "no C++ compiler (g++)")
        return False
    try:
        path = build.build(SOURCE, compiler, build_dir)
        library = ctypes.CDLL(str(path))
        sgemm = ctypes.cast(ctypes.CDLL(sgemm_library).cblas_sgemm, ctypes.c_void_p).value
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        logger.warning("CPU attention kernel off: %s", getattr(e, "stderr", None) or e)
        return False
    library.minivllm_attention_init(ctypes.c_void_p(sgemm), ctypes.c_int(min(os.cpu_count() or 1, 8)))
    library.minivllm_attention.restype = None
    library.minivllm_attention.argtypes = ARGUMENTS
    _library = library
    return True


def loaded() -> bool:
    return _library is not None


def fits(queries: mx.array, keys: int) -> bool:
    """Whether attention of these queries [n, H, D] over `keys` context positions goes to the kernel."""
    n, heads, _ = queries.shape
    return _library is not None and queries.dtype == mx.float32 and n * heads * keys >= MIN_SCORES


def attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    start: int,
    runs: list[tuple[int, int]],
    scale: float,
    window: int | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Causal attention of one sequence's new tokens, queries [n, H, D] at positions start .. start + n -
    1, over its context in the pools [Hkv, slots, D] (float32) as runs of (first slot, slots), with a
    sink logit per head where sinks [H] are given. Returns [n, H * D]."""
    n, heads, head_dim = queries.shape
    heads_kv, slots, _ = k_pool.shape
    mx.eval(queries, k_pool, v_pool, *([] if sinks is None else [sinks]))
    q = np.ascontiguousarray(queries)
    sink = None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    k, v = np.ascontiguousarray(k_pool), np.ascontiguousarray(v_pool)  # the pools' own buffers, no copy
    run_slot = np.array([r[0] for r in runs], dtype=np.int64)
    run_len = np.array([r[1] for r in runs], dtype=np.int64)
    out = np.empty((n, heads * head_dim), dtype=np.float32)
    _library.minivllm_attention(
        q.ctypes.data, k.ctypes.data, v.ctypes.data, slots, heads, heads_kv, head_dim, n, start,
        run_slot.ctypes.data, run_len.ctypes.data, len(runs), window or 0,
        None if sink is None else sink.ctypes.data, scale, BLOCK, FEW_ROWS, out.ctypes.data,
    )  # fmt: skip
    return mx.array(out)
