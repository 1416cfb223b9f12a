"""Eviction policies against small traces worked by hand from the seed's S3FIFO rules (the adaptive
policy has its own file).

Queue states are written head -> tail, each resident key with its freq: S=[a0,b1] means
a (freq 0) is the next to leave S. G holds keys only.
"""

import random

import pytest

from minivllm.cache.eviction import FIFO, LRU, POLICIES, S3FIFO, Adaptive, FollowedS3FIFO, make_policy
from minivllm.config import EVICTION_POLICIES, EngineConfig, Eviction


def state(p: S3FIFO):
    return (
        [(k, p.freq(k)) for k in p.small_keys()],
        [(k, p.freq(k)) for k in p.main_keys()],
        p.ghost_keys(),
    )


def run(p, keys):
    return [p.access(k) for k in keys]


# --- S3FIFO sizing ---


@pytest.mark.parametrize(
    "capacity, ratio, small",
    [
        (100, 0.1, 10),
        # 25 * 0.1 == 2.5 exactly in floating point; the seed says round(), and Python's
        # round is banker's (half to even): round(2.5) == 2, round(3.5) == 4, round(1.5) == 2.
        (25, 0.1, 2),
        (35, 0.1, 4),
        (15, 0.1, 2),
        (3, 0.1, 1),  # round(0.3) == 0 -> clamped to 1 so S exists
        (2, 0.9, 1),  # round(1.8) == 2 -> clamped to capacity - 1 so M exists
        (1, 0.1, 1),  # capacity 1: S only, M and G empty
    ],
)
def test_small_cap_rounding(capacity, ratio, small):
    p = S3FIFO(capacity, small_ratio=ratio)
    assert p.small_cap == small
    assert p.main_cap == capacity - small
    assert p.ghost_cap == p.main_cap  # ghost sized like main, not like small


# --- S3FIFO access rule ---


def test_s_drains_to_m_with_freq_kept_and_to_g_when_cold():
    p = S3FIFO(10, small_ratio=0.2)  # S=2, M=8, G=8
    assert run(p, ["a", "b", "a", "a"]) == [[], [], [], []]
    # S=[a2,b0] M=[] G=[]
    assert state(p) == ([("a", 2), ("b", 0)], [], [])
    assert p.access("c") == []  # S full: pop a (freq 2 >= 1) -> M keeping freq 2
    # S=[b0,c0] M=[a2] G=[]
    assert state(p) == ([("b", 0), ("c", 0)], [("a", 2)], [])
    assert p.access("d") == ["b"]  # S full: pop b (freq 0) -> G, no longer resident
    # S=[c0,d0] M=[a2] G=[b]
    assert state(p) == ([("c", 0), ("d", 0)], [("a", 2)], ["b"])
    assert "b" not in p and len(p) == 3


def _full_main():
    p = S3FIFO(4, small_ratio=0.5)  # S=2, M=2, G=2
    run(p, ["a", "a", "b", "b", "c", "d"])
    # a,b warmed in S; c pushes a (f1) to M, d pushes b (f1) to M
    # S=[c0,d0] M=[a1,b1] G=[]
    assert state(p) == ([("c", 0), ("d", 0)], [("a", 1), ("b", 1)], [])
    return p


def test_m_second_chance_requeues_with_freq_minus_one_and_evicts_exactly_one():
    p = _full_main()
    run(p, ["c", "a"])
    # S=[c1,d0] M=[a2,b1]
    assert p.access("e") == ["b"]
    # S full: pop c (f1) -> admit_to_M(c, 1), M full:
    #   head a2 -> requeue a1: M=[b1,a1]
    #   head b1 -> requeue b0: M=[a1,b0]
    #   head a1 -> requeue a0: M=[b0,a0]
    #   head b0 -> b to G, stop (one real eviction): M=[a0], then append c1
    # S=[d0,e0] M=[a0,c1] G=[b]
    assert state(p) == ([("d", 0), ("e", 0)], [("a", 0), ("c", 1)], ["b"])


def test_ghost_hit_admits_to_tail_of_m_with_freq_zero():
    p = _full_main()
    run(p, ["c", "a", "e"])
    # S=[d0,e0] M=[a0,c1] G=[b]   (previous test)
    assert p.access("b") == ["a"]
    # b in G: removed from G, admit_to_M(b, 0): M full, head a0 -> G; append b0
    # S=[d0,e0] M=[c1,b0] G=[a]
    assert state(p) == ([("d", 0), ("e", 0)], [("c", 1), ("b", 0)], ["a"])
    assert p.freq("b") == 0


