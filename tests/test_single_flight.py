"""Exact-input single flight on the small random model."""

import pytest

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.engine.llm_engine import LLMEngine, new_sequence
from minivllm.engine.single_flight import FlightCoordinator
from tests.test_engine import random_prompts
from tests.tiny_model import BYTES_PER_PAGE

N = 100
RESTORED = (N - 1) // 16 * 16


def make_engine(model_dir, single_flight, **kw):
    kw.setdefault("publication", "completion")
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), kv_cache_bytes=8 << 20, max_num_seqs=8, single_flight=single_flight, **kw
        )
    )


def greedy(n=12):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(engine):
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()


@pytest.fixture(scope="module")
def prompt():
    return random_prompts([N], seed=11)[0]


@pytest.fixture(scope="module")
def independent_output(tiny_model_dir, prompt):
    engine = make_engine(tiny_model_dir, "off", enable_prefix_caching=False)
    seq = engine.add_request("solo", prompt, greedy())
    run(engine)
    return seq.output_token_ids


@pytest.mark.parametrize("mode", ["after_prefill", "at_completion"])
def test_eight_identical_prompts_compute_the_prompt_once(tiny_model_dir, prompt, independent_output, mode):
    engine = make_engine(tiny_model_dir, mode)
    seqs = [engine.add_request(f"r{i}", prompt, greedy()) for i in range(8)]
    run(engine)
    assert engine.stats().computed_prompt_tokens == N + 7 * (N - RESTORED)
    assert [s.flight_role for s in seqs] == ["leader"] + ["follower"] * 7
    assert [s.num_cached_tokens for s in seqs] == [0] + [RESTORED] * 7
    assert all(s.output_token_ids == independent_output for s in seqs)
    assert engine.stats().flights_opened == 1 and engine.stats().followers_coalesced == 7


def test_after_prefill_releases_followers_while_the_leader_decodes(tiny_model_dir, prompt):
    engine = make_engine(tiny_model_dir, "after_prefill")
    leader = engine.add_request("leader", prompt, greedy(30))
    follower = engine.add_request("follower", prompt, greedy(30))
    engine.step()  # the leader's whole prompt fits one step
    assert follower.status.value == "waiting"
    engine.step()
    assert follower.status.value == "running" and not leader.is_finished
    assert follower.num_cached_tokens == RESTORED
    run(engine)


def test_at_completion_holds_followers_until_the_leader_finishes(tiny_model_dir, prompt):
    engine = make_engine(tiny_model_dir, "at_completion")
    leader = engine.add_request("leader", prompt, greedy(10))
    follower = engine.add_request("follower", prompt, greedy(10))
    while not leader.is_finished:
        engine.step()
        assert follower.status.value == "waiting"
    run(engine)
    assert follower.num_cached_tokens == RESTORED


def test_followers_sample_with_their_own_parameters(tiny_model_dir, prompt, independent_output):
    engine = make_engine(tiny_model_dir, "after_prefill")
    leader = engine.add_request("greedy", prompt, greedy())
    hot = engine.add_request(
        "hot", prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    )
    run(engine)
    assert hot.flight_role == "follower" and hot.num_cached_tokens == RESTORED
    assert leader.output_token_ids == independent_output
    assert hot.output_token_ids != independent_output


def test_leader_aborted_mid_prefill_hands_over_to_the_oldest_follower(
    tiny_model_dir, prompt, independent_output
):
    engine = make_engine(tiny_model_dir, "after_prefill", max_num_batched_tokens=32)
    seqs = [engine.add_request(f"r{i}", prompt, greedy()) for i in range(4)]
    engine.step()  # the leader computed its first chunk only
    assert seqs[0].in_prefill
    engine.abort_request("r0")
    engine.step()
    assert seqs[1].flight_role == "leader" and seqs[1].status.value == "running"
    run(engine)
    assert seqs[0].finish_reason == "abort"
    assert all(s.finish_reason == "length" and s.output_token_ids == independent_output for s in seqs[1:])
    assert [s.num_cached_tokens for s in seqs[2:]] == [RESTORED, RESTORED]


def test_aborted_follower_leaves_the_others_alone(tiny_model_dir, prompt, independent_output):
    engine = make_engine(tiny_model_dir, "at_completion")
    seqs = [engine.add_request(f"r{i}", prompt, greedy()) for i in range(3)]
    engine.step()
    engine.abort_request("r1")
    run(engine)
    assert seqs[1].finish_reason == "abort" and seqs[1].output_token_ids == []
    assert seqs[0].output_token_ids == seqs[2].output_token_ids == independent_output
    assert seqs[2].num_cached_tokens == RESTORED


