"""Resolve a model reference and load weights and tokenizer through mlx-lm.

A reference is a local mlx-lm directory, a `.gguf` file (converted once into the cache), a Hugging Face
repo id (downloaded by mlx-lm's hub client), or None for the offline default model. On the CPU backend
weights are dequantized to float32 at load: MLX's CPU 4-bit kernels are unusable and float32 goes through
OpenBLAS. GPU backends keep 4-bit weights.
"""

import hashlib
import logging
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_map
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model

from minivllm.models.backend import Backend, detect_backend
from minivllm.models.qwen2 import check_supported

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("MINIVLLM_CACHE_DIR") or Path.home() / ".cache" / "minivllm")


def resolve_model(ref: str | None) -> str:
    """Return a local directory or a repo id mlx_lm.load accepts; raise for what cannot be a model."""
    if ref is None or ref == "default":
        from minivllm.models.default_model import default_model_dir

        return str(default_model_dir())
    path = Path(ref).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return str(_converted_gguf(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return str(path)
    looks_like_repo = ref.count("/") == 1 and not ref.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(
            f"model not found: {ref!r} is neither a directory, a .gguf file nor a repo id"
        )
    return ref


def _converted_gguf(path: Path) -> Path:
    from minivllm.models.default_model import file_lock, remove_stale_dirs
    from minivllm.models.gguf_import import conversion_temp_prefixes, convert_gguf

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{path.stem}-{key}"
    with file_lock(out.parent / f".{out.name}.lock"):  # one conversion at a time; leftovers are then stale
        remove_stale_dirs(out.parent, conversion_temp_prefixes(out))
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
    return out


def load_model(ref: str | None, backend: Backend | None = None) -> tuple[nn.Module, TokenizerWrapper, dict]:
    backend = backend or detect_backend()
    resolved = resolve_model(ref)
    try:
        model, tokenizer, config = mlx_lm.load(resolved, return_config=True)
    except Exception as e:  # mlx-lm raises assorted errors for hub failures and bad directories
        raise ValueError(f"cannot load model {ref!r} ({resolved}): {e}") from e
    check_supported(model)
    quantized = "quantization" in config or "quantization_config" in config
    if not backend.is_gpu:
        if quantized:
            model = dequantize_model(model)
        model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())
    dtype = activation_dtype(model)
    bits = f"4-bit ({dtype} activations)" if quantized and backend.is_gpu else str(dtype)
    logger.info("model %s: backend %s, weights %s, BLAS %s", resolved, backend.name, bits, backend.blas)
    config["_resolved_path"] = resolved
    config["_weights"] = bits
    return model, tokenizer, config


def load_tokenizer(ref: str | None) -> TokenizerWrapper:
    """The model's tokenizer alone, as `load_model` builds it (the Ray Serve ingress tokenizes, replicas
    hold the weights). A repo id fetches only its tokenizer and config files."""
    resolved = resolve_model(ref)
    try:
        path = Path(resolved)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(resolved, allow_patterns=["*.json", "*.jinja", "tokenizer.model"]))
        config = mlx_lm.utils.load_config(path)
        return mlx_lm.utils.load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # hub failures, bad directories
        raise ValueError(f"cannot load the tokenizer of {ref!r} ({resolved}): {e}") from e


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype hidden states (and so the KV pool) use: the norms' dtype, never quantized."""
    return model.model.norm.weight.dtype
