"""The command line and model references: generate, convert, replay; .gguf files and repo ids."""

import json

import pytest

from minivllm import LLM, SamplingParams
from minivllm.cli import main
from minivllm.models.loader import resolve_model
from tests.test_gguf_import import write_tiny_gguf


def test_generate_streams_text(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hello", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()


def test_generate_rejects_bad_input(tiny_model_dir, capsys):
    assert main(["generate", "--model", "/no/such/model", "--prompt", "hi"]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_generate_reports_a_failed_request(tiny_model_dir, monkeypatch, capsys):
    from minivllm.engine.model_runner import ModelRunner

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(ModelRunner, "launch", broken)
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4"]) == 1
    assert "the request failed: RuntimeError: injected fault" in capsys.readouterr().err


def test_convert_then_serve_a_gguf_file(tmp_path, monkeypatch, capsys):
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    assert main(["convert", str(gguf_path), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    # a .gguf reference converts once into the cache, then loads like a directory
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(str(gguf_path), kv_cache_bytes=1 << 20)
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4
    assert resolve_model(str(gguf_path)) == resolve_model(str(gguf_path))  # converted once, reused


def test_convert_modes(tmp_path, capsys):
    """Default: the GGUF's quantization carried over; --bits: uniform re-quantization, float16 scales."""
    import mlx.core as mx

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    assert main(["convert", str(gguf_path), str(tmp_path / "exact")]) == 0
    quantization = json.loads((tmp_path / "exact" / "config.json").read_text())["quantization"]
    assert quantization["lm_head"] == {"group_size": 32, "bits": 8}  # the tiny GGUF's lm_head is Q8_0
    assert main(["convert", str(gguf_path), str(tmp_path / "q4"), "--bits", "4"]) == 0
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"] == {
        "group_size": 64,
        "bits": 4,
    }
    saved = mx.load(str(tmp_path / "q4" / "model.safetensors"))
    assert saved["lm_head.scales"].dtype == saved["lm_head.biases"].dtype == mx.float16
    assert main(["convert", str(gguf_path), str(tmp_path / "q8"), "--bits", "8", "--group-size", "32",
                 "--scale-dtype", "float32"]) == 0  # fmt: skip
    saved = mx.load(str(tmp_path / "q8" / "model.safetensors"))
    assert saved["lm_head.scales"].dtype == mx.float32 and saved["lm_head.weight"].shape == (320, 64)
    with pytest.raises(SystemExit):  # a group size without --bits means nothing: refused, not ignored
        main(["convert", str(gguf_path), str(tmp_path / "x"), "--group-size", "32"])
    assert "add --bits" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_convert_rejects_what_is_not_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    assert main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert "error" in capsys.readouterr().err


def test_repo_ids_go_to_the_hub_client_and_missing_paths_fail_early():
    assert (
        resolve_model("mlx-community/Qwen2.5-0.5B-Instruct-4bit")
        == "mlx-community/Qwen2.5-0.5B-Instruct-4bit"
    )
    for ref in ("./missing-dir", "/abs/missing", "missing.gguf"):
        with pytest.raises(FileNotFoundError):
            resolve_model(ref)


def test_replay_subcommand(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"hash_ids": [1, 2], "input_length": 1000}\n{"hash_ids": [1, 2, 3], "input_length": 1200}\n'
    )
    assert main(["replay", str(trace), "--policy", "lru", "--capacity", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hit_tokens"] == 2 * 512 and result["total_tokens"] == 2200


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
