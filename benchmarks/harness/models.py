"""The model a benchmark runs: where it is, how it is stored, a float32 copy for the peer server."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


def is_cpu_backend() -> bool:
    from minivllm.models.backend import detect_backend

    return not detect_backend().is_gpu


def resolve_model(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    from minivllm.models.default_model import (
        default_model_dir,  # written elsewhere; only needed without --model
    )

    return Path(default_model_dir())


def _config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def is_quantized(model_dir: Path) -> bool:
    cfg = _config(model_dir)
    return "quantization" in cfg or "quantization_config" in cfg


def _safetensors_header(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape, data_offsets}, from the JSON headers only (microseconds for 2 GB)."""
    tensors: dict[str, dict[str, Any]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        tensors.update((name, info) for name, info in header.items() if name != "__metadata__")
    return tensors


def _safetensors_dtypes(model_dir: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for info in _safetensors_header(model_dir).values():
        counts[info["dtype"]] = counts.get(info["dtype"], 0) + 1
    return counts


def tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of each stored tensor (packed weights, scales and biases count separately)."""
    return {
        name: end - start
        for name, (start, end) in ((n, i["data_offsets"]) for n, i in _safetensors_header(model_dir).items())
    }


def model_dtype(model_dir: Path) -> str:
    from minivllm.models.loader import describe_quantization

    quantization = describe_quantization(_config(model_dir))
    dtypes = "+".join(sorted(_safetensors_dtypes(model_dir))) or "?"
    return f"{quantization}, tensors {dtypes}" if quantization else dtypes


def float32_copy(model_dir: Path) -> Path:
    """A dequantized float32 copy of model_dir, written once as `<dir>-float32` and reused."""
    from mlx_lm.utils import load_model, save_config, save_model

    from minivllm.models.loader import dequantize_to_float32

    model_dir = Path(model_dir).resolve()
    dst = model_dir.with_name(model_dir.name + "-float32")
    if (dst / "config.json").exists():
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model, config = load_model(model_dir)
    model = dequantize_to_float32(model)
    save_model(tmp, model)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config["torch_dtype"] = "float32"
    save_config(config, tmp / "config.json")
    for f in model_dir.iterdir():  # tokenizer, chat template, generation config
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)  # atomic: a half-written copy is never mistaken for a finished one
    return dst


def kv_dtype_bytes() -> int:
    """Bytes per KV element minivllm stores: float32 on the CPU backend, 16-bit on GPUs."""
    return 4 if is_cpu_backend() else 2


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    cfg = _config(model_dir)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes
