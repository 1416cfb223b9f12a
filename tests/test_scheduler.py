"""The scheduler over a KV manager, with no model: a fake runner "samples" a fixed token for every
request whose chunk reaches its last token. What it checks is the scheduling itself: chunked prefill
under the step budget, admission with prefix restore, preemption, the pool's page states after every
step, and that pages come back on every exit."""

from dataclasses import dataclass

import pytest

from minivllm.cache.kv_manager import KVManager
from minivllm.config import EngineConfig
from minivllm.engine.grammar import MaskCounters
from minivllm.engine.llm_engine import new_sequence
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.scheduler import ScheduledStep, Scheduler, fair_shares
from minivllm.engine.sequence import Sequence

PAGE = 4
EOS = 0
TOKEN = 7  # what the fake runner samples (never EOS)


@dataclass
class FakeOutput:
    tokens: list[int]
    logprob: None = None


def fake_run(step: ScheduledStep) -> list[FakeOutput]:
    """One output per request: a token when its chunk reaches its last known token, else none."""
    return [
        FakeOutput([TOKEN] if seq.num_computed_tokens + n == len(seq.token_ids) else [])
        for seq, n in zip(step.seqs, step.num_tokens)
    ]


def make(num_pages=16, budget=8, max_model_len=256, **config) -> Scheduler:
    cfg = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=4, page_size=PAGE, **config)
    kv = KVManager(num_pages, PAGE, cfg.eviction, cfg.enable_prefix_caching)
    return Scheduler(cfg, kv, {EOS}, max_model_len, MaskCounters())


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return new_sequence(rid, list(prompt), SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler) -> ScheduledStep:
    scheduled = s.schedule()
    if scheduled:
        s.postprocess(scheduled, fake_run(scheduled))
    s.kv.check_invariants([seq.cache for seq in s.running])
    return scheduled


def run_to_end(s: Scheduler, limit: int = 200) -> list[ScheduledStep]:
    steps = []
    while (s.running or s.waiting) and len(steps) < limit:
        steps.append(step(s))
    assert not (s.running or s.waiting), "requests left after the step limit"
    return steps


def test_chunked_prefill_respects_the_budget_then_decodes_one_token_a_step():
    s = make(budget=8)
    seq = request("a", list(range(1, 21)), max_tokens=3)  # 20 prompt tokens
    s.add(seq)
    steps = run_to_end(s)
    assert [st.num_tokens for st in steps] == [[8], [8], [4], [1], [1]]
    assert seq.output_token_ids == [TOKEN] * 3 and seq.finish_reason == "length"
    assert s.kv.state().in_use == 0


def test_the_budget_is_shared_by_decodes_first_then_prefill():
    s = make(budget=8)
    first = request("a", list(range(1, 6)), max_tokens=8)
    s.add(first)
    step(s)  # its whole prompt: it decodes from now on
    s.add(request("b", list(range(10, 30))))
    scheduled = step(s)
    assert [q.request_id for q in scheduled.seqs] == ["a", "b"] and scheduled.num_tokens == [1, 7]


def test_a_second_request_restores_the_published_prefix():
    s = make()
    prompt = list(range(1, 19))  # 18 tokens: 4 full pages
    s.add(request("a", prompt))
    run_to_end(s)
    assert s.kv.state().cached > 0
    again = request("b", prompt)
    s.add(again)
    step(s)
    # the last token is always computed: at most floor((N-1)/P) pages restored
    assert again.num_cached_tokens == (len(prompt) - 1) // PAGE * PAGE
    assert s.counters.hit_tokens == again.num_cached_tokens


def test_without_prefix_caching_nothing_is_restored_or_published():
    s = make(enable_prefix_caching=False, single_flight="off")
    prompt = list(range(1, 19))
    s.add(request("a", prompt))
    run_to_end(s)
    s.add(again := request("b", prompt))
    run_to_end(s)
    assert again.num_cached_tokens == 0 and s.kv.state().cached == 0


def test_the_newest_request_is_preempted_when_pages_run_out_and_both_finish():
    s = make(num_pages=6, budget=16)  # 24 token slots for two requests that grow to 16 tokens each
    a, b = request("a", list(range(1, 9)), max_tokens=8), request("b", list(range(20, 28)), max_tokens=8)
    s.add(a)
    s.add(b)
    run_to_end(s)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.finish_reason == b.finish_reason == "length"
    assert s.kv.state().in_use == 0


def test_a_request_that_can_never_fit_the_pool_is_stopped_not_preempting_others():
    s = make(num_pages=4)
    big = request("big", list(range(1, 13)), max_tokens=40)  # up to 52 tokens: 13 pages of a 4-page pool
    s.add(big)
    run_to_end(s)
    assert big.finish_reason == "length" and "KV pages" in big.finish_detail
    assert s.counters.preemptions == 0


def test_an_abort_while_waiting_or_running_releases_every_page():
    s = make(budget=4)
    running, waiting = request("r", list(range(1, 13))), request("w", list(range(30, 42)))
    s.add(running)
    step(s)  # r takes the whole budget: w still waits
    s.add(waiting)
    s.finish(running, "abort")
    s.finish(waiting, "abort")
    assert not s.running and not s.waiting
    s.kv.check_invariants([])
    assert s.kv.state().in_use == 0


