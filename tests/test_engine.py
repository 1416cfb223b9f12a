"""Engine core on the small random model: greedy parity with mlx-lm, batching, chunking, preemption,
page accounting and input validation."""

import random

import pytest

from kernels import activations, cpu_quantized_matmul
from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.token_gaps import TokenGaps
from tests.reference import MlxLmReference
from tests.tiny_model import BYTES_PER_PAGE


def random_prompts(lengths, seed=0, vocab=384):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_all(llm, prompts, max_tokens):
    return [c.token_ids for c in llm.generate(prompts, greedy(max_tokens))]


def test_single_prompt_matches_mlx_lm(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    assert run_all(llm, [prompt], 40) == [reference.greedy(prompt, 40)]


def test_eight_prompts_in_one_continuous_batch_match_mlx_lm(tiny_model_dir, reference):
    prompts = random_prompts([1, 7, 16, 33, 64, 129, 200, 300])
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=8 << 20, max_num_seqs=8, max_num_batched_tokens=1024)
    outputs = run_all(llm, prompts, 24)
    assert outputs == [reference.greedy(p, 24) for p in prompts]
    # they really ran together: fewer steps than running them one after the other
    assert llm.engine.num_steps < 8 * 24


def test_chunked_prefill_matches_mlx_lm(tiny_model_dir, reference):
    prompts = random_prompts([300, 150], seed=1)
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=8 << 20, max_num_batched_tokens=64, max_num_seqs=4)
    assert run_all(llm, prompts, 16) == [reference.greedy(p, 16) for p in prompts]


def test_numpy_elementwise_path_matches_mlx_lm(tiny_model_dir, reference, monkeypatch):
    """On the CPU backend large SwiGLUs and prefill softmaxes go through numpy (kernels.activations):
    here every one does, in steps mixing prefill chunks and decode tokens."""
    monkeypatch.setattr(activations, "NUMPY_MIN_ELEMENTS", 0)
    prompts = random_prompts([1, 33, 129, 300], seed=3)
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=8 << 20, max_num_batched_tokens=128, max_num_seqs=4)
    assert run_all(llm, prompts, 16) == [reference.greedy(p, 16) for p in prompts]


def test_preemption_recomputes_and_matches_mlx_lm(tiny_model_dir, reference):
    prompts = random_prompts([40, 45, 50, 55], seed=2)
    # 16 pages of 16 tokens: four requests growing to ~100 tokens each cannot all stay resident
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_bytes=16 * BYTES_PER_PAGE,
        max_num_seqs=4,
        enable_prefix_caching=False,
        single_flight="off",
    )
    outputs = run_all(llm, prompts, 60)
    assert llm.engine.stats().preemptions > 0
    assert outputs == [reference.greedy(p, 60) for p in prompts]
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_pages


def test_every_page_returns_after_finished_aborted_and_preempted(tiny_model_dir):
    engine = LLMEngine(
        _config(
            tiny_model_dir,
            kv_cache_bytes=20 * BYTES_PER_PAGE,
            max_num_seqs=6,
            enable_prefix_caching=False,
            single_flight="off",
        )
    )
    prompts = random_prompts([30, 60, 90, 20, 45, 70], seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(40 + 10 * i))
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        engine.check_invariants()
        if step == 5:
            engine.abort_request("r1")  # running
        if step == 6:
            engine.abort_request("r5")  # may be waiting or running
    assert not engine.has_unfinished_requests()
    assert engine.stats().preemptions > 0
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages


def test_prefix_cached_pages_are_not_leaked(tiny_model_dir):
    engine = LLMEngine(_config(tiny_model_dir, kv_cache_bytes=4 << 20))
    prompt = random_prompts([100], seed=4)[0]
    for i in range(3):
        engine.add_request(f"r{i}", prompt, greedy(10))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    assert engine.kv.pool.num_in_use == 0
    assert engine.kv.pool.num_free + engine.kv.pool.num_cached == engine.kv.pool.num_pages


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(_config(tiny_model_dir, kv_cache_bytes=4 << 20, max_model_len=256))


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], {}, "prompt is empty"),
        ([1] * 300, {}, "context"),
        ([1, 2, 100000], {}, "token ids"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_requests_raise_clear_errors(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert "bad" not in engine.requests
    engine.add_request("good", [1, 2, 3], greedy(2))  # the engine still works
    while engine.has_unfinished_requests():
        engine.step()


def test_duplicate_and_unknown_request_ids(engine):
    engine.add_request("dup", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("dup", [4, 5], greedy(2))
    with pytest.raises(KeyError, match="unknown"):
        engine.abort_request("never-seen")
    while engine.has_unfinished_requests():
        engine.step()


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM("/nonexistent/model-dir")


def test_bad_engine_settings(tiny_model_dir):
    with pytest.raises(ValueError, match="eviction"):
        LLM(str(tiny_model_dir), eviction="random")
    with pytest.raises(ValueError, match="page_size"):
        LLM(str(tiny_model_dir), page_size=0)


def test_sampling_is_seeded_per_request(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    prompt = random_prompts([20], seed=5)[0]
    params = [
        SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
        for s in (7, 7, 8)
    ]
    # the same seed alongside different batch neighbours gives the same tokens
    a, b, c = (x.token_ids for x in llm.generate([prompt] * 3, params))
    assert a == b and a != c
    (alone,) = (x.token_ids for x in llm.generate([prompt], params[0]))
    assert alone == a


def test_stop_token_ids_and_eos(tiny_model_dir, reference):
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    prompt = random_prompts([12], seed=6)[0]
    expected = reference.greedy(prompt, 20)
    stop_at = expected[5]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_at], ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.token_ids == expected[: expected.index(stop_at) + 1]


def _config(model_dir, **kw):
    from minivllm import EngineConfig

    return EngineConfig(model=str(model_dir), **kw)


def test_logprobs_of_greedy_tokens_and_alternatives(tiny_model_dir, reference):
    import mlx.core as mx

    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    prompt = random_prompts([10], seed=8)[0]
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=3, logprobs=4, ignore_eos=True))
    first = out.logprobs[0]
    logits = reference.model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits)).tolist()
    assert first.token_id == out.token_ids[0] and abs(first.logprob - expected[first.token_id]) < 1e-4
    assert [t for t, _ in first.top] == sorted(range(len(expected)), key=lambda t: -expected[t])[:4]
    assert first.top[0][0] == first.token_id  # greedy picks the most likely token
    assert len(out.logprobs) == 3


