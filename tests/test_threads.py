"""The engine stepped on a thread other than the one that loaded the model, as the server does (the model
loads in a worker thread, the engine steps on its own): greedy tokens against mlx-lm's, for Llama-family
models whose rope keeps its frequencies in a module array (llama3, yarn and longrope scaling), through
every attention path (the CPU backend's compiled kernel, and each path of MLX ops with the kernel off),
and through the HTTP server (issue 31).

MLX streams belong to a thread: an array left unevaluated at load is bound to the loading thread's
stream, and no other thread can evaluate a graph that reaches it."""

import random
import threading

import httpx
import mlx.core as mx
import pytest

from kernels import activations, cpu_attention
from kernels import paged_attention as pa
from minivllm import LLM, SamplingParams
from minivllm.models.loader import load_tokenizer
from server.generation import TextStream
from tests.reference import MlxLmReference
from tests.server_thread import ServerThread, tiny_settings
from tests.tiny_model import LLAMA3_ROPE_SCALING, make_tiny_llama_model

MAX_TOKENS = 8
DIGITS = "0123456789 "  # the report's prompt: DIGITS * 100 is 600 tokens
# large float32 work on the CPU backend only
CPU_ONLY_PATHS = {"numpy softmax", "numpy swiglu", "split", "compiled kernel"}


def on_thread(fn, *args):
    """fn(*args) on a new thread, like the server's stepping thread; its result, or its exception raised
    here."""
    result = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="stepping")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """The report's model: hidden 256, 4 layers, 8 heads, 4 KV heads, head_dim 32, llama3 rope scaling."""
    return make_tiny_llama_model(tmp_path_factory.mktemp("tiny-llama3"))


@pytest.fixture(scope="module")
def expected(llama_dir):
    """mlx-lm's greedy tokens for a prompt of the report's model, each computed once."""
    reference, cache = MlxLmReference(llama_dir), {}

    def tokens(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = reference.greedy(prompt, max_tokens, prefill_step_size=512)
        return cache[key]

    return tokens


@pytest.fixture(scope="module")
def digits(llama_dir) -> list[int]:
    """DIGITS * 500: 3,000 tokens; its first 600 are the report's prompt."""
    return load_tokenizer(str(llama_dir)).encode(DIGITS * 500)


@pytest.fixture(scope="module")
def prompts(digits) -> list[list[int]]:
    """A short random prompt (attention and SwiGLU on MLX) and the report's 600-token one (past the numpy
    thresholds)."""
    rng = random.Random(31)
    return [[rng.randrange(362) for _ in range(40)], digits[:600]]


@pytest.fixture
def paths(monkeypatch) -> set[str]:
    """The attention and activation paths the engine takes, recorded by wrapping the kernels' functions."""
    seen: set[str] = set()
    parallel_heads: list[int] = []

    def spy(module, name: str, record) -> None:
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            record(*args)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    def attend(q, keys, *_) -> None:
        seen.add("one run" if len(keys) == 1 else "few runs")  # a gathered context is one piece
        if q.shape[1] < parallel_heads[-1]:
            seen.add("split")  # a group of the KV heads on one of the CPU streams

    spy(pa, "_attend_parallel", lambda q, *_: parallel_heads.append(q.shape[1]))
    spy(pa, "_attend", attend)
    spy(pa, "_gather_pages", lambda *_: seen.add("gathered"))
    spy(pa, "softmax_numpy", lambda *_: seen.add("numpy softmax"))
    spy(activations, "_swiglu_numpy", lambda *_: seen.add("numpy swiglu"))
    spy(cpu_attention, "attention", lambda *_: seen.add("compiled kernel"))
    return seen


def assert_took(paths: set[str], wanted: set[str]) -> None:
    if mx.default_device() != mx.cpu:
        wanted = wanted - CPU_ONLY_PATHS
    assert wanted <= paths, f"paths taken: {sorted(paths)}"


def fragment_pool(llm: LLM, every: int) -> None:
    """Take every `every`-th page out of the free pages (held by nobody), so that a request's pages come
    in runs of every - 1 consecutive pages (one page each for every = 2)."""
    pool = llm.engine.kv.pool
    for page in range(every - 1, pool.num_pages, every):
        assert pool.free.take(1, after=page - 1) == [page]


# -- the engine on a stepping thread ---------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "attention, wanted",
    [
        ("compiled", {"compiled kernel", "numpy swiglu"}),  # the kernel's buffers are per calling thread
        ("mlx", {"one run", "numpy softmax", "numpy swiglu"}),
    ],
)
def test_the_reports_model_steps_on_threads_other_than_the_loading_one(
    llama_dir, expected, prompts, paths, overlap, attention, wanted
):
    # loads on this thread
    llm = LLM(str(llama_dir), kv_cache_bytes=16 << 20, overlap=overlap, cpu_attention=attention)
    for _ in range(2):  # a new thread each time: nothing may depend on the first stepping thread
        outputs = on_thread(llm.generate, prompts, greedy())
        assert [c.token_ids for c in outputs] == [expected(p) for p in prompts]
        assert {c.finish_reason for c in outputs} == {"length"}
    assert_took(paths, wanted)


