"""Pick the compute path before MLX is first imported.

On MLX's CPU backend the bundled reference BLAS runs float32 matmuls ~60x slower than OpenBLAS, and its
4-bit kernels are unusable. Loading OpenBLAS globally *before* `mlx.core` is imported makes MLX resolve its
BLAS symbols there. This module must therefore be imported before anything imports mlx (minivllm's
`__init__` does it first).
"""

import ctypes
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)


def _preload_openblas() -> str | None:
    if sys.platform == "darwin" or os.environ.get("MINIVLLM_NO_OPENBLAS"):
        return None  # macOS uses Accelerate; the opt-out is for comparisons
    if "mlx.core" in sys.modules:
        logger.warning("mlx.core was imported before minivllm; OpenBLAS cannot be preloaded")
        return None
    for path in [os.environ.get("MINIVLLM_OPENBLAS", "")] + list(OPENBLAS_CANDIDATES):
        if path and os.path.exists(path):
            ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            return path
    return None


OPENBLAS_PATH = _preload_openblas()

import mlx.core as mx  # noqa: E402  (must come after the preload)

from minivllm.models.fd_limit import import_mlx_lm_keeping_the_fd_limit  # noqa: E402

import_mlx_lm_keeping_the_fd_limit()  # before any other module imports mlx_lm


@dataclass(frozen=True)
class Backend:
    name: str  # "metal" | "cuda" | "cpu"
    blas: str

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"


def _cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


def detect_backend() -> Backend:
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return Backend("metal", "Metal")
        if _cuda_available():
            return Backend("cuda", "CUDA")
    if sys.platform == "darwin":
        return Backend("cpu", "Accelerate")
    return Backend(
        "cpu", f"OpenBLAS ({OPENBLAS_PATH})" if OPENBLAS_PATH else "MLX bundled reference BLAS (slow)"
    )


SLOW_BLAS_FIX = "sudo apt-get install libopenblas0-pthread"


def slow_blas_warning(backend: Backend) -> str | None:
    """What to tell the user when MLX's CPU matmuls run on its bundled reference BLAS (Linux without
    OpenBLAS): every answer comes ~60x slower, and the one command that fixes it."""
    if backend.name != "cpu" or sys.platform == "darwin" or OPENBLAS_PATH is not None:
        return None
    return (
        "slow: MLX's bundled reference BLAS runs matmuls ~60x slower than OpenBLAS. Fix: "
        f"`{SLOW_BLAS_FIX}` (Debian, Ubuntu; elsewhere install OpenBLAS and set MINIVLLM_OPENBLAS to its "
        "libopenblas.so.0), then restart the server"
    )


def processor_name() -> str:
    """The CPU's model name (what a measurement of the machine depends on, with its core count)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