@pytest.mark.parametrize("cpu_matmul", ["compiled", "mlx"])
def test_4bit_checkpoint_matches_mlx_lm(tiny_model_dir, tmp_path, cpu_matmul, monkeypatch):
    """A quantized directory: dequantized to float32 on the CPU, kept 4-bit on a GPU; mlx-lm does the same.
    On the CPU, decode steps read the levels in kernels/cpu_quantized_matmul.cpp (compiled) or the float32
    copy (mlx); the tokens are mlx-lm's either way."""
    from tests.tiny_model import make_tiny_4bit_model

    calls, matmul = [], cpu_quantized_matmul.matmul
    monkeypatch.setattr(cpu_quantized_matmul, "matmul", lambda x, *a: calls.append(x.shape) or matmul(x, *a))
    q4 = make_tiny_4bit_model(tiny_model_dir, tmp_path / "q4")
    llm = LLM(str(q4), kv_cache_bytes=4 << 20, cpu_matmul=cpu_matmul)
    prompts = random_prompts([5, 40], seed=9)
    reference = MlxLmReference(q4)
    assert run_all(llm, prompts, 12) == [reference.greedy(p, 12) for p in prompts]
    kernel = cpu_matmul == "compiled" and not llm.engine.backend.is_gpu and cpu_quantized_matmul.loaded()
    assert (len(calls) > 0) == kernel


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir, reference, monkeypatch):
    import minivllm.engine.model_runner as runner_module

    engine = LLMEngine(_config(tiny_model_dir, kv_cache_bytes=4 << 20))
    warm = random_prompts([40], seed=10)[0]
    engine.add_request("warm", warm, greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_cached > 0
    real_forward = runner_module.forward

    def broken_forward(*args):
        real_forward(*args)  # the pools now hold this step's lazy writes
        raise RuntimeError("boom")

    monkeypatch.setattr(runner_module, "forward", broken_forward)
    engine.add_request("a", warm, greedy(4))
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [
        ("a", "error", "RuntimeError: boom")
    ]
    monkeypatch.setattr(runner_module, "forward", real_forward)
    engine.check_invariants()
    pages = engine.kv.state()
    assert pages.cached == 0 and pages.free == pages.total  # cache forgotten
    seq = engine.add_request("b", warm, greedy(8))
    while engine.has_unfinished_requests():
        engine.step()
    assert seq.output_token_ids == reference.greedy(warm, 8)


def test_the_tiny_model_is_not_degenerate(reference):
    """Output equality can only catch wrong KV if outputs vary: greedy continuations use many distinct
    tokens, and changing only the first prompt token (whose KV every later token reads) changes them."""
    for prompt in random_prompts([20, 50, 100], seed=12):
        out = reference.greedy(prompt, 32)
        assert len(set(out)) >= 16, out
        assert reference.greedy([(prompt[0] + 1) % 384] + prompt[1:], 32) != out


def test_a_seeded_request_draws_new_randomness_at_every_position(tiny_model_dir):
    # At a huge temperature the distribution is nearly flat: the tokens vary only as much as the random
    # draws do. One seed must still give a different draw at every position.
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    prompt = random_prompts([10], seed=13)[0]
    params = SamplingParams(max_tokens=24, temperature=1e4, seed=11, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    assert len(set(out.token_ids)) >= 12, out.token_ids


def test_a_decoding_request_gets_a_token_in_every_step_of_a_long_prefill(tiny_model_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=8 << 20, max_num_batched_tokens=64)
    )
    stream = engine.add_request("stream", random_prompts([8])[0], greedy(200))
    engine.step()  # its prompt: it decodes from here on
    engine.add_request("long", random_prompts([600], seed=1)[0], greedy(1))  # 10 steps or more
    steps = 0
    while "long" in engine.requests:
        engine.step()
        steps += 1
    tokens = len(stream.output_token_ids)
    assert steps >= 10 and tokens == steps + 1  # one token in the first step and in each since
    # the engine's own count: every gap after the first token is one step
    assert engine.token_gaps.counts[0] == tokens - 1 == engine.token_gaps.total_steps
    assert sum(engine.token_gaps.counts) == tokens - 1


def test_token_gaps_are_counted_in_step_buckets():
    gaps = TokenGaps()
    for steps in (1, 1, 2, 5, 300):
        gaps.record(steps)
    assert gaps.total_steps == 309
    assert gaps.cumulative() == [(1.0, 2), (2.0, 3), (3.0, 3), (4.0, 3), (8.0, 4), (16.0, 4), (64.0, 4), (256.0, 4), (float("inf"), 5)]  # fmt: skip


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_write_the_kv_pools_in_place(tiny_model_dir, overlap):
    """Each step writes every layer's K and V into the pools' own buffers (a copy would cost a pool's
    size per layer per step), also while the next step is built on the step in flight."""
    import mlx.core as mx

    engine = LLMEngine(_config(tiny_model_dir, kv_cache_bytes=256 << 20, overlap=overlap))
    pool_bytes = engine.runner.kv.keys[0].nbytes
    engine.add_request("r", random_prompts([40], seed=5)[0], greedy(12))
    engine.step()  # the prefill
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_steps_ahead > 0 if overlap else engine.num_steps_ahead == 0
    assert mx.get_peak_memory() - before < pool_bytes // 4
