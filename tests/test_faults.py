"""Every exit path of a request ends with its pages released, its stream closed with a clear reason, and
the engine still serving: a cancellation at any await point, a fault anywhere in a step. The synchronous
API raises for a failed request."""

import asyncio
import threading
import time

import pytest

from minivllm import LLM, EngineConfig, GenerationError, SamplingParams
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.outputs import RequestOutput
from tests.test_engine import random_prompts


class InjectedFault(RuntimeError):
    pass


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 4 << 20)
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def broken(*args, **kwargs):
    raise InjectedFault("injected fault")


async def collect(
    engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
) -> list[RequestOutput]:
    return [out async for out in engine.generate(rid, prompt, params)]


async def drain(stream) -> None:
    async for _ in stream:
        pass


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


async def until_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Wait until the engine holds no request and no page, then check the pool's invariants."""
    eng = engine.engine
    deadline = time.monotonic() + timeout
    while eng.requests or eng.kv.pool.num_in_use:
        assert time.monotonic() < deadline, f"engine not idle: {list(eng.requests)}"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the stepping thread finishes its bookkeeping
    eng.check_invariants()


# -- cancellation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["right_away", "after_the_engine_accepted_it", "while_streaming"])
async def test_a_cancelled_request_is_aborted_wherever_it_waits(tiny_model_dir, when):
    engine = make_engine(tiny_model_dir)
    added = threading.Event()
    seqs = []
    real_add = engine.add_request

    def add_request(*args):
        seqs.append(real_add(*args))
        added.set()
        return seqs[-1]

    engine.add_request = add_request
    async_engine = AsyncEngine(engine=engine)
    async_engine.start()
    try:
        prompt = random_prompts([20], seed=30)[0]
        stream = async_engine.generate("r", prompt, greedy(1500))
        pending = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # generate() has queued the request and awaits its acceptance
        if when == "after_the_engine_accepted_it":
            # Block the event loop until the stepping thread has added the request: the acceptance it
            # sends back cannot be delivered before the cancellation.
            assert added.wait(10)
        elif when == "while_streaming":
            assert (await pending).request_id == "r"
            # a reader that keeps reading (one __anext__ could already be done: tokens may be queued)
            pending = asyncio.ensure_future(drain(stream))
            await asyncio.sleep(0)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await until_idle(async_engine)
        # the request ended by an abort (or never reached the engine), not by running to its 1500 tokens
        assert all(s.finish_reason == "abort" and len(s.output_token_ids) < 1500 for s in seqs)
        assert when == "right_away" or seqs
    finally:
        async_engine.shutdown()


# -- faults in a step -----------------------------------------------------------------------------------------
# Where a step can fail: (LLMEngine attribute, method), patched to raise. The last one is LLMEngine.step
# itself, which handles its own faults: the stepping loop's last resort must hold anyway.
FAULT_SITES = {
    "schedule": ("scheduler", "schedule"),
    "admission": ("kv", "admit"),
    "model run": ("runner", "launch"),
    "readback": ("runner", "collect"),
    "postprocess": ("scheduler", "postprocess"),
    "publication": ("kv", "publish"),
    "whole step": (None, "step"),
}


@pytest.mark.parametrize("site", FAULT_SITES)
async def test_a_fault_anywhere_in_a_step_fails_its_requests_and_the_engine_goes_on(
    tiny_model_dir, reference, monkeypatch, site
):
    engine = make_engine(tiny_model_dir)
    async_engine = AsyncEngine(engine=engine)
    async_engine.start()
    try:
        prompts = random_prompts([40, 40, 40], seed=31)  # distinct: each one has pages to publish
        for rid, prompt in zip(("before", "during", "after"), prompts):
            owner, method = FAULT_SITES[site]
            if rid == "during":  # stays broken: no retry of the step may succeed
                monkeypatch.setattr(getattr(engine, owner) if owner else engine, method, broken)
            outputs = await asyncio.wait_for(collect(async_engine, rid, prompt, greedy(8)), 20)
            if rid == "during":
                assert outputs[-1].finish_reason == "error"
                assert outputs[-1].error == "InjectedFault: injected fault"
                monkeypatch.undo()
            else:
                assert outputs[-1].finish_reason == "length"
                assert tokens_of(outputs) == reference.greedy(prompt, 8)
            await until_idle(async_engine)  # its pages are released
    finally:
        async_engine.shutdown()


async def test_a_fault_in_the_stats_neither_hangs_streams_nor_stops_the_engine(
    tiny_model_dir, reference, monkeypatch
):
    engine = make_engine(tiny_model_dir)
    async_engine = AsyncEngine(engine=engine)
    async_engine.start()
    try:
        monkeypatch.setattr(engine, "stats", broken)
        prompt = random_prompts([24], seed=32)[0]
        for rid in ("a", "b"):
            outputs = await asyncio.wait_for(collect(async_engine, rid, prompt, greedy(6)), 20)
            assert outputs[-1].finish_reason == "length" and tokens_of(outputs) == reference.greedy(prompt, 6)
        assert async_engine.is_running
    finally:
        async_engine.shutdown()


