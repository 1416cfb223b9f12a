"""Resolve a model reference and load weights and tokenizer through mlx-lm.

A reference is a local mlx-lm directory, a `.gguf` file (converted once into the cache), a Hugging Face
repo id (downloaded by mlx-lm's hub client), or None for the offline default model. On the CPU backend
quantized weights are dequantized to float32 at load: MLX's CPU quantized kernels are unusable and float32
goes through OpenBLAS; the float32 matrices are then kept in the layout OpenBLAS reads fastest
(minivllm.models.cpu_layout), and a quantized Linear also keeps its levels for decode-sized products
(minivllm.models.quantized_linear). GPU backends keep the quantized weights.
"""

import hashlib
import logging
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from kernels import cpu_quantized_matmul
from minivllm.models.backend import Backend, detect_backend
from minivllm.models.cpu_layout import apply_layout
from minivllm.models.families import check_supported
from minivllm.models.gguf_transcode import narrowest_float, unpack_levels
from minivllm.models.quantized_linear import DecodeQuantizedLinear
from minivllm.models.tokenizer import Tokenizer

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


# Part of the cache key of converted .gguf files: bump it when the conversion's output changes.
GGUF_CONVERSION = "transcode-v1"


def _converted_gguf(path: Path) -> Path:
    from minivllm.models.default_model import file_lock, remove_stale_dirs
    from minivllm.models.gguf_import import conversion_temp_prefixes, convert_gguf

    stat = path.stat()
    source = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_CONVERSION}"
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{path.stem}-{key}"
    with file_lock(out.parent / f".{out.name}.lock"):  # one conversion at a time; leftovers are then stale
        remove_stale_dirs(out.parent, conversion_temp_prefixes(out))
        if not (out / "config.json").is_file():
            convert_gguf(path, out)
    return out


def load_model(
    ref: str | None, backend: Backend | None = None, cpu_weight_layout: str = "auto", cpu_matmul: str = "mlx"
) -> tuple[nn.Module, Tokenizer, dict]:
    """cpu_weight_layout: on the CPU backend, the float32 matrices' layout (cpu_layout.LAYOUTS).
    cpu_matmul: on the CPU backend, "compiled" keeps quantized Linear layers' levels beside their float32
    copy for decode-sized products in kernels/cpu_quantized_matmul.cpp (where it builds), "mlx" only the
    float32 copy."""
    backend = backend or detect_backend()
    resolved = resolve_model(ref)
    try:
        model, tokenizer, config = mlx_lm.load(resolved, return_config=True)
    except Exception as e:  # mlx-lm raises assorted errors for hub failures and bad directories
        raise ValueError(f"cannot load model {ref!r} ({resolved}): {e}") from e
    if config.get("model_type") == "gemma4":  # Gemma 4's multimodal checkpoints: their text model runs alone
        model = model.language_model
    check_supported(config, model)
    config = {**(config.get("text_config") or {}), **config}  # Qwen3.5's text options (vocab, context)
    quantization = describe_quantization(config)
    layouts = {}
    if not backend.is_gpu:
        keep_levels = cpu_matmul == "compiled" and cpu_quantized_matmul.load(cache_dir() / "kernels")
        model = dequantize_to_float32(model, keep_levels)
        layouts = apply_layout(model, cpu_weight_layout, cache_dir() / "cpu_weight_layout.json", backend.blas)
    mx.eval(module_arrays(model))
    dtype = activation_dtype(model)
    weights = f"{quantization} ({dtype} activations)" if quantization and backend.is_gpu else str(dtype)
    logger.info("model %s: backend %s, weights %s, BLAS %s", resolved, backend.name, weights, backend.blas)
    if layouts:
        logger.info("weight matrices (out x in) by layout: %s", layouts)
    config["_resolved_path"] = resolved
    config["_weight_layouts"] = layouts
    config["_weights"] = weights
    return model, Tokenizer(tokenizer), config


def load_tokenizer(ref: str | None) -> Tokenizer:
    """The model's tokenizer alone, as `load_model` builds it (the Ray Serve ingress tokenizes, replicas
    hold the weights). A repo id fetches only its tokenizer and config files."""
    resolved = resolve_model(ref)
    try:
        path = Path(resolved)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(resolved, allow_patterns=["*.json", "*.jinja", "tokenizer.model"]))
        config = mlx_lm.utils.load_config(path)
        return Tokenizer(mlx_lm.utils.load_tokenizer(path, eos_token_ids=config.get("eos_token_id")))
    except Exception as e:  # hub failures, bad directories
        raise ValueError(f"cannot load the tokenizer of {ref!r} ({resolved}): {e}") from e


