"""The replica routing rule (minivllm.cluster.routing) and the replay over replicas that measures it."""

import json
import random

import pytest

from minivllm.cluster.routing import NoReplicaError, Router, RoutingConfig, rendezvous_order
from minivllm.replay import TraceRequest, main, replay, replay_replicas, route_trace

REPLICAS = ["a", "b", "c", "d"]


def router(policy="affinity", replicas=REPLICAS, **kw) -> Router:
    return Router(RoutingConfig(policy=policy, **kw), replicas)


def conversation_trace(seed: int, sessions: int = 60, turns: int = 8, system_pages: int = 2):
    """Multi-turn chats sharing a system prompt: each turn resends the whole conversation plus new pages.
    Sessions interleave at random, like users of one service."""
    rng = random.Random(seed)
    next_key = 1000
    history = {s: list(range(system_pages)) for s in range(sessions)}
    remaining = {s: turns for s in range(sessions)}
    trace = []
    while remaining:
        s = rng.choice(list(remaining))
        for _ in range(rng.randint(1, 3)):
            history[s].append(next_key)
            next_key += 1
        trace.append(TraceRequest(list(history[s]), len(history[s]) * 512 - rng.randint(0, 511)))
        remaining[s] -= 1
        if not remaining[s]:
            del remaining[s]
    return trace


# -- the affinity rule ------------------------------------------------------------------------------------
def test_a_conversation_stays_on_the_replica_that_holds_its_prefix():
    r = router()
    first = r.choose([1, 2, 3])[0]
    for _ in range(5):  # later turns extend the prefix; other conversations come and go in between
        r.choose([random.random(), 7])
        assert r.choose([1, 2, 3, 4, 5])[0] == first


def test_the_deepest_prefix_wins_and_ties_go_to_the_least_loaded_holder():
    r = router()
    r.choose([1, 2])  # owner of page 1
    holder_of_2 = r.holders([1, 2])
    assert len(holder_of_2) == 1
    r.remember([1, 2, 3, 4], "c")  # c was sent the deeper prefix
    assert r.choose([1, 2, 3, 4, 5])[0] == "c"
    # page 1 alone is now held by two replicas: a request sharing only it goes to the less loaded one
    assert set(r.holders([1, 9])) == {holder_of_2[0], "c"}
    assert r.choose([1, 9])[0] == min(r.holders([1, 9]), key=lambda x: r.loads()[x])


def test_identical_prompts_meet_on_one_replica():
    r = router()
    assert len({r.choose([5, 6, 7])[0] for _ in range(8)}) == 1  # a burst: one replica, one single flight


def test_a_new_prefix_goes_to_the_less_loaded_of_its_two_rendezvous_candidates():
    keys = [b"\x01" * 16, b"\x02" * 16]
    owner, second = rendezvous_order(keys[0], REPLICAS)[:2]
    assert {router().choose(keys)[0] for _ in range(3)} == {owner}  # equal loads: the owner, in any process
    busy = router()
    busy.remember([99], owner)
    assert [busy.choose([99])[0] for _ in range(3)] == [owner] * 3  # three requests for a prefix it holds
    assert busy.choose(keys)[0] == second  # the owner is busier: the second candidate
    # removing a replica leaves the others' order alone, so a key's owner moves only if it was the one
    moved = 0
    for k in range(200):
        before = rendezvous_order(k, REPLICAS)
        after = rendezvous_order(k, ["a", "b", "d"])
        assert after == [x for x in before if x != "c"]
        moved += before[0] != after[0]
    assert 30 < moved < 80  # about a quarter


def test_a_request_without_full_pages_goes_to_the_least_loaded():
    r = router()
    r.choose([1])
    r.choose([2])
    first = r.choose([])[0]
    assert r.loads()[first] == 1 and sorted(r.loads().values()) == [0, 1, 1, 1]