def test_distinct_and_partially_shared_prompts_are_never_coalesced(tiny_model_dir, prompt):
    engine = make_engine(tiny_model_dir, "after_prefill")
    other = random_prompts([N], seed=12)[0]
    partial = prompt[:-1] + [(prompt[-1] + 1) % 384]
    seqs = [engine.add_request(f"r{i}", p, greedy()) for i, p in enumerate([prompt, other, partial])]
    run(engine)
    assert [s.flight_role for s in seqs] == ["leader"] * 3
    assert engine.stats().followers_coalesced == 0


def test_off_reproduces_independent_execution(tiny_model_dir, prompt, independent_output):
    engine = make_engine(tiny_model_dir, "off")
    seqs = [engine.add_request(f"r{i}", prompt, greedy()) for i in range(4)]
    run(engine)
    assert engine.stats().computed_prompt_tokens == 4 * N
    assert all(s.num_cached_tokens == 0 and s.flight_role is None for s in seqs)
    assert all(s.output_token_ids == independent_output for s in seqs)


def test_preempted_leader_hands_over_before_publishing():
    flights = FlightCoordinator("at_completion")
    a, b, c = (new_sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(3))
    for s in (a, b, c):
        flights.join(s)
    flights.hand_over(a)
    assert b.flight_role == "leader" and flights.is_waiting(a) and flights.is_waiting(c)


def test_released_ids_are_kept_until_termination_and_unknown_ids_are_errors():
    flights = FlightCoordinator("after_prefill")
    leader, follower = (new_sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(2))
    flights.join(leader)
    flights.join(follower)
    flights.release(leader)
    assert not flights.flights and not flights.is_waiting(follower)
    again = new_sequence("r2", [1, 2, 3], SamplingParams())
    flights.join(again)
    assert again.flight_role == "leader"  # a later identical request starts a new flight
    flights.terminate(follower)
    flights.terminate(leader)
    with pytest.raises(KeyError, match="unknown"):
        flights.terminate(follower)


def test_a_preempted_leader_hands_its_flight_to_a_follower(tiny_model_dir, prompt, reference):
    # A small pool and an older request: the leader is the newest running request, so the first preempted,
    # before it could publish its pages (at_completion).
    page_bytes = 2 * 2 * 2 * 16 * 16 * 4
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            kv_cache_bytes=9 * page_bytes,
            single_flight="at_completion",
            eviction="lru",
        )
    )
    other, shared = random_prompts([40, 50], seed=4)
    engine.add_request("other", other, greedy(60))
    seqs = [engine.add_request(f"r{i}", shared, greedy(40)) for i in range(3)]
    first_token, finished, step = {}, {}, 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.new_token_ids:
                first_token.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = step
        engine.check_invariants()
    assert seqs[0].num_preemptions > 0
    # the oldest follower computed the prompt itself instead of waiting for the old leader to come back
    assert first_token["r1"] < finished["r0"]
    assert all(s.output_token_ids == reference.greedy(shared, 40) for s in seqs)


# -- prefix flights: a fan-out that shares a long prefix computes it once ------------------------------------
@pytest.mark.parametrize("budget", [512, 8192])
def test_a_fan_out_sharing_a_long_prefix_computes_it_once(tiny_model_dir, reference, budget):
    shared, *suffixes = random_prompts([1370, 12, 15, 9, 20, 11, 14], seed=28)
    prompts = [shared + s for s in suffixes]
    llm = LLM(tiny_model_dir, kv_cache_bytes=64 << 20, max_num_batched_tokens=budget)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    computed = llm.engine.stats().computed_prompt_tokens
    ideal = len(shared) + sum(len(s) for s in suffixes)
    assert computed <= 1.3 * ideal, (computed, ideal)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference.greedy(prompt, 4)
    llm.engine.check_invariants()


def test_the_waiters_of_a_preempted_prefix_owner_finish_correctly(tiny_model_dir, reference):
    """A pool too small for everyone: the owner of the shared prefix is preempted or waits; whoever
    computes the prefix, every answer is the one it gets alone and no page is lost."""
    shared, *suffixes = random_prompts([200, 9, 13, 7], seed=29)
    prompts = [shared + s for s in suffixes]
    llm = LLM(tiny_model_dir, kv_cache_bytes=24 * BYTES_PER_PAGE, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    assert llm.engine.stats().preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference.greedy(prompt, 60)
    assert llm.engine.kv.state().in_use == 0
