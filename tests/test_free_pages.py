"""Page placement: a request's pages stay consecutive where they can, so its attention reads few runs."""

import random

import pytest

from kernels.paged_attention import page_runs
from minivllm import LLM, SamplingParams
from minivllm.cache.free_pages import FreePages


def runs(pages: list[int]) -> int:
    return len(page_runs(pages, 1, len(pages)))


def test_a_growing_request_takes_the_next_page():
    free = FreePages(64)
    pages = free.take(8)
    assert runs(pages) == 1
    for _ in range(10):
        pages += free.take(1, after=pages[-1])
    assert runs(pages) == 1 and len(free) == 64 - 18


def test_requests_growing_together_keep_their_own_runs():
    free = FreePages(256)
    tables = [free.take(8) for _ in range(4)]
    for _ in range(20):  # one page each in turn, as decode steps do
        for table in tables:
            table += free.take(1, after=table[-1])
    assert all(runs(t) == 1 for t in tables), [page_runs(t, 1, len(t)) for t in tables]
    assert len({p for t in tables for p in t}) == 4 * 28  # no page handed out twice


def test_a_new_run_splits_the_largest_gap():
    free = FreePages(100)
    first = free.take(10)
    assert first == list(range(45, 55))  # room before and after it
    taken = free.take(1, after=first[-1])
    assert taken == [55]
    second = free.take(4)  # gaps 0..44 and 56..99: in the middle of the larger
    assert second == list(range(20, 24))


def test_taking_more_than_the_largest_gap_spans_gaps():
    free = FreePages(10)
    for page in (2, 5, 6):
        free._free.remove(page)
    pages = free.take(7)
    assert sorted(pages) == [0, 1, 3, 4, 7, 8, 9] and len(free) == 0
    with pytest.raises(AssertionError, match="freed twice"):
        free.add(pages[0]) or free.add(pages[0])


def test_concurrent_decodes_in_the_engine_keep_their_contexts_in_few_runs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=8 << 20, max_num_seqs=6, enable_prefix_caching=False,
              single_flight="off")  # fmt: skip
    engine = llm.engine
    rng = random.Random(0)
    for i in range(6):
        engine.add_request(f"r{i}", [rng.randrange(384) for _ in range(40 + 7 * i)],
                           SamplingParams(max_tokens=120, ignore_eos=True))  # fmt: skip
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max([most] + [runs(s.cache.page_table) for s in engine.scheduler.running])
    assert most <= 2