def test_a_hot_prefix_spills_over_once_its_replica_is_overloaded():
    r = router(window=100, imbalance=1.2, slack=4)
    hot = r.choose([42, 43])[0]
    for _ in range(99):
        r.choose([42, 43, random.random()])  # the same long prefix, again and again
    loads = r.loads()
    assert max(loads.values()) <= 100 / 4 * 1.2 + 4 + 1  # affinity yielded at the threshold
    assert loads[hot] < 50 and sum(n > 0 for n in loads.values()) >= 3  # the prefix now lives on several


def test_the_load_window_forgets_old_requests():
    r = router(window=10)
    for i in range(50):
        r.choose([i])
    assert sum(r.loads().values()) == 10 and sum(r.routed.values()) == 50


def test_in_flight_load_counts_what_has_not_finished():
    r = Router(RoutingConfig(), REPLICAS, load="in-flight")
    first = r.choose([1])[0]
    assert r.loads()[first] == 1
    r.finish(first)
    r.finish(first)  # never below zero
    assert r.loads()[first] == 0 and r.routed[first] == 1
    with pytest.raises(ValueError, match="window"):
        router().finish("a")
    with pytest.raises(ValueError, match="load"):
        Router(load="sometimes")


def test_the_ray_router_charges_a_request_to_the_replica_that_served_it():
    """Ray Serve may send a request past its full first choice: the load in flight, its completion and
    its pages belong to the replica that served it."""
    pytest.importorskip("ray.serve")
    from collections import OrderedDict
    from types import SimpleNamespace

    from server.cluster.router import PageHashRouter

    rr = object.__new__(PageHashRouter)  # its state alone: no Ray Serve around it
    rr.page_size, rr._choices = 16, OrderedDict()
    rr.routing = Router(RoutingConfig(), REPLICAS, load="in-flight")
    pending = SimpleNamespace(
        kwargs={"prompt": list(range(48))}, metadata=SimpleNamespace(internal_request_id="q")
    )
    chosen, served = rr.routing.choose(rr.page_keys(pending))[:2]
    rr._choices["q"] = [chosen, served]
    rr.on_request_routed(pending, SimpleNamespace(unique_id=served), None)
    assert rr.routing.loads()[served] == 1 and rr.routing.loads()[chosen] == 0
    assert rr.routing.holders(rr.page_keys(pending)) == sorted({chosen, served}, key=REPLICAS.index)
    rr.on_request_completed(SimpleNamespace(unique_id=served), "q")
    assert sum(rr.routing.loads().values()) == 0


def test_new_conversations_spread_by_what_is_in_flight_not_by_history():
    live, replay_like = Router(RoutingConfig(), ["a", "b"], load="in-flight"), router(replicas=["a", "b"])
    for r in (live, replay_like):
        r.remember([5], "a")
        for _ in range(20):  # a busy past on a: all finished by now
            first = r.choose([5])[0]
            if r is live:
                r.finish(first)
    burst = [1000 + i for i in range(6)]  # six new conversations at once
    assert sorted(live.choose([k])[0] for k in burst) == ["a"] * 3 + ["b"] * 3
    assert [replay_like.choose([k])[0] for k in burst] == ["b"] * 6  # history would send all of them to b


def test_a_removed_replica_is_never_chosen_and_its_prefixes_move():
    r = router()
    home = r.choose([1, 2, 3])[0]
    r.remove_replica(home)
    new_home = r.choose([1, 2, 3, 4])[0]
    assert new_home != home and home not in r.choose([1, 2, 3, 4])
    assert r.choose([1, 2, 3, 4, 5])[0] == new_home  # affinity moved with the first request
    r.set_replicas([])
    with pytest.raises(NoReplicaError):
        r.choose([1])


def test_the_index_is_bounded():
    r = router(index_pages=50)
    for i in range(100):
        r.choose([i * 10 + j for j in range(5)])
    assert len(r._index) == 50
    assert r.holders([0]) == [] and r.holders([994]) != []  # the oldest pages were forgotten


def test_round_robin_and_least_loaded_ignore_the_keys():
    rr = router("round-robin")
    assert [rr.choose([1, 2])[0] for _ in range(8)] == REPLICAS * 2
    ll = router("least-loaded")
    firsts = [ll.choose([1, 2])[0] for _ in range(8)]
    assert sorted(firsts) == sorted(REPLICAS * 2)


