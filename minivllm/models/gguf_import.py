"""Import a Qwen2 / Llama-family GGUF file into an MLX model directory in mlx-lm layout.

By default each quantized tensor is transcoded: its GGUF blocks become MLX affine weights of the same
values (`gguf_transcode`), with bits and group size per module in config.json's `quantization`, the
mixed-precision form `mlx_lm.load` reads. `UniformQuantization` instead dequantizes every tensor and
re-quantizes it with `mx.quantize` at one width (smaller or simpler, but a second rounding). The
tokenizer is rebuilt from the GGUF metadata with `tokenizers`.
"""

import importlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, TokenType
from gguf.quants import dequantize
from mlx_lm.utils import save_config
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

from minivllm.models.gguf_transcode import FLOAT_TYPES, GROUP_SIZE, to_mlx, transcode

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("qwen2", "llama", "qwen3")
HF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, copied from the models' own tokenizer.json.
QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_PATTERNS = {"qwen2": QWEN2_PATTERN, "llama-bpe": LLAMA3_PATTERN, "llama3": LLAMA3_PATTERN}

# GGUF short names -> mlx-lm (Hugging Face) names; `blk.N.` prefixes are handled separately.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # qwen3's alone
# Worker threads for the transcode: numpy work in parallel, each holding a few float32 copies of a tensor.
TRANSCODE_THREADS = min(4, os.cpu_count() or 1)
# Quantized embeddings return rows in their scales' dtype: they keep float32 scales to stay exact.
EMBEDDINGS = {"model.embed_tokens.weight"}
# Tensors that carry no weights mlx-lm needs (llama.cpp precomputed rope factors).
SKIPPED_TENSORS = {"rope_freqs.weight"}


class GGUFError(ValueError):
    """The GGUF file cannot be imported (not GGUF, unsupported architecture, missing tensor, bad checksum)."""


@dataclass(slots=True)
class GGUFModelInfo:
    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    head_dim: int


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise GGUFError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _f32(value: float) -> float:
    """GGUF stores float32: 1e-6 reads back as 9.99999997e-07; keep the 7 digits float32 really holds."""
    return float(f"{value:.7g}")


def open_gguf(path: str | Path) -> GGUFReader:
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError) as e:
        raise GGUFError(f"{path}: cannot parse GGUF: {e}") from e


