"""Overlap: step n+1 is built and queued before step n's tokens are read back (LLMEngine.step with
EngineConfig.overlap). It must change nothing a request sees: the same tokens, log-probabilities and
endings as one step at a time, nothing delivered after an abort, waiting requests admitted at once."""

import pytest

import minivllm.engine.llm_engine as llm_engine
from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sampling_params import StructuredOutput
from tests.test_engine import greedy, random_prompts
from tests.tiny_model import BYTES_PER_PAGE


def make_engine(model_dir, **kw) -> LLMEngine:
    settings = dict(kv_cache_bytes=8 << 20, max_num_seqs=8, single_flight="off", overlap=True) | kw
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def run(engine: LLMEngine, requests: dict, after_step=lambda engine: None) -> dict:
    """Every request to its end: request id -> (tokens, logprobs, finish reason)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen = {rid: ([], [], None) for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs, _ = seen[out.request_id]
            tokens += out.new_token_ids
            logprobs += [
                (lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top]) for lp in out.new_logprobs
            ]
            seen[out.request_id] = (tokens, logprobs, out.finish_reason)
        engine.check_invariants()
        after_step(engine)
    assert engine.kv.pool.num_in_use == 0
    return seen


def mixed_requests(stop_token: int) -> dict:
    prompts = random_prompts([5, 17, 33, 40, 64, 90], seed=41)
    params = [
        greedy(20),
        greedy(1),  # its only token comes from its prefill step
        SamplingParams(max_tokens=18, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=1.0, seed=8, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=30, stop_token_ids=[stop_token], ignore_eos=True),  # ends early
        greedy(12),
    ]
    return {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}


def test_overlapped_steps_change_nothing_a_request_sees(tiny_model_dir, reference):
    stop_token = reference.greedy(random_prompts([5, 17, 33, 40, 64], seed=41)[4], 30)[6]
    one_at_a_time = make_engine(tiny_model_dir, overlap=False)
    overlapped = make_engine(tiny_model_dir, overlap=True)
    expected = run(one_at_a_time, mixed_requests(stop_token))
    got = run(overlapped, mixed_requests(stop_token))
    assert got == expected
    assert one_at_a_time.num_steps_ahead == 0 and overlapped.num_steps_ahead > 10
    assert expected["r4"][2] == "stop" and len(expected["r4"][0]) == 7  # the stop token ended it mid-flight
    assert expected["r0"][0] == reference.greedy(random_prompts([5], seed=41)[0], 20)


def test_an_abort_while_the_next_step_is_in_flight_delivers_nothing_more(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    a, b = random_prompts([20, 30], seed=42)
    engine.add_request("a", a, greedy(40))
    engine.add_request("b", b, greedy(12))
    tokens = {"a": [], "b": []}
    while engine.in_flight is None or len(tokens["a"]) < 5:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.abort_request("a")  # its next token is being computed
    outputs = engine.step()
    (end,) = [o for o in outputs if o.request_id == "a"]
    assert end.finish_reason == "abort" and end.new_token_ids == []
    tokens["b"] += [t for o in outputs if o.request_id == "b" for t in o.new_token_ids]
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "b"
            tokens["b"] += out.new_token_ids
    assert tokens["a"] == reference.greedy(a, 40)[: len(tokens["a"])]
    assert tokens["b"] == reference.greedy(b, 12)
    engine.check_invariants()
    assert engine.kv.pool.num_in_use == 0


def test_a_request_that_arrives_is_admitted_in_the_next_scheduled_step(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    a, b, late = random_prompts([20, 30, 25], seed=43)
    engine.add_request("a", a, greedy(30))
    engine.add_request("b", b, greedy(30))
    for _ in range(6):
        engine.step()
    assert engine.in_flight is not None  # plain decodes: the next step is always queued ahead
    engine.add_request("late", late, greedy(10))
    engine.step()  # completes the step in flight; the waiting request stops the lookahead
    assert engine.in_flight is None
    engine.step()  # scheduled as usual: admits the late request
    assert engine.requests["late"].num_computed_tokens == len(late)
    tokens = {"a": [], "b": [], "late": list(engine.requests["late"].output_token_ids)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens["late"] == reference.greedy(late, 10)


def test_a_step_ahead_never_preempts(tiny_model_dir, reference):
    """A pool with no page to spare: the lookahead gives up rather than preempt; results are unchanged."""
    prompts = random_prompts([40, 45, 50, 55], seed=2)
    engine = make_engine(tiny_model_dir, kv_cache_bytes=16 * BYTES_PER_PAGE, max_num_seqs=4,
                         enable_prefix_caching=False)  # fmt: skip
    seen = run(engine, {f"p{i}": (p, greedy(60)) for i, p in enumerate(prompts)})
    assert engine.stats().preemptions > 0 and engine.num_steps_ahead > 0
    assert [seen[f"p{i}"][0] for i in range(4)] == [reference.greedy(p, 60) for p in prompts]


def test_overlap_is_on_by_default_on_a_gpu_backend_and_for_small_models(tiny_model_dir, monkeypatch):
    assert make_engine(tiny_model_dir, overlap=None).overlap is True  # a tiny model: on, on any backend
    monkeypatch.setattr(llm_engine, "OVERLAP_CPU_MAX_WEIGHT_BYTES", 0)  # every model is large now
    engine = make_engine(tiny_model_dir, overlap=None)
    assert engine.overlap == engine.backend.is_gpu
    assert make_engine(tiny_model_dir, overlap=False).overlap is False


@pytest.mark.parametrize("needs_last_token", ["grammar", "penalties"])
def test_requests_that_need_the_last_token_on_the_host_never_run_ahead(tiny_model_dir, needs_last_token):
    grammar = StructuredOutput(lark='start: "answer: " ("yes" | "no")')
    special = {
        "grammar": SamplingParams(max_tokens=30, temperature=1.0, seed=3, structured_output=grammar),
        "penalties": SamplingParams(
            max_tokens=30, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True
        ),
    }[needs_last_token]
    prompts = random_prompts([12, 24], seed=44)

    def requests() -> dict:
        return {"special": (prompts[0], special), "plain": (prompts[1], greedy(40))}

    def never_ahead(engine: LLMEngine) -> None:
        assert engine.in_flight is None or all(s.request_id != "special" for s in engine.in_flight.seqs)

    expected = run(make_engine(tiny_model_dir, overlap=False), requests())
    overlapped = make_engine(tiny_model_dir)
    assert run(overlapped, requests(), never_ahead) == expected
    assert expected["special"][2] == ("stop" if needs_last_token == "grammar" else "length")
    assert overlapped.num_steps_ahead > 0  # the plain request ran ahead once it was alone