def test_the_ranking_lists_every_live_replica_once():
    r = router()
    ranking = r.choose([1, 2])
    assert sorted(ranking) == sorted(REPLICAS)


@pytest.mark.parametrize(
    "kw",
    [{"policy": "random"}, {"window": 0}, {"imbalance": 0.9}, {"slack": -1}, {"index_pages": 0}],
)
def test_bad_config_is_refused(kw):
    with pytest.raises(ValueError):
        RoutingConfig(**kw)


# -- the replay over replicas -----------------------------------------------------------------------------
def test_one_replica_replays_like_one_cache():
    trace = conversation_trace(0)
    single = replay(trace, "lru", 300)
    one = replay_replicas(trace, "lru", 300, replicas=1, routing="round-robin")
    assert (one.hit_tokens, one.total_tokens, one.load_imbalance) == (
        single.hit_tokens,
        single.total_tokens,
        1.0,
    )


def test_route_trace_keeps_every_request_once_in_order():
    trace = conversation_trace(1)
    shards = route_trace(trace, 3, RoutingConfig())
    assert sum(len(s) for s in shards) == len(trace)
    for shard in shards:
        positions = [next(i for i, r in enumerate(trace) if r is x) for x in shard]
        assert positions == sorted(positions)


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_affinity_keeps_the_hit_rate_of_one_big_cache_and_the_load_even(policy):
    trace = conversation_trace(2)
    single = replay(trace, policy, 400).token_hit_rate
    affinity = replay_replicas(trace, policy, 100, replicas=4, routing="affinity")
    rr = replay_replicas(trace, policy, 100, replicas=4, routing="round-robin")
    assert affinity.token_hit_rate >= 0.9 * single
    assert affinity.token_hit_rate >= 1.5 * rr.token_hit_rate
    assert affinity.load_imbalance <= 1.3
    assert sum(affinity.requests_per_replica) == len(trace)


def test_belady_and_infinite_replay_per_replica():
    trace = conversation_trace(3)
    best = replay_replicas(trace, "belady", 50, 2).hit_tokens
    assert replay_replicas(trace, "lru", 50, 2).hit_tokens <= best
    assert replay_replicas(trace, "infinite", 50, 2).hit_tokens >= best


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "conv.jsonl"
    lines = [
        json.dumps({"input_length": r.input_length, "hash_ids": r.hash_ids}) for r in conversation_trace(4)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_replicas_json_has_the_single_cache_keys_and_the_load(trace_file, capsys):
    args = [str(trace_file), "--policy", "lru", "--capacity", "100", "--replicas", "4", "--json"]
    assert main(args + ["--routing", "round-robin"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"hit_tokens", "total_tokens", "token_hit_rate", "hit_blocks", "total_blocks"} <= set(out)
    assert out["load_imbalance"] == pytest.approx(
        max(out["requests_per_replica"]) / (sum(out["requests_per_replica"]) / 4)
    )
    assert out["routing"] == "round-robin" and out["replicas"] == 4
    assert main(args) == 0  # affinity by default
    assert json.loads(capsys.readouterr().out)["routing"] == "affinity"


def test_cli_replicas_plain_output(trace_file, capsys):
    assert main([str(trace_file), "--policy", "lru", "--capacity", "100", "--replicas", "2"]) == 0
    out = capsys.readouterr().out
    assert "load imbalance (max/mean requests):" in out and "replicas: 2 (affinity)" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--policy", "lru", "--capacity", "5", "--routing", "affinity"],  # routing without replicas
        ["--policy", "lru", "--capacity", "5", "--replicas", "0"],
        ["--policy", "lru", "--capacity", "5", "--replicas", "2", "--routing", "random"],
        ["--sweep", "--capacities", "5", "--replicas", "2"],
    ],
)
def test_cli_bad_replica_args_exit_2(trace_file, args, capsys):
    assert main([str(trace_file), *args]) == 2
    assert capsys.readouterr().err
