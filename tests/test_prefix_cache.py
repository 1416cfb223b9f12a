"""Prefix cache in the engine: restore rule, publication timing, page sharing, eviction, collisions."""

import pytest
import xxhash

from minivllm import EngineConfig, SamplingParams
from minivllm.cache.eviction import LRU, Adaptive, make_policy
from minivllm.cache.page_pool import PagePool
from minivllm.engine.llm_engine import LLMEngine
from tests.test_engine import random_prompts

PAGE_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # one page of the tiny model in float32


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 8 << 20)
    kw.setdefault("single_flight", "off")
    return LLMEngine(EngineConfig(model=str(model_dir), **kw))


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run(engine, check=False):
    while engine.has_unfinished_requests():
        engine.step()
        if check:
            engine.check_invariants()


def generate(engine, rid, prompt, n=8):
    seq = engine.add_request(rid, prompt, greedy(n))
    run(engine)
    return seq


@pytest.mark.parametrize("n, restored", [(493, 480), (532, 528), (96, 80), (17, 16), (16, 0)])
def test_repeated_prompt_restores_whole_pages_but_the_last_token(tiny_model_dir, n, restored):
    engine = make_engine(tiny_model_dir, max_model_len=1024)
    prompt = random_prompts([n], seed=n)[0]
    cold = generate(engine, "cold", prompt)
    warm = generate(engine, "warm", prompt)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == restored
    assert warm.num_computed_prompt_tokens == n - restored
    assert warm.output_token_ids == cold.output_token_ids
    # every full page the cold run computed is published (the last sampled token has no KV yet);
    # the warm run's recomputed pages are twins of published ones and stay private
    assert cold.cache.num_pages_published == (n + 8 - 1) // 16
    assert warm.cache.num_pages_published == 0
    # the prompt tokens of the published pages: the prompt's whole pages, created by the cold run only
    assert cold.cache.num_published_prompt_tokens == n // 16 * 16
    assert warm.cache.num_published_prompt_tokens == 0
    stats = engine.stats()
    assert stats.prefix_hit_tokens == restored and stats.prefix_query_tokens == 2 * n


def start_and_decode(engine, rid, prompt, steps=3):
    seq = engine.add_request(rid, prompt, greedy(40))
    while len(seq.output_token_ids) < steps:
        engine.step()
    return seq


def test_incremental_publication_serves_a_request_that_is_still_decoding(tiny_model_dir):
    engine = make_engine(tiny_model_dir, publication="incremental")
    prompt = random_prompts([100], seed=1)[0]
    first = start_and_decode(engine, "first", prompt)
    second = engine.add_request("second", prompt, greedy(5))
    for _ in range(2):  # admitted in the next step (with overlap, in the one after the step in flight)
        engine.step()
        if second.num_computed_tokens:
            break
    assert not first.is_finished
    assert second.num_cached_tokens == 96
    # both share the same physical pages for the prefix
    assert second.cache.page_table[:6] == first.cache.page_table[:6]
    assert all(engine.kv.pool.refcount[p] == 2 for p in first.cache.page_table[:6])
    run(engine, check=True)


def test_completion_publication_restores_nothing_until_the_first_finishes(tiny_model_dir):
    engine = make_engine(tiny_model_dir, publication="completion")
    prompt = random_prompts([100], seed=2)[0]
    first = start_and_decode(engine, "first", prompt)
    second = engine.add_request("second", prompt, greedy(5))
    engine.step()
    assert not first.is_finished and second.num_cached_tokens == 0
    run(engine)
    third = generate(engine, "third", prompt)
    assert third.num_cached_tokens == 96