def test_schedule_ahead_only_when_every_running_request_just_decodes():
    s = make(budget=8)
    seq = request("a", list(range(1, 13)), max_tokens=8)
    s.add(seq)
    first = s.schedule()
    assert not s.schedule_ahead(first)  # a chunk short of the prompt's end samples nothing to go on with
    s.postprocess(first, fake_run(first))
    last_chunk = s.schedule()
    ahead = s.schedule_ahead(last_chunk)  # it samples: the next step decodes that token
    assert ahead.seqs == [seq] and ahead.num_tokens == [1]
    s.postprocess(last_chunk, fake_run(last_chunk))
    s.postprocess(ahead, fake_run(ahead))
    decode = s.schedule()
    ahead = s.schedule_ahead(decode)
    assert ahead.seqs == [seq] and ahead.num_tokens == [1]
    s.add(request("b", [40, 41, 42]))
    assert not s.schedule_ahead(decode)  # someone waits: the next step is scheduled as usual


@pytest.mark.parametrize("eviction", ["adaptive", "s3fifo", "lru", "fifo"])
def test_many_requests_through_a_small_pool_keep_the_page_states_consistent(eviction):
    s = make(num_pages=10, budget=8, eviction=eviction)
    for i in range(12):
        s.add(request(f"r{i}", [1 + i % 3] * 6 + list(range(100 + i, 106 + i)), max_tokens=3 + i % 4))
    run_to_end(s, limit=500)  # check_invariants after every step
    state = s.kv.state()
    assert state.in_use == 0 and state.free + state.cached == state.total


# -- fairness ----------------------------------------------------------------------------------------------
def test_fair_shares_give_small_needs_all_and_the_rest_to_the_large():
    assert fair_shares([40_000, 20], 512) == [492, 20]
    assert fair_shares([300, 300, 300], 512) == [170, 171, 171]
    assert fair_shares([5, 7], 512) == [5, 7]
    assert fair_shares([], 512) == []


def test_a_short_request_starts_at_once_beside_a_long_prefill():
    s = make(num_pages=64, budget=16)
    long = request("long", list(range(1, 200)), max_tokens=2)  # 199 prompt tokens: 13 steps alone
    s.add(long)
    step(s)
    short = request("short", list(range(300, 310)), max_tokens=3)
    s.add(short)
    scheduled = step(s)
    assert dict(zip([q.request_id for q in scheduled.seqs], scheduled.num_tokens)) == {"long": 8, "short": 8}
    step(s)  # short's last 2 prompt tokens, long the rest of the budget
    step(s)
    assert short.output_token_ids == [TOKEN, TOKEN]  # decoding while the long prompt still prefills
    assert long.in_prefill


def test_a_running_decode_gets_a_token_in_every_step_of_a_long_prefill():
    s = make(num_pages=128, budget=16)
    stream = request("stream", [5, 6, 7], max_tokens=100)
    s.add(stream)
    step(s)
    long = request("long", list(range(1, 300)), max_tokens=1)  # 299 prompt tokens: 20 steps or more
    s.add(long)
    steps = 0
    while not long.is_finished:
        if steps % 3 == 0:  # short requests come and go meanwhile, one prefill step and one token each
            s.add(request(f"short{steps}", list(range(400 + steps, 410 + steps)), max_tokens=1))
        before = len(stream.token_ids)
        scheduled = step(s)
        steps += 1
        assert dict(zip(scheduled.seqs, scheduled.num_tokens))[stream] == 1
        assert len(stream.token_ids) == before + 1
    assert steps >= 20 and not stream.is_finished


# -- prefix flights ----------------------------------------------------------------------------------------
SHARED = list(range(1, 33))  # 8 pages every request of a fan-out shares


def test_a_request_waits_for_the_shared_pages_a_running_prefill_computes():
    s = make(num_pages=64, budget=64)
    a, b = request("a", SHARED + [50, 51, 52]), request("b", SHARED + [60, 61, 62, 63, 64])
    s.add(a)
    s.add(b)
    first = step(s)
    assert [q.request_id for q in first.seqs] == ["a"]  # b's next page is in a's prefill
    run_to_end(s)
    assert b.num_cached_tokens == len(SHARED)  # it restored them instead
    assert s.counters.prefix_waiters == 1 and b.waited_for_prefix
    assert s.counters.computed_prompt_tokens == len(SHARED) + 3 + 5


def test_without_single_flight_a_fan_out_computes_the_prefix_twice():
    s = make(num_pages=64, budget=64, single_flight="off")
    s.add(request("a", SHARED + [50, 51, 52]))
    s.add(request("b", SHARED + [60, 61, 62, 63, 64]))
    run_to_end(s)
    assert s.counters.computed_prompt_tokens == 2 * len(SHARED) + 3 + 5


def test_a_waiter_computes_the_pages_itself_when_their_owner_is_aborted():
    s = make(num_pages=64, budget=8)
    owner, waiter = request("owner", SHARED + [50]), request("waiter", SHARED + [60, 61])
    s.add(owner)
    s.add(waiter)
    step(s)
    assert waiter.status.value == "waiting"
    s.finish(owner, "abort")
    run_to_end(s)
    assert waiter.finish_reason == "length" and waiter.output_token_ids == [TOKEN] * 4
    assert s.kv.state().in_use == 0