@pytest.mark.parametrize(
    "every, wanted",
    [
        (4, {"few runs", "numpy softmax"}),  # runs of 3 pages: 13 runs for 600 tokens, scores joined
        (2, {"few runs", "gathered", "numpy softmax"}),  # one-page runs: 38 > MAX_RUNS, gathered
    ],
)
def test_contexts_in_runs_of_pages_on_a_stepping_thread(llama_dir, expected, prompts, paths, every, wanted):
    llm = LLM(str(llama_dir), kv_cache_bytes=16 << 20, cpu_attention="mlx")  # MLX ops' paths
    fragment_pool(llm, every)
    outputs = on_thread(llm.generate, prompts, greedy())
    assert [c.token_ids for c in outputs] == [expected(p) for p in prompts]
    assert_took(paths, wanted)


def test_attention_split_over_cpu_streams_created_on_the_stepping_thread(
    llama_dir, expected, prompts, paths, monkeypatch
):
    """Every attention with any scores is split by KV heads over one MLX stream per core (4 here, one per
    KV head, whatever the machine has), the extra streams created afresh by the stepping thread."""
    monkeypatch.setattr(pa, "PARALLEL_MIN_SCORES", 0)
    monkeypatch.setattr(pa, "_extra_streams", None)
    monkeypatch.setattr(pa.os, "cpu_count", lambda: 4)
    llm = LLM(str(llama_dir), kv_cache_bytes=16 << 20, cpu_attention="mlx")
    outputs = on_thread(llm.generate, prompts, greedy())
    assert [c.token_ids for c in outputs] == [expected(p) for p in prompts]
    assert_took(paths, {"split", "numpy softmax"})


# mlx-lm's rope modules that keep an array of frequencies (`_freqs`, outside model.parameters()), and
# plain RoPE, which keeps none (it stepped on any thread before the fix too)
ROPE_SCALINGS = {
    "llama3": LLAMA3_ROPE_SCALING,
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 2048,
        "short_factor": [1.0] * 8,
        "long_factor": [1.5] * 8,
    },
    "none": None,
}


@pytest.mark.parametrize("rope", ROPE_SCALINGS)
def test_small_llama_models_step_on_another_thread(tmp_path, rope, paths):
    """The qwen2 tiny model's shape (4 heads, 2 KV heads, head_dim 16) with each rope scaling."""
    model_dir = make_tiny_llama_model(
        tmp_path,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_scaling=ROPE_SCALINGS[rope],
    )
    llm = LLM(str(model_dir), kv_cache_bytes=4 << 20, cpu_attention="mlx")  # MLX ops' paths
    rng = random.Random(7)
    prompts = [[rng.randrange(362) for _ in range(n)] for n in (20, 300)]
    outputs = on_thread(llm.generate, prompts, greedy(16))
    reference = MlxLmReference(model_dir)
    assert [c.token_ids for c in outputs] == [reference.greedy(p, 16) for p in prompts]
    assert_took(paths, {"one run", "numpy softmax"})


# -- the server ------------------------------------------------------------------------------------------
def test_the_server_serves_long_prompts_of_the_reports_model(llama_dir, expected, digits):
    """The report's requests: every prompt over ~200 tokens was an HTTP 500, "There is no Stream(cpu, 0)
    in current thread"."""
    with ServerThread(tiny_settings(llama_dir, kv_cache_bytes=32 << 20)) as server:
        url = server.url + "/v1/completions"
        r = httpx.post(url, json={"model": "tiny", "prompt": DIGITS * 100, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 600
        state = server.app.state.server
        for n in (200, 600, 3000):
            prompt = digits[:n]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = httpx.post(url, json={**body, "ignore_eos": True, "logprobs": 0}, timeout=120)
            assert r.status_code == 200, r.text
            choice, usage = r.json()["choices"][0], r.json()["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (n, MAX_TOKENS)
            tokens = expected(prompt)
            assert choice["logprobs"]["tokens"] == [state.token_text(t) for t in tokens], n
            text = TextStream(state.engine.tokenizer, [], state.special_token_ids)
            assert choice["text"] == text.add(tokens) + text.finish(), n
        server.wait_idle()