def describe_quantization(config: dict) -> str:
    """ "4-bit g64", "mixed 4/5/8-bit g32" (per-module widths), or "" for a float model."""
    q = config.get("quantization") or config.get("quantization_config")
    if not q:
        return ""
    modules = [v for v in q.values() if isinstance(v, dict)] or [q]
    bits = "/".join(str(b) for b in sorted({m.get("bits") for m in modules}, key=str))
    groups = "/".join(str(g) for g in sorted({m.get("group_size") for m in modules}, key=str))
    return f"{'mixed ' if '/' in bits else ''}{bits}-bit g{groups}"


def dequantize_to_float32(model: nn.Module, keep_levels: bool = False) -> nn.Module:
    """Quantized layers become float32 Linear / Embedding layers; every other parameter becomes float32.
    keep_levels: an affine QuantizedLinear the decode kernel takes becomes a DecodeQuantizedLinear, its
    float32 Linear and its levels.

    The product scale * q + bias is formed in float32 whatever the scales' dtype (float16 scales would
    otherwise round each weight to float16), so transcoded GGUF weights keep their exact values. Affine
    levels are unpacked with numpy (MLX's CPU kernel is several times slower at 5 bits); other formats
    (mxfp4, ...) go through mx.dequantize.
    """
    floating = (mx.float16, mx.bfloat16, mx.float32)
    model.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype in floating else p, model.parameters()))
    replaced = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weight = _float_weight(module)
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                layer.bias = module.bias
            layer.weight = weight
            if keep_levels and _kernel_takes(module):
                layer = DecodeQuantizedLinear(layer, *_levels(module))
        elif isinstance(module, nn.QuantizedEmbedding):
            weight = _float_weight(module)
            layer = nn.Embedding(*weight.shape)
            layer.weight = weight
        else:
            continue
        replaced.append((name, layer))
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    return model


def _float_weight(module: nn.Module) -> mx.array:
    if module.mode == "affine":  # numpy unpacks the levels; MLX forms scale * q + bias, as mx.dequantize does
        levels = mx.array(unpack_levels(np.array(module.weight), module.bits))
        rows, cols = levels.shape
        groups = levels.reshape(rows, -1, module.group_size).astype(mx.float32)
        weight = (groups * module.scales[..., None] + module.biases[..., None]).reshape(rows, cols)
    else:
        biases = module.get("biases")
        weight = mx.dequantize(
            module.weight, module.scales, biases, module.group_size, module.bits, module.mode
        )
    mx.eval(weight)  # one matrix at a time: the temporaries stay one matrix big
    return weight


def _kernel_takes(module: nn.QuantizedLinear) -> bool:
    return (
        module.mode == "affine" and module.bits <= 8 and module.group_size in cpu_quantized_matmul.GROUP_SIZES
    )


def _levels(module: nn.QuantizedLinear) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The layer's levels, one byte each, and its scales and biases: float16 where that holds them exactly
    (as checkpoints store them; they are float32 here by now), else float32."""
    scales, biases = np.array(module.scales, np.float32), np.array(module.biases, np.float32)
    dtype = narrowest_float(scales, biases)
    levels = np.ascontiguousarray(unpack_levels(np.array(module.weight), module.bits))
    return levels, scales.astype(dtype), biases.astype(dtype)


def module_arrays(model: nn.Module) -> list[mx.array]:
    """Every array the model's modules hold: the parameters and the rest, which model.parameters() leaves
    out (members named with a leading underscore, such as Llama3RoPE's `_freqs`, and tuples).

    They are evaluated at load because an unevaluated array is bound to the stream of the thread that
    built it: MLX streams belong to a thread, and a graph reaching another thread's stream fails to
    evaluate ("There is no Stream(cpu, 0) in current thread"). The engine steps on a thread of its own.
    """
    everything = model.filter_and_map(lambda module, key, value: True)
    return [x for _, x in tree_flatten(everything) if isinstance(x, mx.array)]


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype hidden states (and so the KV pool) use: the norms' dtype, never quantized."""
    return model.model.norm.weight.dtype