def test_ghost_reinsert_moves_to_tail():
    # Through access() a key in G is never resident, so it cannot be sent to G again;
    # the rule still belongs to the ghost helper (forced eviction and future callers use it).
    p = S3FIFO(10, small_ratio=0.2)  # G cap 8
    for k in ["x", "y", "z"]:
        p._insert_to_ghost(k)
    # G=[x,y,z]
    p._insert_to_ghost("x")
    # x already in G: removed and re-appended, G=[y,z,x]
    assert p.ghost_keys() == ["y", "z", "x"]


def test_ghost_capacity_is_main_capacity_and_pops_head():
    p = S3FIFO(10, small_ratio=0.2)  # S=2, M=8, G=8
    evicted = run(p, range(20))
    # every key is cold: each arrival pushes S's head (freq 0) to G
    assert [e for es in evicted for e in es] == list(range(18))
    # S=[18,19] G = last 8 of 0..17 (head popped at capacity)
    assert p.small_keys() == [18, 19]
    assert p.ghost_keys() == list(range(10, 18))


def test_freq_saturates_at_max_freq():
    p = S3FIFO(10, max_freq=3)
    run(p, ["a"] * 10)
    assert p.freq("a") == 3
    q = S3FIFO(10, max_freq=5)
    run(q, ["a"] * 10)
    assert q.freq("a") == 5


def test_capacity_one_never_crashes():
    p = S3FIFO(1)
    assert run(p, ["a", "a", "b", "a"]) == [[], [], ["a"], ["b"]]
    # b pushes a (f1) out of S; M has size 0 so a is evicted, not kept
    assert len(p) == 1 and "a" in p and p.ghost_keys() == []


def test_the_policy_names_are_the_configs_and_each_builds_its_policy():
    """One list of names (minivllm.config.Eviction): the settings accept exactly the policies there are."""
    assert POLICIES == tuple(m.value for m in Eviction) == EVICTION_POLICIES
    built = {name: type(make_policy(name, 8)) for name in POLICIES}
    assert built == {"adaptive": Adaptive, "s3fifo": S3FIFO, "lru": LRU, "fifo": FIFO}
    assert EngineConfig(eviction="lru").eviction is Eviction.LRU
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("lfu", 8)


@pytest.mark.parametrize("name", POLICIES)
def test_access_returns_exactly_the_keys_that_left(name):
    rng = random.Random(0)
    p = make_policy(name, 17, small_ratio=0.2)
    resident: set = set()
    for _ in range(3000):
        key = rng.randrange(60)
        evicted = p.access(key)
        p.release(key)  # one request per key; a no-op but for the adaptive policy
        after = {k for k in range(60) if k in p}
        assert key in p
        assert len(evicted) == len(set(evicted))
        assert set(evicted) == (resident | {key}) - after
        assert len(p) == len(after) <= p.capacity
        resident = after


# --- remove and forced eviction ---


def test_remove_leaves_no_ghost_and_is_noop_when_absent():
    p = _full_main()
    p.remove("a")  # in M
    p.remove("c")  # in S
    p.remove("zzz")
    assert "a" not in p and "c" not in p and len(p) == 2
    assert p.ghost_keys() == []


def test_forced_eviction_walks_s_first_skipping_pinned():
    p = _full_main()
    p.access("d")
    # S=[c0,d1] M=[a1,b1]; c pinned -> first evictable in S is d, sent to G despite freq 1
    assert p.evict(lambda k: k != "c") == "d"
    assert state(p) == ([("c", 0)], [("a", 1), ("b", 1)], ["d"])


def test_forced_eviction_second_chance_in_m_skips_pinned_in_place():
    p = _full_main()
    run(p, ["b", "b"])
    # S=[c0,d0] M=[a1,b3]; S all pinned, a pinned in M -> only b is a candidate
    pinned = {"c", "d", "a"}
    assert p.evict(lambda k: k not in pinned) == "b"
    # b requeued with 2, 1, 0 (three passes), evicted on the fourth; a never moved
    assert state(p) == ([("c", 0), ("d", 0)], [("a", 1)], ["b"])


def test_forced_eviction_m_order_matches_sequential_second_chance():
    p = S3FIFO(6, small_ratio=0.2)  # S=1, M=5
    for k in ["p", "q", "r"]:
        run(p, [k, k, "tmp-" + k])  # warm k in S, a cold key pushes it to M with freq 1
    p.access("r")
    # S=[tmp-r0] M=[p1,q1,r2]
    assert p.main_keys() == ["p", "q", "r"]
    assert p.evict(lambda k: not k.startswith("tmp")) == "p"
    # p1->p0 to tail, q1->q0 to tail, r2->r1 to tail: M=[p0,q0,r1]; head p0 evicted
    assert [(k, p.freq(k)) for k in p.main_keys()] == [("q", 0), ("r", 1)]


def test_forced_eviction_returns_none_when_everything_is_pinned():
    p = _full_main()
    before = state(p)
    assert p.evict(lambda k: False) is None
    assert state(p) == before
    assert S3FIFO(4).evict(lambda k: True) is None  # empty


