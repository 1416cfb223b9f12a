"""The model's identity for KV that outlives the process: a digest of what decides a token's K and V.

The disk tier stamps every page file with it, and serves a page only to an engine whose digest is equal.
It covers config.json and every weights file, by content (xxh3-128: about 0.3 s for the default model's
570 MB when they are in the page cache, as they are right after loading), plus how the engine runs
them (backend, dtype, quantization), since the same weights give other KV on another backend or dtype.
"""

from pathlib import Path

import xxhash

CHUNK = 16 << 20


def model_digest(resolved: str, runtime: str) -> bytes:
    """16 bytes. resolved: the loaded directory or repo id (config["_resolved_path"]); runtime: how the
    engine runs the weights (e.g. "cpu float32")."""
    directory = _local_dir(resolved)
    hasher = xxhash.xxh3_128()
    hasher.update(runtime.encode() + b"\x00")
    files = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
    for path in files:
        hasher.update(path.name.encode() + b"\x00" + path.stat().st_size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                hasher.update(chunk)
    return hasher.digest()


def _local_dir(resolved: str) -> Path:
    """The directory mlx-lm loaded: resolved itself, or a repo id's snapshot in the Hugging Face cache."""
    path = Path(resolved)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(resolved, local_files_only=True))