def test_a_fault_after_requests_finished_reports_every_request_of_the_step(tiny_model_dir, monkeypatch):
    """The fault hits after the step finished one request: both still end, once, with the fault as reason,
    and nothing is left behind for a late abort to trip over."""
    engine = make_engine(tiny_model_dir)
    short, long = random_prompts([20, 30], seed=33)
    engine.add_request("short", short, greedy(1))  # finishes in its first step
    engine.add_request("long", long, greedy(8))
    real_postprocess = engine.scheduler.postprocess

    def postprocess_then_fail(*args):
        real_postprocess(*args)
        raise InjectedFault("after postprocess")

    monkeypatch.setattr(engine.scheduler, "postprocess", postprocess_then_fail)
    outputs = engine.step()
    assert sorted((o.request_id, o.finish_reason, o.error) for o in outputs) == [
        ("long", "error", "InjectedFault: after postprocess"),
        ("short", "error", "InjectedFault: after postprocess"),
    ]
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.kv.pool.num_in_use == 0
    for rid in ("short", "long"):
        with pytest.raises(KeyError, match="unknown"):
            engine.abort_request(rid)


def test_an_abort_of_a_request_that_already_finished_in_this_step_is_harmless(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    seq = engine.add_request("a", random_prompts([20], seed=34)[0], greedy(4))
    engine.step()
    engine.scheduler.finish(seq, "stop")  # e.g. a stop token, while an abort is on its way
    engine.abort_request("a")
    (out,) = engine.step()
    assert (out.request_id, out.finish_reason) == ("a", "stop")
    assert not engine.has_unfinished_requests() and engine.kv.pool.num_in_use == 0
    engine.check_invariants()


async def test_a_duplicate_id_is_refused_even_while_the_first_compiles_its_grammar(tiny_model_dir):
    """The first request's grammar compiles off the loop: a second request with its id, arriving
    meanwhile, must be refused at once, and the first must still finish (it once hung)."""
    from minivllm.engine.sampling_params import StructuredOutput
    from minivllm.engine.validation import RequestError

    engine = make_engine(tiny_model_dir)
    async_engine = AsyncEngine(engine=engine)
    async_engine.start()
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        params = SamplingParams(max_tokens=40, structured_output=StructuredOutput(json_schema=schema))
        first = asyncio.ensure_future(collect(async_engine, "same", [1, 2, 3], params))
        await asyncio.sleep(0)  # the first has registered its id and awaits the compile
        with pytest.raises(RequestError, match="duplicate") as refused:
            await collect(async_engine, "same", [4, 5, 6], greedy(4))
        assert refused.value.param == "request_id"
        outputs = await asyncio.wait_for(first, 60)
        assert outputs[-1].finished and outputs[-1].finish_reason in ("stop", "length")
        await until_idle(async_engine)
    finally:
        async_engine.shutdown()


# -- the synchronous API ----------------------------------------------------------------------------------
def test_a_fault_in_a_step_makes_llm_generate_raise(tiny_model_dir, monkeypatch):
    """A failed request is never returned as a short or empty completion: generate raises, naming the
    requests and the fault, once the call's requests have ended; the engine goes on."""
    # steps one at a time (with overlap the third launch is of a step ahead: the tokens counted differ)
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20, overlap=False)
    prompts = random_prompts([12, 30], seed=35)
    real_launch, launches = llm.engine.runner.launch, []

    def third_launch_fails(*args, **kwargs):
        launches.append(1)
        if len(launches) == 3:  # after two tokens of each request
            raise InjectedFault("injected fault")
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "launch", third_launch_fails)
    with pytest.raises(GenerationError, match="request llm-0: InjectedFault: injected fault") as e:
        llm.generate(prompts, greedy(6))
    assert [c.request_id for c in e.value.completions] == ["llm-0", "llm-1"]
    assert e.value.failed == e.value.completions  # both were in the faulted step
    for c in e.value.failed:
        assert (c.finish_reason, c.error, len(c.token_ids)) == ("error", "InjectedFault: injected fault", 2)
    monkeypatch.setattr(llm.engine.runner, "launch", real_launch)
    (out,) = llm.generate(prompts[:1], greedy(6))
    assert out.finish_reason == "length" and len(out.token_ids) == 6


def test_an_aborted_request_is_returned_by_llm_generate(tiny_model_dir, monkeypatch):
    """An abort is not a fault: generate returns the aborted request's completion with the others'."""
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=4 << 20)
    real_step = llm.engine.step

    def step_then_abort():
        outputs = real_step()
        if "llm-0" in llm.engine.requests:
            llm.engine.abort_request("llm-0")
        return outputs

    monkeypatch.setattr(llm.engine, "step", step_then_abort)
    aborted, finished = llm.generate(random_prompts([12, 30], seed=36), greedy(6))
    assert (aborted.finish_reason, len(aborted.token_ids), aborted.error) == ("abort", 1, None)
    assert (finished.finish_reason, len(finished.token_ids)) == ("length", 6)


def test_a_fault_never_relabels_an_aborted_request_as_failed(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    seq = engine.add_request("gone", [1, 2, 3, 4], greedy(8))
    engine.step()
    engine.abort_request("gone")  # the client left; then the step it was part of faults
    outputs = engine.fail([seq], InjectedFault("injected fault"))
    assert seq.finish_reason == "abort"
    assert all(o.finish_reason == "abort" for o in outputs if o.request_id == "gone")
    engine.check_invariants()
