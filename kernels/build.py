"""Building a C++ kernel for MLX's CPU backend on this machine: the system compiler, once per source,
compiler, flags and processor (-march=native), into the cache directory, as MLX builds its own CPU
kernels. kernels/cpu_attention.py and kernels/cpu_quantized_matmul.py load the result through ctypes."""

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# -ffast-math defines __FAST_MATH__, under which glibc's math.h declares the vectorised expf (libmvec)
# that `omp simd` loops call; the kernels' inputs are finite (hidden keys are never exponentiated)
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC", "-shared", "-std=c++17"]


def compiler() -> str | None:
    """The C++ compiler ($CXX, else g++), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def build(source: Path, compiler: str, build_dir: Path) -> Path:
    """The shared library for this source, compiler, flags and processor, compiled if not there yet (into
    a temporary name first: concurrent builds never load a half-written file). Raises
    subprocess.CalledProcessError (with the compiler's stderr) or OSError."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = "\n".join([source.read_text(), version, " ".join(FLAGS), _processor()])
    path = build_dir / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if path.is_file():
        return path
    build_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=build_dir) as tmp:
        out = Path(tmp) / path.name
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(out)], check=True, capture_output=True, text=True
        )
        os.replace(out, path)
    logger.info("built %s: %s", source.name, path)
    return path


def _processor() -> str:
    """What -march=native compiled for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({x for x in lines if x.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()