# --- S3FIFO as the default's cache holds it (the default's shadow of it) ---


def test_followed_s3fifo_holds_the_seeds_keys_when_nothing_stays_in_use():
    """Each key released before the next access: S3FIFO's every key is held, and a key it gave up stays only
    as a stray (the first victim), so the cache never holds more than S3FIFO's keys and one stray per gap
    S3FIFO leaves below its capacity."""
    rng = random.Random(7)
    seed, followed = S3FIFO(12), FollowedS3FIFO(12)
    for _ in range(3000):
        key = rng.randrange(40)
        seed.access(key)
        followed.access(key)
        followed.release(key)
        assert set(seed) <= set(followed) and len(followed) <= 12
        assert all(followed._entries[k].stray for k in set(followed) - set(seed))


def test_followed_s3fifo_gives_up_no_key_in_use_and_then_the_keys_s3fifo_gave_up_first():
    """A scan longer than the small queue: the seed's S3FIFO gives up the scan's own first blocks while it
    reads the rest; a cache cannot, so it gives up other keys then, and the scan's keys S3FIFO gave up go
    first once the scan is released, before main's hot keys."""
    seed, followed = S3FIFO(10), FollowedS3FIFO(10)  # S=1, M=9
    for policy in (seed, followed):
        for key in range(9):  # nine keys reach main: each seen twice, one at a time
            policy.access(key)
            policy.access(key)
            policy.access(f"cold{key}")
            policy.release(key)
            policy.release(f"cold{key}")
    scan = [f"s{i}" for i in range(5)]
    assert [k for key in scan for k in seed.access(key)][:4] == ["cold8", *scan[:3]]
    evicted = [k for key in scan for k in followed.access(key)]
    assert not set(evicted) & set(scan)
    assert all(key in followed for key in scan) and len(followed) == 10
    for key in reversed(scan):
        followed.release(key)
    strays = {k for k in followed if followed._entries[k].stray}
    assert strays == {k for k in scan if k not in seed} and len(strays) == 4
    hot = [k for k in range(9) if k in followed]
    after = [k for i in range(len(strays)) for k in followed.access(f"new{i}")]
    assert set(after) <= set(scan)  # the scan's keys, not the hot keys still held
    assert all(k in followed for k in hot)


def test_followed_s3fifo_forgets_a_removed_key_in_both_its_parts():
    followed = FollowedS3FIFO(4)
    for key in "abc":
        followed.access(key)
        followed.release(key)
    assert "c" in followed.s3fifo  # its small queue's one key
    followed.remove("c")
    assert "c" not in followed and "c" not in followed.s3fifo
    assert sorted(followed) == ["a", "b"]  # S3FIFO gave them up: strays, held while there is room


# --- LRU and FIFO ---


def test_lru_hit_refreshes_recency():
    p = LRU(2)
    assert run(p, ["a", "b", "a", "c"]) == [[], [], [], ["b"]]
    assert p.keys() == ["a", "c"]


def test_fifo_hit_does_not_reorder():
    p = FIFO(2)
    assert run(p, ["a", "b", "a", "c"]) == [[], [], [], ["a"]]
    assert p.keys() == ["b", "c"]


@pytest.mark.parametrize("cls", [LRU, FIFO])
def test_ordered_evict_and_remove(cls):
    p = cls(3)
    run(p, ["a", "b", "c"])
    assert p.evict(lambda k: k != "a") == "b"
    assert p.evict(lambda k: False) is None
    p.remove("a")
    p.remove("nope")
    assert p.keys() == ["c"]


# --- factory ---


def test_make_policy_builds_each_name():
    assert isinstance(make_policy("adaptive", 10), Adaptive)
    policy = make_policy("adaptive", 10, history=2.5)
    assert all(p.history_cap == 25 for p in (policy.cache, *policy.shadows[:-1]))  # the last: S3FIFO
    assert isinstance(make_policy("s3fifo", 10), S3FIFO)
    assert isinstance(make_policy("lru", 10), LRU)
    assert isinstance(make_policy("fifo", 10), FIFO)
    p = make_policy("s3fifo", 10, small_ratio=0.3, max_freq=2)
    assert p.small_cap == 3 and p.max_freq == 2


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("arc", 10), {}, "unknown eviction policy"),
        (("lru", 0), {}, "capacity"),
        (("s3fifo", 10), {"small_ratio": 0.0}, "small_ratio"),
        (("s3fifo", 10), {"small_ratio": 1.0}, "small_ratio"),
        (("s3fifo", 10), {"max_freq": -1}, "max_freq"),
        (("adaptive", 10), {"history": 0}, "history"),
        (("adaptive", 0), {}, "capacity"),
    ],
)
def test_make_policy_rejects_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_policy(*args, **kwargs)
