"""Import a Qwen2 / Llama-family GGUF file into an MLX model directory in mlx-lm layout.

GGUF tensors are dequantized to float32 with the `gguf` package, then re-quantized to MLX's affine
format with `mx.quantize`, so `mlx_lm.load` (and our own loader) reads the result like any
mlx-community 4-bit model. The tokenizer is rebuilt from the GGUF metadata with `tokenizers`.
"""

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType, TokenType
from gguf.quants import dequantize
from mlx_lm.utils import save_config
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("qwen2", "llama")

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
    if m and m.group(2) in BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{suffix}"
    return None


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (HF rotate-half order -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `llama_permute`: back to the HF layout that mlx-lm's (non-traditional) RoPE expects."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def expected_tensors(info: GGUFModelInfo) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    for i in range(info.num_layers):
        names += [f"blk.{i}.{short}.weight" for short in BLOCK_NAMES]
    return names


def check_tensors(reader: GGUFReader, info: GGUFModelInfo) -> None:
    present = {t.name for t in reader.tensors}
    missing = [n for n in expected_tensors(info) if n not in present]
    if missing:
        raise GGUFError(f"GGUF is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    unknown = [n for n in present - SKIPPED_TENSORS if hf_name(n) is None]
    if unknown:
        raise GGUFError(f"unexpected tensor(s) for architecture {info.arch}: {unknown[:3]}")


def iter_float_weights(reader: GGUFReader, info: GGUFModelInfo) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (mlx-lm name, float32 array) per tensor, fixing llama's Q/K permutation; one tensor at a time."""
    check_tensors(reader, info)
    for t in tqdm(reader.tensors, desc="dequantize GGUF", unit="tensor"):
        if t.name in SKIPPED_TENSORS:
            logger.warning("skipping %s (llama.cpp rope factors; rope scaling is not imported)", t.name)
            continue
        # GGUF dims are innermost-first; the reader's data already has the row-major shape for
        # quantized types, but F32/F16 may come flat, so reshape to the reversed dims explicitly.
        shape = tuple(reversed([int(d) for d in t.shape]))
        w = np.asarray(dequantize(t.data, GGMLQuantizationType(t.tensor_type)), dtype=np.float32)
        w = w.reshape(shape)
        if info.arch == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            w = llama_unpermute(w, info.num_heads)
        elif info.arch == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            w = llama_unpermute(w, info.num_kv_heads)
        yield hf_name(t.name), w


def quantize_weight(name: str, w: np.ndarray, bits: int, group_size: int) -> dict[str, mx.array]:
    """Quantize a 2-D matrix (Linear or embedding) like mlx_lm's quantize_model; norms and biases stay float."""
    if w.ndim != 2:
        return {name: mx.array(w)}
    if w.shape[-1] % group_size:
        logger.warning("%s: last dim %d not a multiple of %d, kept float", name, w.shape[-1], group_size)
        return {name: mx.array(w)}
    stem = name.removesuffix(".weight")
    wq, scales, biases = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    out = {f"{stem}.weight": wq, f"{stem}.scales": scales, f"{stem}.biases": biases}
    mx.eval(out)  # now, so the float32 matrix can be freed before the next one is dequantized
    return out


def build_config(
    reader: GGUFReader, info: GGUFModelInfo, vocab_size: int, tied: bool, bits: int, group_size: int
) -> dict:
    config = {
        "model_type": info.arch,
        "architectures": ["Qwen2ForCausalLM" if info.arch == "qwen2" else "LlamaForCausalLM"],
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
        "quantization": {"group_size": group_size, "bits": bits},
    }
    if config["bos_token_id"] < 0:
        config["bos_token_id"] = None
    if info.head_dim != info.hidden_size // info.num_heads:
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


def write_model_dir(reader: GGUFReader, tmp: Path, bits: int, group_size: int) -> None:
    info = read_model_info(reader)
    logger.info("GGUF %s: %d layers, hidden %d", info.arch, info.num_layers, info.hidden_size)
    tok = build_tokenizer(reader)  # before the slow part, so tokenizer errors surface quickly
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(build_tokenizer_config(reader), indent=2))
    logger.info("dequantizing, then quantizing to %d-bit affine, group %d", bits, group_size)
    weights: dict[str, mx.array] = {}
    for name, w in iter_float_weights(reader, info):
        weights |= quantize_weight(name, w, bits, group_size)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    tied = "lm_head.weight" not in weights
    vocab_size = weights["model.embed_tokens.weight"].shape[0]  # rows survive quantization (packed columns)
    save_config(build_config(reader, info, vocab_size, tied, bits, group_size), tmp / "config.json")


def conversion_temp_prefixes(out_dir: Path) -> tuple[str, str]:
    """Name prefixes of the sibling directories convert_gguf(..., out_dir) works in: a kill at the wrong
    moment leaves them behind (see default_model.remove_stale_dirs)."""
    return f".{out_dir.name}.tmp-", f".{out_dir.name}.old-"


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, bits: int = 4, group_size: int = 64) -> Path:
    """Convert a qwen2/llama GGUF into an mlx-lm model directory at `out_dir` (replaced atomically)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    reader = open_gguf(gguf_path)
    tmp_prefix, old_prefix = conversion_temp_prefixes(out_dir)
    # Build in a sibling temp dir and rename it into place: a crash never leaves a half directory.
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=out_dir.parent))
    try:
        write_model_dir(reader, tmp, bits, group_size)
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
