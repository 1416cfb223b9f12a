"""The default policy against LRU and the seed's S3FIFO on small adversarial traces (the full-size suite is
benchmarks/replay_robustness.py): it must keep at least 97% of the better one's token hit rate, and leave
nothing unreachable. Capacities keep the largest request under a third of the cache, as in the real traces.
On the two Mooncake traces (when present) it must reach the hit-rate floors the policy was accepted on. On
forests of growing conversations where LRU holds the working set, it must reach 98.5% of the infinite cache."""

from functools import cache
from pathlib import Path

import pytest

from benchmarks.adversarial_traces import (
    agent_sessions,
    conversation_forest,
    recency_forest,
    rotating_prompts,
    windows,
)
from benchmarks.trace_families import draw, forest, revisits
from minivllm.cache.eviction import CONFIGURATIONS, FollowedS3FIFO, Segmented
from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import load_trace, replay, replay_cache

SMALL = dict(prompt_blocks=(5, 15), scan_blocks=(10, 50), turn_blocks=(1, 3))
TRACES = {
    "agent": lambda: agent_sessions(0, n_requests=400, **SMALL),
    "rotating-prompts": lambda: rotating_prompts(1, n_requests=400, prompt_lifetime=150, **SMALL),
    "forest": lambda: conversation_forest(2, n_requests=600, active=40, mean_turns=8),
    "forest-zipf": lambda: conversation_forest(3, n_requests=600, active=12, mean_turns=10, zipf=1.0),
    "recency-forest": lambda: recency_forest(4, n_requests=600, stay_prob=0.8),
    "growing-forest": lambda: forest(6, n_requests=800, live=40, n_systems=5),
    "agent-long-prompts": lambda: agent_sessions(
        5, n_requests=400, n_prompts=6, prompt_blocks=(20, 40), active=24, scan_prob=0.0, turn_blocks=(1, 4)
    ),
    # popular prompts beside one-off prompts that return after a long pause (0.965x at 500 blocks when
    # only the long memory's configurations were followed)
    "revisits": lambda: revisits(1, n_requests=1500, hot=6, prompt_blocks=(5, 15), gap=(60, 240)),
}
TRACES_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
FLOORS = {  # (trace, capacity in blocks) -> the least token hit rate accepted
    ("mooncake_conversation_trace", 1000): 0.0753,
    ("mooncake_conversation_trace", 10000): 0.2330,
    ("mooncake_synthetic_trace", 1000): 0.0920,
    ("mooncake_synthetic_trace", 10000): 0.4462,
}


@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("capacity", [150, 500])
def test_default_policy_keeps_97_percent_of_the_better_baseline(name, capacity):
    trace = TRACES[name]()
    ours = replay(trace, DEFAULT_EVICTION, capacity)
    best = max(replay(trace, p, capacity).token_hit_rate for p in ("lru", "s3fifo"))
    assert ours.token_hit_rate >= 0.97 * best
    assert ours.unreachable_blocks == 0


# Forests of growing conversations over shared system prompts (each turn continues the previous prompt,
# partial last block included): the shape of agent and chat traffic, where LRU is the right answer.
FORESTS = {  # 120 live conversations outgrow 1,000 blocks (LRU 0.74 of 0.75): that case is left out
    "120-live-10-systems": lambda: forest(12, n_requests=3000, live=120, n_systems=10, continue_prob=0.5),
    "50-live-6-systems": lambda: forest(11, n_requests=3000, live=50, n_systems=6, continue_prob=0.6),
    "30-live-4-systems": lambda: forest(13, n_requests=3000, live=30, n_systems=4, continue_prob=0.7),
}


# 120 live conversations fill 3,000 blocks two thirds into the trace: the LRU configuration's lead must
# pass the noise test in the last third (it stood 14 deviations above its noise, short of a fixed 1.5% of
# the window, 0.978-0.983x the infinite cache)
LATE_FILL = {
    "120-live-late-fill": lambda: forest(22, n_requests=3000, live=120, n_systems=10, continue_prob=0.55)
}
# Popular prompts beside one-off prompts that return 50-300 requests later (family_robustness's revisits#15
# and #42): the cache ran ARC with a long memory and switched to the LRU configuration only once its lead
# passed two deviations, after it had given up the prompts that then returned (0.984 and 0.981 of the
# infinite cache). At the bound, one deviation: 0.996 and 0.990.
RETURNING = {
    "revisits-4-hot": lambda: revisits(
        15, n_requests=3000, hot=4, hot_prob=0.35, prompt_blocks=(5, 20), soon_prob=0.6, gap=(50, 300)
    ),
    "revisits-40-hot": lambda: revisits(
        42, n_requests=3000, hot=40, hot_prob=0.31, prompt_blocks=(5, 20), soon_prob=0.3, gap=(50, 300)
    ),
}


