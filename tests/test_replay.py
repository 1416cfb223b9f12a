"""Trace replay: prefix-hit accounting, offline policies, trace validation, CLI."""

import json
import random

import pytest

from minivllm.config import DEFAULT_EVICTION
from minivllm.replay import (
    REPLAY_POLICIES,
    Belady,
    BeladyPrefix,
    TraceError,
    TraceRequest,
    format_table,
    load_trace,
    main,
    make_cache,
    prefix_hits,
    replay,
    replay_cache,
    replay_tiers,
    sweep,
)

BS = 512


def req(hash_ids, length=None):
    return TraceRequest(list(hash_ids), len(hash_ids) * BS if length is None else length)


def write_trace(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def random_prefix_trace(seed, n=200):
    """Chained-hash requests: each extends a random prefix of an earlier one with fresh blocks."""
    rng = random.Random(seed)
    prompts, next_id, reqs = [[]], 0, []
    for _ in range(n):
        base = rng.choice(prompts)
        ids = base[: rng.randint(0, len(base))]
        for _ in range(rng.randint(1, 6)):
            ids.append(next_id)
            next_id += 1
        prompts.append(ids)
        reqs.append(req(ids, len(ids) * BS - rng.randint(0, BS - 1)))
    return reqs


# --- accounting ---


@pytest.mark.parametrize("policy", REPLAY_POLICIES)
def test_prefix_scan_stops_at_first_miss(policy):
    trace = [
        req([1, 2, 3]),  # cold: k = 0, and blocks accessed by this request don't count for it
        req([9, 2, 3]),  # 2 and 3 are resident but h_0 = 9 misses: k = 0
        req([1, 2, 7, 3]),  # 1, 2 hit, 7 misses; 3 resident but after the miss: k = 2
    ]
    r = replay(trace, policy, capacity=100)
    assert r.hit_blocks == 2
    assert r.hit_tokens == 2 * BS
    assert r.total_blocks == 10
    assert r.total_tokens == 10 * BS
    assert r.token_hit_rate == pytest.approx(2 / 10)


def test_prefix_hits_yields_each_requests_hit_and_replays_the_whole_trace():
    trace = [req([1, 2, 3]), req([9, 2, 3]), req([1, 2, 7, 3])]
    cache = make_cache(trace, "lru", 100)
    hits = prefix_hits(trace, cache)
    assert next(hits) == 0 and 3 in cache  # a request's blocks are accessed once its count is yielded
    assert list(hits) == [0, 2]
    trace = random_prefix_trace(3)
    cache = make_cache(trace, DEFAULT_EVICTION, 40)
    assert sum(prefix_hits(trace, cache)) == replay(trace, DEFAULT_EVICTION, 40).hit_blocks
    assert set(trace[-1].hash_ids) <= set(cache)


def test_replay_cache_counts_the_hits_a_caller_watches_pass():
    # benchmarks/replay_alone.py records the default's switches between requests this way
    trace = random_prefix_trace(4)
    cache = make_cache(trace, DEFAULT_EVICTION, 40)
    seen = []

    def watch(hits):
        for k in hits:
            seen.append(k)
            yield k

    r = replay_cache(trace, cache, DEFAULT_EVICTION, hits=watch(prefix_hits(trace, cache)))
    assert len(seen) == len(trace) and sum(seen) == r.hit_blocks > 0
    assert r.hit_blocks == replay(trace, DEFAULT_EVICTION, 40).hit_blocks


def test_hit_tokens_clamped_to_input_length():
    trace = [req([1, 2], 700), req([1, 2], 700), req([1, 2], 1024)]
    r = replay(trace, "lru", capacity=10)
    # second request: k = 2 -> min(1024, 700) = 700; third: min(1024, 1024)
    assert r.hit_tokens == 700 + 1024
    assert r.total_tokens == 700 + 700 + 1024


def test_eviction_lowers_hits_and_capacity_one_counts_nothing_here():
    trace = [req([1, 2]), req([3]), req([1, 2])]
    assert replay(trace, "lru", capacity=3).hit_blocks == 2
    assert replay(trace, "lru", capacity=1).hit_blocks == 0


@pytest.mark.parametrize("cls", [Belady, BeladyPrefix])
def test_belady_evicts_farthest_next_use(cls):
    cache = cls(2, [req([1, 2]), req([3]), req([1])])
    cache.access(1)
    cache.access(2, 1)
    # 1 is used again at access 3, 2 never again: 2 goes
    assert cache.access(3) == [2]
    assert 1 in cache and 3 in cache


@pytest.mark.parametrize("cls", [Belady, BeladyPrefix])
def test_belady_ties_evict_the_deeper_block(cls):
    cache = cls(2, [req([1, 2]), req([3])])
    cache.access(1)
    cache.access(2, 1)
    # neither 1 (position 0) nor 2 (position 1) is used again: the deeper one, 2, goes
    assert cache.access(3) == [2]


def test_belady_prefix_never_keeps_a_child_without_its_parent():
    trace = [req([5]), req([1, 2])]  # 1 and 2 are never used again, 5 is never used again either
    belady, prefix = Belady(1, trace), BeladyPrefix(1, trace)
    for cache in (belady, prefix):
        cache.access(5)
        cache.access(1)  # evicts 5
        cache.access(2, 1)  # the farthest is 1 (tie, then the only resident block)
    assert list(belady) == [2]  # cached, but its parent is not: unreachable
    assert list(prefix) == []  # 1 went and 2, which nothing could reach, was not admitted


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("capacity", [8, 30])
def test_belady_beats_online_policies_and_infinite_beats_belady(seed, capacity):
    trace = random_prefix_trace(seed)
    best = replay(trace, "belady", capacity).hit_tokens
    best_prefix = replay(trace, "belady-prefix", capacity).hit_tokens
    for policy in ("adaptive", "s3fifo", "lru", "fifo"):
        assert replay(trace, policy, capacity).hit_tokens <= min(best, best_prefix)
    assert replay(trace, "infinite", capacity).hit_tokens >= max(best, best_prefix)


@pytest.mark.parametrize("seed", range(3))
def test_unreachable_blocks_counted_and_none_under_prefix_aware_policies(seed):
    trace = random_prefix_trace(seed, n=300)
    counts = {policy: replay(trace, policy, 20).unreachable_blocks for policy in REPLAY_POLICIES}
    assert counts["adaptive"] == counts["belady-prefix"] == counts["infinite"] == 0
    assert counts["lru"] > 0 and counts["fifo"] > 0 and counts["s3fifo"] > 0


def test_unreachable_blocks_by_hand():
    # capacity 2, LRU: [1, 2] then [3]: 1 is the least recent and goes; 2 stays without its parent
    r = replay([req([1, 2]), req([3])], "lru", 2)
    assert r.unreachable_blocks == 1
    # the adaptive policy releases [1, 2] tail first and gives up the tail, 2
    assert replay([req([1, 2]), req([3])], "adaptive", 2).unreachable_blocks == 0


def test_default_resolves_to_the_engine_default():
    trace = random_prefix_trace(0, n=50)
    r = replay(trace, "default", 10)
    assert r.policy == DEFAULT_EVICTION == "adaptive"
    assert r == replay(trace, DEFAULT_EVICTION, 10)


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="unknown policy"):
        replay([req([1])], "arc", 10)


