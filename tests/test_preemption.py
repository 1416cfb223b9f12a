"""Preemption under a small KV pool: true usage counters, no churn, and a request that can never fit."""

from minivllm import EngineConfig, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sequence import SequenceStatus
from tests.test_engine import random_prompts

PAGE_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # one page of the tiny model in float32


def make_engine(model_dir, pages: int, **kw) -> LLMEngine:
    kw.setdefault("eviction", "lru")  # keeps every published page while there is room
    kw.setdefault("single_flight", "off")
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_bytes=pages * PAGE_BYTES, **kw))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(engine: LLMEngine, seqs) -> list[int]:
    """Step to the end, checking invariants. Returns the ids of requests readmitted in the very step
    that preempted them (churn: there must be none)."""
    churned = []
    while engine.has_unfinished_requests():
        preempted_before = [s.num_preemptions for s in seqs]
        engine.step()
        engine.check_invariants()
        churned += [
            s.request_id
            for s, before in zip(seqs, preempted_before)
            if s.num_preemptions > before and s.status == SequenceStatus.RUNNING
        ]
    return churned


def test_cached_tokens_count_only_prompt_tokens_restored_at_first_admission(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, pages=16)
    *cold, warm = random_prompts([20, 25, 30, 35], seed=2)
    engine.add_request("warm-up", warm, greedy(1))  # publishes the warm prompt's 2 full pages
    run(engine, [])
    seqs = [engine.add_request(f"r{i}", p, greedy(60)) for i, p in enumerate(cold + [warm])]
    run(engine, seqs)
    assert engine.stats().preemptions > 0 and all(s.num_preemptions for s in seqs[2:])
    # readmission restores pages (the request's own generated ones too) but that is not a prompt cache hit
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0, 32]
    stats = engine.stats()
    assert stats.prefix_lookups == 5
    assert stats.prefix_query_tokens == 35 + 20 + 25 + 30 + 35
    assert stats.prefix_hit_tokens == 32
    assert [s.output_token_ids for s in seqs] == [reference.greedy(p, 60) for p in cold + [warm]]


def test_a_preempted_request_is_not_readmitted_in_the_step_that_preempted_it(tiny_model_dir, reference):
    # Two identical prompts computed side by side (single flight off): the second one's pages are private
    # twins of the first one's published pages. Preempted, it would fit again at once by restoring the
    # first one's pages, and be preempted again by the next page the older request needs.
    engine = make_engine(tiny_model_dir, pages=11)
    older, twin = random_prompts([40, 50], seed=1)
    seqs = [
        engine.add_request("older", older, greedy(80)),
        engine.add_request("twin-1", twin, greedy(30)),
        engine.add_request("twin-2", twin, greedy(30)),
    ]
    assert run(engine, seqs) == []
    assert engine.stats().preemptions > 0
    assert [s.output_token_ids for s in seqs] == [
        reference.greedy(older, 80),
        *[reference.greedy(twin, 30)] * 2,
    ]


def test_a_request_that_can_never_fit_is_stopped_without_preempting_the_others(tiny_model_dir, reference):
    # 12 pages: the giant's prompt takes 8, two small requests 2 each and stay within them. The giant's
    # 420 tokens would need 27 pages: when it needs a 9th page, it is stopped rather than push them out.
    engine = make_engine(tiny_model_dir, pages=12)
    # LLMEngine clamps its context to what the pool holds (192 tokens here), so through it no request can
    # outgrow the pool; the scheduler's own guard is checked with the model's whole context, unclamped.
    assert engine.max_model_len == 12 * 16
    engine.max_model_len = engine.scheduler.max_model_len = 2048
    big, *small = random_prompts([120, 17, 17], seed=5)
    giant = engine.add_request("giant", big, greedy(300))
    others = [engine.add_request(f"small-{i}", p, greedy(14)) for i, p in enumerate(small)]
    while not giant.is_finished:
        (last,) = [o for o in engine.step() if o.request_id == "giant"] or [None]
        engine.check_invariants()
    assert giant.finish_reason == "length" and len(giant.output_token_ids) == 9  # 8 pages hold 128 KV tokens
    assert "27 KV pages" in last.error and "the pool has 12" in last.error
    assert all(s.status == SequenceStatus.RUNNING for s in others)
    run(engine, others)
    assert engine.stats().preemptions == 0
    assert giant.output_token_ids == reference.greedy(big, 9)
    assert [s.output_token_ids for s in others] == [reference.greedy(p, 14) for p in small]
    assert engine.kv.pool.num_in_use == 0