@pytest.mark.parametrize(
    ("name", "capacity"),
    [(name, c) for name in FORESTS for c in (1000, 2000)][1:]
    + [(name, 3000) for name in LATE_FILL]
    + [("revisits-4-hot", 3000), ("revisits-40-hot", 10000)],
)
def test_where_lru_holds_the_working_set_the_default_nearly_does(name, capacity):
    trace = {**FORESTS, **LATE_FILL, **RETURNING}[name]()
    infinite = replay(trace, "infinite", capacity).token_hit_rate
    assert replay(trace, "lru", capacity).token_hit_rate >= 0.995 * infinite  # the case the test is about
    assert replay(trace, DEFAULT_EVICTION, capacity).token_hit_rate >= 0.985 * infinite


@cache
def _load_mooncake(name: str) -> list | None:
    path = TRACES_DIR / f"{name}.jsonl"
    return load_trace(path) if path.is_file() else None


def mooncake(name: str) -> list:
    """A Mooncake trace, read once for all the tests; the test is skipped where the traces are absent."""
    trace = _load_mooncake(name)
    if trace is None:
        pytest.skip(f"{TRACES_DIR / name}.jsonl not found")
    return trace


@pytest.mark.parametrize(("name", "capacity"), FLOORS)
def test_default_policy_reaches_the_floors_on_the_mooncake_traces(name, capacity):
    assert replay(mooncake(name), DEFAULT_EVICTION, capacity).token_hit_rate >= FLOORS[name, capacity]


@pytest.mark.parametrize("third", range(3))
@pytest.mark.parametrize("name", sorted({name for name, _ in FLOORS}))
def test_default_policy_keeps_97_percent_on_each_third_of_the_mooncake_traces(name, third):
    """Where every policy hits little (the synthetic trace's first third, 1k blocks: under 2%), a switch
    between the default's configurations at a small lead cost it 9% against LRU."""
    trace = windows(mooncake(name), 3)[third]
    best = max(replay(trace, p, 1000).token_hit_rate for p in ("lru", "s3fifo"))
    assert replay(trace, DEFAULT_EVICTION, 1000).token_hit_rate >= 0.97 * best


def test_a_lead_of_a_block_right_after_the_pool_fills_does_not_switch_the_default():
    """The synthetic trace's second third at 1k blocks: ARC proper, the configuration the cache starts in,
    alone hits 0.048 of the tokens, LRU 0.027. Right after the pool fills, every shadow is at the bound and
    LRU led by one block: following it there kept the cache on LRU's pages for thousands of requests
    (0.035)."""
    trace = windows(mooncake("mooncake_synthetic_trace"), 3)[1]
    arc = replay_cache(trace, Segmented(1000, 4.0, *CONFIGURATIONS[0]), "arc").token_hit_rate
    assert replay(trace, DEFAULT_EVICTION, 1000).token_hit_rate >= 0.97 * arc


def test_following_s3fifo_the_cache_gives_up_what_lies_under_a_page_s3fifo_gave_up():
    """Zipf prompts at 1k blocks (a drawn case of benchmarks/family_robustness.py). S3FIFO gives up a
    prompt's first pages first; a cache holding S3FIFO's keys, which can give a prompt up only from its end,
    gave up other prompts' ends instead while it kept the pages under them (the default following S3FIFO:
    0.954x S3FIFO; the followed shadow alone 0.995x, and 1.049x once it gives up what lies under)."""
    trace = draw("zipf", 98).requests()
    s3fifo = replay(trace, "s3fifo", 1000).token_hit_rate
    assert replay_cache(trace, FollowedS3FIFO(1000), "followed").token_hit_rate >= s3fifo
    best = max(s3fifo, replay(trace, "lru", 1000).token_hit_rate)
    assert replay(trace, DEFAULT_EVICTION, 1000).token_hit_rate >= 0.97 * best


@pytest.mark.parametrize("seed", [233, 538])
def test_the_default_keeps_hot_prompts_while_long_one_off_prompts_pass(seed):
    """Popular prompts of 20-80 blocks beside one-off prompts, at 1k blocks (drawn cases of
    benchmarks/family_robustness.py). The pages of the prompt being read stay, so the cache gives up hot
    pages for them, and which ones decides the hits.

    scan#233, one-off prompts of 20-100 blocks: S3FIFO run as a cache that keeps pages in use gives up
    popular pages while a long one-off prompt is read; ARC's segments with S3FIFO's shares give up the
    pages of earlier one-off prompts first (alone: 0.1282 of the tokens against 0.1165). With S3FIFO the
    only expert of its kind the default reached 0.914x the better of LRU and S3FIFO.

    scan#538, one-off prompts of 50-300 blocks on 60% of the requests: ARC's recency with S3FIFO's shares
    and a memory of one capacity, the best configuration alone before, reached 0.966x, the default 0.940x;
    frequency with half a capacity of memory alone 0.987x."""
    trace = draw("scan", seed).requests()
    best = max(replay(trace, p, 1000).token_hit_rate for p in ("lru", "s3fifo"))
    assert replay(trace, DEFAULT_EVICTION, 1000).token_hit_rate >= 0.97 * best