def read_model_info(reader: GGUFReader) -> GGUFModelInfo:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    return GGUFModelInfo(
        arch=arch,
        num_layers=int(_field(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(_field(reader, f"{arch}.context_length", 4096)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
    )


def hf_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its mlx-lm name; None when it is not one we know."""
    stem, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    names = BLOCK_NAMES | QK_NORM_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{suffix}"
    return None


def block_names(arch: str) -> dict[str, str]:
    """The per-block tensors of an architecture: Qwen3 adds per-head RMSNorms of queries and keys."""
    return BLOCK_NAMES | QK_NORM_NAMES if arch == "qwen3" else BLOCK_NAMES


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF rotate-half order -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_permute`: back to the HF layout that mlx-lm's (non-traditional) RoPE expects."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_tensors(info: GGUFModelInfo) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(info.num_layers):
        names += [f"blk.{i}.{short}.weight" for short in block_names(info.arch)]
    return names


def check_tensors(reader: GGUFReader, info: GGUFModelInfo) -> None:
    present = {t.name for t in reader.tensors}
    missing = [n for n in expected_tensors(info) if n not in present]
    if missing:
        raise GGUFError(f"GGUF is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    foreign = [f".{short}." for short in QK_NORM_NAMES if short not in block_names(info.arch)]
    unknown = [n for n in present - SKIPPED_TENSORS if hf_name(n) is None or any(f in n for f in foreign)]
    if unknown:
        raise GGUFError(f"unexpected tensor(s) for architecture {info.arch}: {unknown[:3]}")


@dataclass(frozen=True)
class UniformQuantization:
    """Re-quantize every matrix to one affine width (`minivllm convert --bits`), instead of transcoding."""

    bits: int = 4
    group_size: int = 64
    scale_dtype: str = "float16"  # of the scales and biases: "float16" (mlx-lm's usual) or "float32"

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 8) or self.group_size not in (32, 64, 128):
            raise GGUFError(f"MLX affine quantization has no {self.bits}-bit, group {self.group_size} format")
        if self.scale_dtype not in ("float16", "float32"):
            raise GGUFError(f"scale dtype must be float16 or float32, got {self.scale_dtype!r}")


@dataclass(slots=True)
class TensorRecord:
    """What became of one GGUF tensor (kept in the model directory as transcode_report.json)."""

    name: str
    gguf_type: str
    mlx: str  # "float32", "float16" or "5-bit g32"
    scale_dtype: str | None = None
    max_error: float = 0.0  # against the GGUF's dequantization; 0.0 is exact


def iter_tensors(
    reader: GGUFReader, info: GGUFModelInfo
) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray, tuple[int, ...]]]:
    """Yield (mlx-lm name, GGUF type, data, row-major shape) per tensor, rows in HF order; one at a time.

    Quantized matrices come as raw blocks (rows, bytes per row); anything else as float values.
    """
    check_tensors(reader, info)
    for t in reader.tensors:
        if t.name in SKIPPED_TENSORS:
            logger.warning("skipping %s (llama.cpp rope factors; rope scaling is not imported)", t.name)
            continue
        # GGUF dims are innermost-first; F32/F16 data may come flat, so reshape to the reversed dims.
        shape = tuple(reversed([int(d) for d in t.shape]))
        qtype = GGMLQuantizationType(t.tensor_type)
        data = t.data
        if qtype in FLOAT_TYPES or len(shape) != 2:
            data, qtype = float_values(data, qtype).reshape(shape), _float_type(qtype)
        heads = _permuted_heads(info, t.name)
        if heads:  # a row permutation: the same on float rows and on rows of quantized blocks
            data = llama_unpermute(data, heads)
        yield hf_name(t.name), qtype, data, shape


def float_values(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """F32 and F16 as stored; anything else dequantized to float32."""
    if qtype == GGMLQuantizationType.F16:
        return np.asarray(data).view(np.float16)
    return np.asarray(dequantize(data, qtype), dtype=np.float32)


def _float_type(qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    return GGMLQuantizationType.F16 if qtype == GGMLQuantizationType.F16 else GGMLQuantizationType.F32


def _permuted_heads(info: GGUFModelInfo, gguf_name: str) -> int:
    """llama.cpp permutes llama's Q/K rows; the head count to undo it with, 0 for other tensors."""
    if info.arch != "llama":
        return 0
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return info.num_heads
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return info.num_kv_heads
    return 0


def iter_float_weights(reader: GGUFReader, info: GGUFModelInfo) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (mlx-lm name, float32 array) per tensor: the GGUF's own dequantization, rows in HF order."""
    progress = tqdm(iter_tensors(reader, info), "dequantize GGUF", len(reader.tensors), unit="tensor")
    for name, qtype, data, shape in progress:
        yield name, float_values(data, qtype).reshape(shape).astype(np.float32, copy=False)


def transcoded_weights(
    reader: GGUFReader, info: GGUFModelInfo
) -> tuple[dict[str, mx.array], dict[str, dict], list[TensorRecord]]:
    """Every tensor carried over: quantized matrices transcoded (and verified), floats kept as stored.

    Tensors are transcoded on a few threads (numpy releases the GIL); MLX arrays are made on this one.
    """
    weights: dict[str, mx.array] = {}
    per_module: dict[str, dict] = {}
    records: list[TensorRecord] = []

    def work(item):
        name, qtype, data, shape = item
        if qtype in FLOAT_TYPES:
            return item, None
        return item, transcode(name, data, qtype, shape, float32_scales=name in EMBEDDINGS)

    with ThreadPoolExecutor(TRANSCODE_THREADS) as pool:
        done = pool.map(work, iter_tensors(reader, info))
        for (name, qtype, data, _), t in tqdm(done, "transcode GGUF", len(reader.tensors), unit="tensor"):
            if t is None:
                weights[name] = mx.array(data)
                records.append(TensorRecord(name, qtype.name, data.dtype.name))
                continue
            weights |= to_mlx(name, t)
            per_module[name.removesuffix(".weight")] = {"group_size": GROUP_SIZE, "bits": t.bits}
            mlx = f"{t.bits}-bit g{GROUP_SIZE}"
            records.append(TensorRecord(name, qtype.name, mlx, t.scale_dtype, t.max_error))
    log_records(records)
    return weights, per_module, records


def log_records(records: list[TensorRecord]) -> None:
    """One line per (GGUF type -> MLX format): how many tensors, and the worst error if any."""
    by_kind: dict[tuple, list[TensorRecord]] = {}
    for r in records:
        by_kind.setdefault((r.gguf_type, r.mlx, r.scale_dtype), []).append(r)
    for (gguf_type, mlx, scale_dtype), group in sorted(by_kind.items(), key=str):
        kind = f"{gguf_type} -> {mlx}" + (f", {scale_dtype} scales" if scale_dtype else "")
        worst = max(r.max_error for r in group)
        if worst:
            logger.warning("%s: %d tensors, not exact: max error %.3g", kind, len(group), worst)
        else:
            logger.info("%s: %d tensors, exact", kind, len(group))


def mixed_quantization(per_module: dict[str, dict]) -> dict:
    """config.json's `quantization` for per-module widths, as mlx-lm reads it: every quantized module has
    its own entry; the top-level pair (the most common width) only fills the keys mlx-lm requires."""
    common = Counter(m["bits"] for m in per_module.values()).most_common(1)
    return {"group_size": GROUP_SIZE, "bits": common[0][0] if common else 8, **per_module}


def requantized_weights(
    reader: GGUFReader, info: GGUFModelInfo, uniform: UniformQuantization
) -> dict[str, mx.array]:
    """Every matrix dequantized and re-quantized at one width; norms and biases float32."""
    weights: dict[str, mx.array] = {}
    for name, w in iter_float_weights(reader, info):
        weights |= quantize_weight(name, w, uniform)
    return weights


def quantize_weight(name: str, w: np.ndarray, uniform: UniformQuantization) -> dict[str, mx.array]:
    """Quantize a 2-D matrix (Linear or embedding) like mlx_lm's quantize_model; norms and biases stay float."""
    if w.ndim != 2:
        return {name: mx.array(w)}
    if w.shape[-1] % uniform.group_size:
        logger.warning(
            "%s: last dim %d not a multiple of %d, kept float", name, w.shape[-1], uniform.group_size
        )
        return {name: mx.array(w)}
    stem = name.removesuffix(".weight")
    wq, scales, biases = mx.quantize(mx.array(w), group_size=uniform.group_size, bits=uniform.bits)
    dtype = getattr(mx, uniform.scale_dtype)
    out = {
        f"{stem}.weight": wq,
        f"{stem}.scales": scales.astype(dtype),
        f"{stem}.biases": biases.astype(dtype),
    }
    mx.eval(out)  # now, so the float32 matrix can be freed before the next one is dequantized
    return out


def build_config(
    reader: GGUFReader, info: GGUFModelInfo, vocab_size: int, tied: bool, quantization: dict | None
) -> dict:
    config = {
        "model_type": info.arch,
        "architectures": [HF_ARCHITECTURES[info.arch]],
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_layers,
        "intermediate_size": info.intermediate_size,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "rms_norm_eps": info.rms_norm_eps,
        "vocab_size": vocab_size,
        "max_position_embeddings": info.context_length,
        "rope_theta": info.rope_theta,
        "tie_word_embeddings": tied,
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
    }
    if quantization:
        config["quantization"] = quantization
    if config["bos_token_id"] < 0:
        config["bos_token_id"] = None
    if info.head_dim != info.hidden_size // info.num_heads or info.arch == "qwen3":  # qwen3's args need it
        config["head_dim"] = info.head_dim
    return config


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """Byte-level BPE from tokenizer.ggml.{tokens,merges,token_type}; control tokens become special added tokens."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(
            f"unsupported GGUF tokenizer model {model!r}; only byte-level BPE ('gpt2') is imported"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_PATTERNS:
        logger.warning("unknown tokenizer.ggml.pre %r: using the Qwen2 split pattern", pre)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF tokenizer has duplicate token strings")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_PATTERNS.get(pre, QWEN2_PATTERN)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|> ...) are special; user-defined ones (<tool_call> ...) are added but
    # not special, as in the original tokenizer.json. Both must match whole before BPE splits them.
    added = [
        AddedToken(tokens[i], special=(t == TokenType.CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (TokenType.CONTROL, TokenType.USER_DEFINED)
    ]
    tok.add_tokens(added)
    return tok


def build_tokenizer_config(reader: GGUFReader) -> dict:
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        idx = _field(reader, key, -1)
        return tokens[idx] if 0 <= idx < len(tokens) else None

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "bos_token": token("tokenizer.ggml.bos_token_id") if add_bos else None,
        "add_bos_token": add_bos,
        "chat_template": _field(reader, "tokenizer.chat_template", ""),
        "model_max_length": int(
            _field(reader, f"{_field(reader, 'general.architecture')}.context_length", 4096)
        ),
        "clean_up_tokenization_spaces": False,
    }


def write_model_dir(reader: GGUFReader, tmp: Path, uniform: UniformQuantization | None) -> None:
    info = read_model_info(reader)
    logger.info("GGUF %s: %d layers, hidden %d", info.arch, info.num_layers, info.hidden_size)
    tok = build_tokenizer(reader)  # before the slow part, so tokenizer errors surface quickly
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(build_tokenizer_config(reader), indent=2))
    if uniform is None:
        logger.info("transcoding the GGUF's quantized blocks to MLX affine weights (exact where possible)")
        weights, per_module, records = transcoded_weights(reader, info)
        quantization = mixed_quantization(per_module)
        report = {"mode": "transcode", "tensors": [asdict(r) for r in records]}
        (tmp / "transcode_report.json").write_text(json.dumps(report, indent=1))
    else:
        logger.info(
            "dequantizing, then quantizing to %d-bit affine, group %d, %s scales",
            uniform.bits,
            uniform.group_size,
            uniform.scale_dtype,
        )
        weights = requantized_weights(reader, info, uniform)
        quantization = {"group_size": uniform.group_size, "bits": uniform.bits}
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    tied = "lm_head.weight" not in weights
    vocab_size = weights["model.embed_tokens.weight"].shape[0]  # rows survive quantization (packed columns)
    save_config(build_config(reader, info, vocab_size, tied, quantization), tmp / "config.json")


def load_float_model(gguf_path: str | Path) -> tuple[nn.Module, Tokenizer]:
    """The GGUF as an mlx-lm float32 model, every tensor through gguf's own dequantization, and its tokenizer.

    The reference a conversion's quality is measured against (benchmarks/quality.py).
    """
    reader = open_gguf(gguf_path)
    info = read_model_info(reader)
    weights = {name: mx.array(w) for name, w in iter_float_weights(reader, info)}
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    config = build_config(reader, info, vocab_size, "lm_head.weight" not in weights, None)
    arch = importlib.import_module(f"mlx_lm.models.{info.arch}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model, build_tokenizer(reader)


def conversion_temp_prefixes(out_dir: Path) -> tuple[str, str]:
    """Name prefixes of the sibling directories convert_gguf(..., out_dir) works in: a kill at the wrong
    moment leaves them behind (see default_model.remove_stale_dirs)."""
    return f".{out_dir.name}.tmp-", f".{out_dir.name}.old-"


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, *, uniform: UniformQuantization | None = None
) -> Path:
    """Convert a qwen2/qwen3/llama GGUF into an mlx-lm model directory at `out_dir` (replaced atomically).

    Without `uniform` the GGUF's quantization is carried over (transcoded); with it, every matrix is
    re-quantized at that width.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(gguf_path)
    tmp_prefix, old_prefix = conversion_temp_prefixes(out_dir)
    # Build in a sibling temp dir and rename it into place: a crash never leaves a half directory.
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=out_dir.parent))
    try:
        write_model_dir(reader, tmp, uniform)
        tmp.chmod(0o755)  # mkdtemp makes it private; the model directory is meant to be shared
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=old_prefix, dir=out_dir.parent))
            os.replace(out_dir, old / "dir")
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s", out_dir)
    return out_dir
