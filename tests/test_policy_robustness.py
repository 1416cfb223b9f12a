"""The default policy against LRU and the seed's S3FIFO on small adversarial traces (the full-size suite is
benchmarks/replay_robustness.py): it must keep at least 97% of the better one's token hit rate, and leave
nothing unreachable. Capacities keep the largest request under a third of the cache, as in the real traces."""

import pytest

from benchmarks.adversarial_traces import agent_sessions, conversation_forest, rotating_prompts
from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import replay

SMALL = dict(prompt_blocks=(5, 15), scan_blocks=(10, 50), turn_blocks=(1, 3))
TRACES = {
    "agent": lambda: agent_sessions(0, n_requests=400, **SMALL),
    "rotating-prompts": lambda: rotating_prompts(1, n_requests=400, prompt_lifetime=150, **SMALL),
    "forest": lambda: conversation_forest(2, n_requests=600, active=40, mean_turns=8),
    "forest-zipf": lambda: conversation_forest(3, n_requests=600, active=12, mean_turns=10, zipf=1.0),
}


@pytest.mark.parametrize("name", TRACES)
@pytest.mark.parametrize("capacity", [150, 500])
def test_default_policy_keeps_97_percent_of_the_better_baseline(name, capacity):
    trace = TRACES[name]()
    ours = replay(trace, DEFAULT_EVICTION, capacity)
    best = max(replay(trace, p, capacity).token_hit_rate for p in ("lru", "s3fifo"))
    assert ours.token_hit_rate >= 0.97 * best
    assert ours.unreachable_blocks == 0
