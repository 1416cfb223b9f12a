"""Decode-sized products with quantized weights on MLX's CPU backend: cpu_quantized_matmul.cpp, built on
this machine (kernels/build.py) and called through ctypes.

A decode step reads every weight matrix once for a few rows, so it runs at the speed of the weights'
bytes. The CPU backend holds float32 copies of quantized weights (MLX's CPU quantized kernels are slower
still); reading the levels instead, one byte a weight, is a quarter of the bytes. A layer that holds them
(minivllm.models.quantized_linear) sends products of at most MAX_ROWS rows here and larger ones (prefill
chunks, where the float32 product is compute-bound and fast) to its float32 copy.

Calling it evaluates the layer's input (the host reads its buffer), so the step's graph is evaluated
layer by layer: at decode sizes that costs far less than the bytes it saves.
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

SOURCE = Path(__file__).with_name("cpu_quantized_matmul.cpp")
# above this many rows the float32 product is as fast: the default model's decode at 1k tokens of context
# with the kernel was 1.54x the float32 product's at batch 1, 1.55x at 2, 1.17x at 4 and 0.91x at 8 (the
# kernel is compute-bound from a few rows on, the float32 product bandwidth-bound;
# benchmarks/results/long_context-b1-b2-b4-b8-rows.md)
MAX_ROWS = 4
GROUP_SIZES = (32, 64, 128)  # the kernel's loops
# minivllm_quantized_matmul's parameters, in cpu_quantized_matmul.cpp's order
ARGUMENTS = [
    ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,  # x, m, K
    *[ctypes.c_void_p] * 3, ctypes.c_int, ctypes.c_int,  # levels, scales, biases, half_scales, group
    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # N, bias, y
]  # fmt: skip
_library: ctypes.CDLL | None = None


def load(build_dir: Path) -> bool:
    """Build (once per machine) and load the kernel. False, with the reason logged, where it cannot be
    built or loaded."""
    global _library
    if _library is not None:
        return True
    compiler = build.compiler()
    if compiler is None:
        logger.warning("CPU quantized matmul kernel off: no C++ compiler (g++)")
        return False
    try:
        library = ctypes.CDLL(str(build.build(SOURCE, compiler, build_dir)))
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("CPU quantized matmul kernel off: %s", getattr(e, "stderr", None) or e)
        return False
    library.minivllm_quantized_matmul_init(ctypes.c_int(min(os.cpu_count() or 1, 8)))
    library.minivllm_quantized_matmul.restype = ctypes.c_int
    library.minivllm_quantized_matmul.argtypes = ARGUMENTS
    _library = library
    return True


def loaded() -> bool:
    return _library is not None


def fits(x: mx.array) -> bool:
    """Whether the product of x [..., K] goes to the kernel: few rows, float32, the kernel loaded."""
    return _library is not None and x.dtype == mx.float32 and x.size // x.shape[-1] <= MAX_ROWS


def matmul(
    x: mx.array, levels: np.ndarray, scales: np.ndarray, biases: np.ndarray, bias: np.ndarray | None
) -> mx.array:
    """x [..., K] @ (levels * scales + biases).T (+ bias): levels uint8 [N, K], scales and biases float16
    or float32 [N, K / group], bias float32 [N]. Returns [..., N] float32."""
    n_out, k = levels.shape
    group = k // scales.shape[1]
    mx.eval(x)
    rows = np.ascontiguousarray(x).reshape(-1, k)  # the array's own buffer where it is contiguous
    y = np.empty((rows.shape[0], n_out), dtype=np.float32)
    failed = _library.minivllm_quantized_matmul(
        rows.ctypes.data, rows.shape[0], k, levels.ctypes.data, scales.ctypes.data, biases.ctypes.data,
        int(scales.dtype == np.float16), group, n_out, None if bias is None else bias.ctypes.data, y.ctypes.data,
    )  # fmt: skip
    if failed:
        raise ValueError(f"no quantized matmul kernel for group size {group}")
    return mx.array(y).reshape(*x.shape[:-1], n_out)