def test_sweep_rows_and_table():
    trace = random_prefix_trace(0, n=30)
    rows = sweep(trace, ["lru", "infinite"], [5, 50])
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        ("lru", 5),
        ("lru", 50),
        ("infinite", 5),
        ("infinite", 50),
    ]
    table = format_table(rows).splitlines()
    assert table[0] == "| capacity (blocks) | lru | infinite |"
    assert table[2].startswith("| 5 | ")
    assert len(table) == 4


# --- loading ---


def test_load_trace_skips_blank_lines(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 3, "input_length": 600, "output_length": 5, "hash_ids": [4, 5]}',
            "",
            '{"input_length": 10, "hash_ids": []}',
        ],
    )
    reqs = load_trace(path)
    assert reqs == [TraceRequest([4, 5], 600, 3.0), TraceRequest([], 10, None)]


@pytest.mark.parametrize(
    "bad, why",
    [
        ('{"input_length": 5, "hash_ids": [1,', "bad JSON"),
        ('{"input_length": 5}', "hash_ids"),
        ('{"hash_ids": [1]}', "input_length"),
        ('{"input_length": 5, "hash_ids": [1, "2"]}', "hash_ids"),
        ('{"input_length": 5, "hash_ids": [1, 2.0]}', "hash_ids"),
        ('{"input_length": 5, "hash_ids": [true]}', "hash_ids"),  # bools are not ints
        ('{"input_length": -1, "hash_ids": [1]}', "input_length"),
        ('{"input_length": 5.5, "hash_ids": [1]}', "input_length"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_trace_lines_name_file_and_line(tmp_path, bad, why):
    good = '{"input_length": 5, "hash_ids": [1]}'
    path = write_trace(tmp_path / "t.jsonl", [good, "", bad, good])
    with pytest.raises(TraceError, match=why) as info:
        load_trace(path)
    assert f"{path}:3:" in str(info.value)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "none.jsonl")


# --- CLI ---


@pytest.fixture
def trace_file(tmp_path):
    lines = [
        json.dumps({"input_length": r.input_length, "hash_ids": r.hash_ids})
        for r in random_prefix_trace(1, 40)
    ]
    return write_trace(tmp_path / "t.jsonl", lines)


def test_cli_json_keys(trace_file, capsys):
    assert main([str(trace_file), "--policy", "s3fifo", "--capacity", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "policy",
        "hit_tokens",
        "total_tokens",
        "token_hit_rate",
        "hit_blocks",
        "total_blocks",
        "unreachable_blocks",
    }
    expected = replay(load_trace(trace_file), "s3fifo", 20)
    assert out["hit_tokens"] == expected.hit_tokens
    assert out["policy"] == "s3fifo"


def test_cli_default_policy_is_resolved_in_the_json(trace_file, capsys):
    assert main([str(trace_file), "--policy", "default", "--capacity", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == DEFAULT_EVICTION
    assert out["token_hit_rate"] == replay(load_trace(trace_file), DEFAULT_EVICTION, 20).token_hit_rate
    assert out["unreachable_blocks"] == 0


def test_cli_history_reaches_the_adaptive_policy(trace_file, capsys):
    trace = load_trace(trace_file)
    for history in ("0.5", "8"):
        args = [str(trace_file), "--policy", "adaptive", "--capacity", "10", "--history", history, "--json"]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["hit_tokens"] == replay(trace, "adaptive", 10, history=float(history)).hit_tokens


def test_cli_plain_output_is_labelled(trace_file, capsys):
    assert main([str(trace_file), "--policy", "lru", "--capacity", "20"]) == 0
    labels = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert labels == [
        "policy",
        "hit tokens",
        "total tokens",
        "token hit rate",
        "hit blocks",
        "total blocks",
        "unreachable blocks",
    ]


def test_cli_sweep_prints_table_and_writes_plot(trace_file, tmp_path, capsys):
    png = tmp_path / "out.png"
    args = [
        str(trace_file),
        "--sweep",
        "--policies",
        "lru,belady",
        "--capacities",
        "5,50",
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[0] == "| capacity (blocks) | lru | belady |"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_trace_exits_2_without_traceback(tmp_path, capsys):
    path = write_trace(tmp_path / "bad.jsonl", ['{"input_length": 5, "hash_ids": [1]}', "not json"])
    assert main([str(path), "--policy", "lru", "--capacity", "5"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["--policy", "arc", "--capacity", "5"],
        ["--policy", "lru", "--capacity", "0"],
        ["--policy", "lru"],
        ["--policy", "s3fifo", "--capacity", "5", "--small-ratio", "2"],
        ["--policy", "adaptive", "--capacity", "5", "--history", "0"],
        ["--sweep", "--capacities", "5", "--policies", "lru,arc"],
        ["--sweep", "--capacities", "5,x"],
        ["--sweep"],
        ["--policy", "lru", "--capacity", "5", "--disk-policy", "lru"],
        ["--policy", "lru", "--capacity", "5", "--disk-capacity", "-1"],
        ["--sweep", "--capacities", "5", "--disk-capacity", "10"],
        ["--policy", "lru", "--capacity", "5", "--disk-capacity", "10", "--disk-writes", "never"],
    ],
)
def test_cli_bad_args_exit_2(trace_file, args, capsys):
    assert main([str(trace_file), *args]) == 2
    assert capsys.readouterr().err


def test_partial_last_block_is_flagged_to_the_policy():
    # capacity 3: [9], then [1, 2] whose block 2 is partial (700 < 1024 tokens), then [3] needs a victim:
    # the adaptive policy takes the partial block, not 9, the least recently released, so [9] hits
    trace = [req([9]), req([1, 2], 700), req([3]), req([9])]
    assert replay(trace, "adaptive", 3).hit_blocks == 1
    full = [req([9]), req([1, 2]), req([3]), req([9])]  # the same with a full last block: 9 goes
    assert replay(full, "adaptive", 3).hit_blocks == 0


# --- two tiers ---


def test_a_lookup_walks_ram_then_continues_on_disk():
    # RAM of 3 blocks (LRU) over a disk of 10: C finds block 1 in RAM (B used it), 2 and 3 on disk only
    trace = [req([1, 2, 3]), req([1, 5, 6]), req([1, 2, 3])]
    r = replay_tiers(trace, "lru", 3, 10)
    assert (r.ram_hit_tokens, r.disk_hit_tokens) == (2 * BS, 2 * BS)  # B: block 1; C: block 1 + blocks 2, 3
    assert r.hit_tokens == r.ram_hit_tokens + r.disk_hit_tokens
    assert r.token_hit_rate == pytest.approx(r.ram_hit_rate + r.disk_hit_rate) == pytest.approx(4 / 9)
    assert (r.blocks_written, r.blocks_read, r.blocks_evicted) == (5, 2, 0)


def test_without_a_disk_two_tiers_are_the_single_replay():
    trace = random_prefix_trace(3)
    for policy in ("adaptive", "lru", "belady"):
        single, tiered = replay(trace, policy, 40), replay_tiers(trace, policy, 40, 0)
        assert tiered.hit_tokens == tiered.ram_hit_tokens == single.hit_tokens
        assert tiered.blocks_written == tiered.disk_hit_tokens == 0


def test_a_disk_as_large_as_the_trace_reaches_the_infinite_cache_but_for_partial_blocks():
    trace = [req(r.hash_ids) for r in random_prefix_trace(4)]  # full blocks only
    infinite = replay(trace, "infinite", 1).hit_tokens
    assert replay_tiers(trace, "adaptive", 5, 10_000).hit_tokens == infinite
    partial = [req([1, 2], 700), req([1, 2], 700)]  # block 2 is partial: never on disk
    assert replay_tiers(partial, "lru", 1, 10).disk_hit_tokens == BS


def test_writing_on_eviction_writes_only_what_ram_gives_up():
    trace = [req([1, 2, 3]), req([4, 5, 6]), req([1, 2, 3])]
    behind = replay_tiers(trace, "lru", 3, 10, disk_writes="behind")
    evicted = replay_tiers(trace, "lru", 3, 10, disk_writes="eviction")
    assert behind.blocks_written == 6 and behind.disk_hit_tokens == 3 * BS
    # A's blocks are written when B evicts them, B's when C does; C reads A's back from disk
    assert evicted.blocks_written == 6 and evicted.disk_hit_tokens == 3 * BS
    assert replay_tiers(trace[:2], "lru", 3, 10, disk_writes="eviction").blocks_written == 3


def test_the_disk_evicts_by_its_own_policy():
    trace = [req([1]), req([2]), req([3]), req([1])]  # RAM of 1, disk of 2 (LRU): 3 evicts 1
    r = replay_tiers(trace, "lru", 1, 2)
    assert r.hit_tokens == 0 and r.blocks_written == 4 and r.blocks_evicted == 2  # 1 again evicts 2


def test_cli_disk_capacity_reports_both_tiers(trace_file, capsys):
    args = [str(trace_file), "--policy", "lru", "--capacity", "2", "--disk-capacity", "100"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["disk_capacity"] == 100 and out["disk_policy"] == "lru" and out["disk_writes"] == "behind"
    assert out["hit_tokens"] == out["ram_hit_tokens"] + out["disk_hit_tokens"]
    assert main([*args, "--disk-writes", "eviction"]) == 0
    text = capsys.readouterr().out
    assert "token hit rate:" in text and "(ram " in text and "writes eviction" in text