def test_generated_tokens_are_published_too(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts([20], seed=3)[0]
    first = generate(engine, "first", prompt, n=40)
    follow_up = generate(engine, "follow-up", first.token_ids + [5, 6, 7])
    assert follow_up.num_cached_tokens == (len(first.token_ids) - 1) // 16 * 16


def test_small_pool_evicts_only_unreferenced_pages(tiny_model_dir):
    engine = make_engine(tiny_model_dir, kv_cache_bytes=24 * PAGE_BYTES, max_num_seqs=3)
    for i, prompt in enumerate(random_prompts([70, 90, 50, 120, 80, 60], seed=4)):
        engine.add_request(f"r{i}", prompt, greedy(12))
    run(engine, check=True)
    stats = engine.stats()
    assert stats.pages_evicted > 0
    pool = engine.kv.pool
    assert pool.num_in_use == 0 and pool.num_free + pool.num_cached == pool.num_pages


@pytest.mark.parametrize("policy", ["adaptive", "lru", "fifo", "s3fifo"])
def test_every_policy_keeps_the_page_states_consistent(tiny_model_dir, policy):
    engine = make_engine(tiny_model_dir, kv_cache_bytes=20 * PAGE_BYTES, eviction=policy, max_num_seqs=2)
    shared = random_prompts([48], seed=5)[0]
    for i, tail in enumerate(random_prompts([20, 40, 30, 50], seed=6)):
        engine.add_request(f"r{i}", shared + tail, greedy(10))
    run(engine, check=True)
    again = generate(engine, "again", shared + [1, 2])
    assert again.num_cached_tokens in (0, 16, 32, 48)  # whatever survived, only whole shared pages


def test_a_hash_collision_is_caught_by_the_token_comparison(tiny_model_dir, monkeypatch):
    # every page of the same index collides: the hash ignores the tokens
    monkeypatch.setattr(
        "minivllm.cache.page_hash.hash_page", lambda parent, tokens: xxhash.xxh3_128_digest(parent)
    )
    engine = make_engine(tiny_model_dir)
    a, b = random_prompts([64, 64], seed=7)
    seq_a = generate(engine, "a", a)
    seq_b = generate(engine, "b", b)
    assert seq_b.cache.page_hashes[:3] == seq_a.cache.page_hashes[:3]  # the stub made them collide
    assert seq_b.num_cached_tokens == 0
    uncached = make_engine(tiny_model_dir, enable_prefix_caching=False)
    assert seq_b.output_token_ids == generate(uncached, "b", b).output_token_ids


def cached_chain(policy: str, n: int = 3) -> PagePool:
    """A pool of n + 1 pages holding one request's chain of n published pages, released."""
    pool = PagePool(n + 1, 2, make_policy(policy, n + 1))
    pages = pool.allocate(n)
    hashes = [bytes([97 + i]) for i in range(n)]  # b"a", b"b", ...
    for i, (page, h) in enumerate(zip(pages, hashes)):
        assert pool.publish(page, h, hashes[i - 1] if i else None, [i, i])
    pool.release(pages)
    assert pool.num_cached == n
    return pool


def test_pool_frees_unreachable_descendants_first():
    pool = cached_chain("lru")
    pool.allocate(2)  # 1 free page + 1 eviction: LRU evicts "a", so "b" and "c" are unreachable and freed
    assert pool.num_cached == 0 and pool.num_free == 2
    assert pool.counters.pages_unreachable == 2
    pool.check_invariants()


def test_prefix_aware_policy_gives_up_the_tail():
    pool = cached_chain("adaptive")
    pool.allocate(2)  # 1 free page + 1 eviction: the tail "c"
    assert set(pool.index) == {b"a", b"b"}
    assert pool.counters.pages_evicted == 1 and pool.counters.pages_unreachable == 0
    pool.check_invariants()


def test_pool_tells_the_policy_about_uses_tail_first_releases_and_parents():
    calls = []

    class Recording(Adaptive):
        def access(self, key, parent=None, partial=False):
            calls.append(("access", key, parent))
            return super().access(key, parent, partial)

        def release(self, key):
            calls.append(("release", key))
            super().release(key)

    pool = PagePool(8, 2, Recording(8))
    pages = pool.allocate(3)
    for i, h in enumerate([b"a", b"b", b"c"]):
        pool.publish(pages[i], h, [None, b"a", b"b"][i], [i, i])
    pool.acquire(pages[:2])  # a second request restores a and b
    pool.release(pages)  # the first request ends: c is cached, a and b still in use
    pool.release(pages[:2])
    assert calls == [
        ("access", b"a", None),
        ("access", b"b", b"a"),
        ("access", b"c", b"b"),
        ("access", b"a", None),
        ("access", b"b", b"a"),
        ("release", b"c"),
        ("release", b"b"),
        ("release", b"a"),
    ]


def test_invariants_catch_a_policy_that_claims_prefix_awareness_falsely():
    class NotPrefixAware(LRU):
        prefix_aware = True

    pool = cached_chain("lru")
    pool.policy = NotPrefixAware(4)
    for h in (b"a", b"b", b"c"):  # same state, released tail first
        pool.policy.access(h)
    pool.check_invariants()
    pool.allocate(2)  # evicts "a", the head
    with pytest.raises(AssertionError, match="prefix-aware"):
        pool.check_invariants()


def test_pool_publishes_nothing_below_an_unpublished_parent():
    pool = PagePool(4, 2, make_policy("s3fifo", 4))
    pages = pool.allocate(2)
    assert not pool.publish(pages[1], b"child", b"missing-parent", [1, 1])
    assert pool.publish(pages[0], b"root", None, [0, 0])
    assert not pool.publish(pages[1], b"root", None, [0, 0])  # a twin of a published page stays private
    pool.check_invariants()


# -- what a wrong page would break: each test fails if a page's KV is served where it does not belong ----
def test_equal_pages_under_different_prefixes_are_never_shared(tiny_model_dir, reference):
    # The second page of a and b has the same tokens but not the same KV: its keys and values depend on
    # the first page. b's own pages are what a repeat of b restores.
    engine = make_engine(tiny_model_dir, eviction="lru")
    first_a, first_b, shared, tail = random_prompts([16, 16, 16, 20], seed=8)
    a, b = first_a + shared + tail, first_b + shared + tail
    generate(engine, "a", a)
    generate(engine, "b", b)
    again = generate(engine, "b-again", b)
    assert again.num_cached_tokens == 48
    assert again.output_token_ids == reference.greedy(b, 8)


def test_an_aborted_prefill_leaves_only_its_computed_pages_to_restore(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=64, eviction="lru")
    prompt = random_prompts([200], seed=9)[0]
    engine.add_request("aborted", prompt, greedy(8))
    engine.step()  # the first 64-token chunk of the prompt; the other 136 tokens have no KV yet
    engine.abort_request("aborted")
    engine.step()
    again = generate(engine, "again", prompt)
    assert again.num_cached_tokens == 64
    assert again.output_token_ids == reference.greedy(prompt, 8)


def test_admission_with_many_hits_in_a_nearly_full_pool_waits_for_room(tiny_model_dir, reference):
    # 16 pages. A finished request leaves 10 cached pages; another one runs in the remaining ones. A
    # request restoring those 10 pages needs 4 more: it must count the 10 it pins as no longer
    # available and wait, not take pages the pool does not have.
    engine = make_engine(tiny_model_dir, kv_cache_bytes=16 * PAGE_BYTES, eviction="lru")
    cached_prompt, running_prompt, extension = random_prompts([160, 40, 56], seed=10)
    generate(engine, "first", cached_prompt, n=1)
    assert engine.kv.pool.num_cached == 10
    running = engine.add_request("running", running_prompt, greedy(30))
    engine.step()
    long_prompt = cached_prompt + extension
    restoring = engine.add_request("restoring", long_prompt, greedy(8))
    run(engine, check=True)
    assert restoring.num_cached_tokens == 160 and restoring.finish_reason == "length"
    assert restoring.output_token_ids == reference.greedy(long_prompt, 8)
    assert running.output_token_ids == reference.greedy(running_prompt, 30)


def test_default_policy_caches_a_long_prompt_at_first_sight(tiny_model_dir):
    # 400 tokens = 25 pages in a 75-page pool: a third of the pool, more than S3FIFO's small queue (8)
    n = 400
    prompt = random_prompts([n], seed=11)[0]
    restored = {}
    for policy in (None, "s3fifo"):
        kw = {} if policy is None else {"eviction": policy}
        engine = make_engine(tiny_model_dir, kv_cache_bytes=75 * PAGE_BYTES, max_model_len=1024, **kw)
        assert engine.config.eviction == (policy or "adaptive")
        generate(engine, "first", prompt)
        restored[policy] = generate(engine, "again", prompt).num_cached_tokens
        engine.check_invariants()
    assert restored[None] == (n - 1) // 16 * 16 == 384
    assert restored["s3fifo"] == 0  # page 0 went to S3FIFO's ghost while the prompt was published


@pytest.mark.parametrize("policy", ["adaptive", "lru"])
def test_concurrent_long_prompts_through_a_small_pool_leave_nothing_unreachable(tiny_model_dir, policy):
    # 60 pages; 8 distinct prompts of 5-14 pages, 4 at a time, then half of them again
    engine = make_engine(
        tiny_model_dir, kv_cache_bytes=60 * PAGE_BYTES, max_num_seqs=4, max_model_len=1024, eviction=policy
    )
    prompts = random_prompts([90, 150, 120, 200, 80, 170, 130, 220], seed=12)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"first{i}", prompt, greedy(10))
    run(engine, check=True)  # every step: every published page's parent is published
    for i, prompt in enumerate(prompts[::2]):
        engine.add_request(f"again{i}", prompt + [7, 8, 9], greedy(10))
    run(engine, check=True)
    stats = engine.stats()
    assert stats.pages_evicted > 0
    if policy == "adaptive":
        assert stats.pages_unreachable == 0  # check_invariants asserts it too (prefix-aware policy)
    else:
        assert stats.pages_unreachable > 0  # LRU gives up heads: the workload does strand pages
    pool = engine.kv.pool
    assert pool.num_in_use == 0 and pool.num_free + pool.num_cached == pool.num_pages
