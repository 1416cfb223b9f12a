"""Agent-length contexts: greedy tokens equal mlx-lm's at 1k, 8k and 16k tokens of context, with the CPU
backend's compiled attention kernel (kernels.cpu_attention, which takes these contexts' attention) and with
MLX ops only, and for a 4-bit checkpoint, whose decode steps read its levels (kernels.cpu_quantized_matmul).
The same long prompt again restores its prefix and still answers the same."""

import math

import pytest

from kernels import cpu_attention, cpu_quantized_matmul
from minivllm import LLM
from minivllm.models.backend import detect_backend
from tests.reference import MlxLmReference
from tests.test_engine import greedy, random_prompts
from tests.tiny_model import make_tiny_4bit_model, make_tiny_model

LENGTHS = [1024, 8192, 16384]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=32768)
    prompts = random_prompts(LENGTHS, seed=5)
    # mlx-lm in 1k chunks: its CPU attention scores whole chunks against the whole context
    expected = [MlxLmReference(path).greedy(p, 8, prefill_step_size=1024) for p in prompts]
    return path, prompts, expected


@pytest.mark.skipif(detect_backend().is_gpu, reason="the CPU backend's kernel")
@pytest.mark.parametrize("cpu_attention_mode", ["compiled", "mlx"])
def test_long_contexts_answer_mlx_lms_tokens(long_model, cpu_attention_mode, monkeypatch):
    path, prompts, expected = long_model
    calls, attention = [], cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[3]) or attention(*a))
    llm = LLM(
        str(path), kv_cache_bytes=64 << 20, max_num_batched_tokens=1024, cpu_attention=cpu_attention_mode
    )
    outs = llm.generate(prompts, greedy(8))
    assert [o.token_ids for o in outs] == expected
    # the kernel took the long contexts' prefill chunks and decode steps, or never ran
    assert (len(calls) > 0) == (cpu_attention_mode == "compiled")
    again = llm.generate(prompts[-1], greedy(8))[0]
    assert again.num_cached_tokens == (LENGTHS[-1] - 1) // 16 * 16
    assert again.token_ids == expected[-1]


@pytest.mark.skipif(detect_backend().is_gpu, reason="the CPU backend's kernels")
def test_a_4bit_checkpoint_at_long_contexts_answers_mlx_lms_tokens(long_model, tmp_path, monkeypatch):
    path, prompts, _ = long_model
    q4 = make_tiny_4bit_model(path, tmp_path / "q4")
    expected = [MlxLmReference(q4).greedy(p, 8, prefill_step_size=1024) for p in prompts]
    calls, matmul = [], cpu_quantized_matmul.matmul
    monkeypatch.setattr(cpu_quantized_matmul, "matmul", lambda x, *a: calls.append(x.shape) or matmul(x, *a))
    llm = LLM(str(q4), kv_cache_bytes=64 << 20, max_num_batched_tokens=1024)
    assert [o.token_ids for o in llm.generate(prompts, greedy(8))] == expected
    assert calls and all(math.prod(shape[:-1]) <= cpu_quantized_matmul.MAX_ROWS for shape in calls)
