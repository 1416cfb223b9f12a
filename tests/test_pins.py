"""Pins in the engine: a pinned prefix outlives a flood, expires at its TTL (an injected clock), is refreshed
by hits, and pins stay within half the pool; and the explanation of a restore that stopped short."""

import pytest

from minivllm import CacheHints, SamplingParams
from minivllm.cache.kv_request import PrefixMiss
from minivllm.cache.pins import Pins
from tests.test_engine import random_prompts
from tests.test_prefix_cache import PAGE_BYTES, make_engine, run

POOL_PAGES = 64


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool_engine(model_dir, clock: Clock | None = None, eviction: str = "adaptive"):
    engine = make_engine(
        model_dir, kv_cache_bytes=POOL_PAGES * PAGE_BYTES, max_model_len=1024, eviction=eviction
    )
    if clock is not None:  # the pins' TTLs run on it
        engine.kv.clock = engine.kv.pins.clock = clock
    return engine


def ask(engine, rid, prompt, pins=(), n=4, salt=None):
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    seq = engine.add_request(rid, prompt, params, cache=CacheHints(salt=salt, pins=pins))
    run(engine, check=True)
    return seq


def flood(engine, seed, count=12, length=150):
    """Distinct prompts that fill the pool several times over."""
    for i, prompt in enumerate(random_prompts([length] * count, seed=seed)):
        ask(engine, f"flood-{seed}-{i}", prompt)


PINNED = random_prompts([161], seed=99)[0]  # 10 whole pages restorable


@pytest.mark.parametrize("eviction", ["adaptive", "lru", "fifo"])
def test_a_pinned_prefix_survives_a_flood_that_evicts_everything_else(tiny_model_dir, eviction):
    engine = pool_engine(tiny_model_dir, eviction=eviction)
    other = random_prompts([161], seed=98)[0]
    first = ask(engine, "pinned", PINNED, pins=((len(PINNED), 300.0),))
    assert first.cache.pins[0].pages == 10 and first.cache.pins[0].tokens == 160
    ask(engine, "unpinned", other)
    flood(engine, seed=1)
    again = ask(engine, "pinned-again", PINNED)
    assert again.num_cached_tokens == 160 and again.cache.prefix_miss is None  # restored in full
    lost = ask(engine, "unpinned-again", other)
    assert lost.num_cached_tokens == 0  # the flood evicted what was not pinned
    assert lost.cache.prefix_miss == PrefixMiss(0, "evicted")


def test_a_pin_is_released_at_its_ttl_and_refreshed_by_a_hit(tiny_model_dir):
    clock = Clock()
    engine = pool_engine(tiny_model_dir, clock, eviction="lru")  # unpinned, a flood evicts it for sure
    ask(engine, "pinned", PINNED, pins=((len(PINNED), 300.0),))
    clock.now += 200
    assert ask(engine, "hit", PINNED).num_cached_tokens == 160  # the hit starts the 300 s again
    clock.now += 200  # 400 s after the pin, 200 s after the hit
    flood(engine, seed=2)
    assert engine.stats().pages_pinned == 10
    assert ask(engine, "still-pinned", PINNED).num_cached_tokens == 160
    clock.now += 301  # no hit for more than the TTL
    flood(engine, seed=3)
    stats = engine.stats()
    assert stats.pages_pinned == 0 and stats.pins_expired == 1
    assert ask(engine, "expired", PINNED).cache.prefix_miss == PrefixMiss(0, "evicted")


def test_pins_stay_within_half_the_pool_and_the_oldest_give_way(tiny_model_dir):
    engine = pool_engine(tiny_model_dir)
    prompts = random_prompts([161, 161, 161, 161], seed=7)  # 10 pages each; the bound is 32
    for i, prompt in enumerate(prompts):
        ask(engine, f"pin-{i}", prompt, pins=((len(prompt), 300.0),))
        assert engine.stats().pages_pinned <= POOL_PAGES // 2
    stats = engine.stats()
    assert stats.pins == 3 and stats.pins_given_way == 1 and stats.pages_pinned == 30
    flood(engine, seed=4)
    assert ask(engine, "oldest", prompts[0]).num_cached_tokens == 0  # it gave way, then the flood
    for i, prompt in enumerate(prompts[1:]):
        assert ask(engine, f"kept-{i}", prompt).num_cached_tokens == 160


@pytest.mark.parametrize("attack", ["many pins", "one long pin"])
def test_one_keys_pins_cannot_unpin_anothers(tiny_model_dir, attack):
    """A victim's 10-page pin, within its fair share (the 32-page bound split between two keys), holds
    against another key's pins: theirs give way to each other, or are cut to the room left."""
    engine = pool_engine(tiny_model_dir)
    ask(engine, "victim", PINNED, pins=((len(PINNED), 300.0),), salt="victim")
    if attack == "many pins":
        for i, prompt in enumerate(random_prompts([161] * 4, seed=11)):
            ask(engine, f"attack-{i}", prompt, pins=((len(prompt), 300.0),), salt="attacker")
    else:
        prompt = random_prompts([481], seed=12)[0]  # 30 pages: only 22 fit beside the victim's 10
        seq = ask(engine, "attack", prompt, pins=((len(prompt), 300.0),), salt="attacker")
        assert seq.cache.pins[0].pages == 22 and seq.cache.pins[0].tokens == 22 * 16
    assert engine.stats().pages_pinned <= POOL_PAGES // 2
    flood(engine, seed=13)
    again = ask(engine, "victim-again", PINNED, salt="victim")
    assert again.num_cached_tokens == 160


def test_a_domain_over_its_share_gives_way_to_a_new_one():
    pins = Pins(limit=8, clock=Clock())
    pins.add([b"a1", b"a2", b"a3", b"a4", b"a5", b"a6", b"a7"], 60.0, "a")  # 7 of 8 while alone
    change = pins.add([b"b1", b"b2", b"b3"], 60.0, "b")  # a holds more than its share (4): it gives way
    assert change.kept == [b"b1", b"b2", b"b3"] and len(change.unpinned) == 7
    change = pins.add([b"a1", b"a2", b"a3", b"a4", b"a5", b"a6"], 60.0, "a")  # b is within its share
    assert change.unpinned == [] and change.kept == [b"a1", b"a2", b"a3", b"a4", b"a5"]
    assert pins.num_pages == 8 and all(h in pins for h in (b"b1", b"b2", b"b3"))


def test_a_request_that_cannot_fit_takes_room_from_its_own_domains_pins_first():
    pins = Pins(limit=8, clock=Clock())
    pins.add([b"a1", b"a2", b"a3", b"a4"], 60.0, "a")
    pins.add([b"b1", b"b2"], 60.0, "b")
    assert pins.give_way("b") == [b"b1", b"b2"]  # b's request: b's own pin, though a's is older
    assert pins.give_way("c") == [b"a1", b"a2", b"a3", b"a4"]  # the last resort: the largest domain's


def test_a_pin_longer_than_the_bound_pins_its_first_pages_only():
    pins = Pins(limit=4, clock=Clock())
    change = pins.add([b"a", b"b", b"c", b"d", b"e", b"f"], 60.0)
    assert change.pinned == [b"a", b"b", b"c", b"d"] and pins.num_pages == 4
    assert b"e" not in pins


def test_a_new_pin_makes_the_least_recently_refreshed_give_way():
    clock = Clock()
    pins = Pins(limit=4, clock=clock)
    pins.add([b"r", b"x"], 60.0)
    pins.add([b"r", b"y"], 60.0)  # shares page r
    pins.refresh([b"r", b"x"])  # x is now the most recently used
    change = pins.add([b"z", b"w"], 60.0)  # 2 new pages: 3 + 2 > 4, so y's pin gives way
    assert change.unpinned == [b"y"] and pins.counters.pins_given_way == 1
    assert all(h in pins for h in (b"r", b"x", b"z", b"w"))
    clock.now += 61
    assert sorted(pins.expire()) == [b"r", b"w", b"x", b"z"] and pins.num_pages == 0


def test_a_pin_covers_whole_pages_of_the_tokens_it_names(tiny_model_dir):
    engine = pool_engine(tiny_model_dir)
    seq = ask(engine, "part", PINNED, pins=((47, 300.0), (100, 60.0)))
    assert [(p.tokens, p.pages) for p in seq.cache.pins] == [(32, 2), (96, 6)]
    assert engine.stats().pages_pinned == 6  # the shorter pin's pages are the longer one's


def test_a_restore_that_stops_short_says_where_and_why(tiny_model_dir):
    engine = pool_engine(tiny_model_dir)
    ask(engine, "first", PINNED)
    changed = list(PINNED)
    changed[70] = (changed[70] + 1) % 384  # page 4
    seq = ask(engine, "changed", changed)
    assert seq.num_cached_tokens == 64 and seq.cache.prefix_miss == PrefixMiss(70, "new")  # the changed token
    assert ask(engine, "same", PINNED).cache.prefix_miss is None
    fresh = ask(engine, "fresh", random_prompts([100], seed=5)[0])
    assert fresh.cache.prefix_miss == PrefixMiss(0, "new")


@pytest.mark.parametrize("pins", [((0, 300.0),), ((16, 0.0),), ((16, 3601.0),), ((True, 60.0),)])
def test_bad_pins_are_refused(pins):
    with pytest.raises(ValueError, match="pins"):
        CacheHints(pins=pins)


def test_pins_give_way_to_a_request_that_could_not_fit_beside_them(tiny_model_dir):
    engine = pool_engine(tiny_model_dir)
    prompts = random_prompts([161, 161, 161], seed=11)
    for i, prompt in enumerate(prompts):
        ask(engine, f"pin-{i}", prompt, pins=((len(prompt), 300.0),))
    assert engine.stats().pages_pinned == 30
    big = ask(engine, "big", random_prompts([700], seed=12)[0])  # 44 pages: more than the 34 unpinned
    assert big.finish_reason == "length" and len(big.output_token_ids) == 4
    stats = engine.stats()
    assert stats.pins_given_way == 1 and stats.pages_pinned == 20  # only the oldest gave way
    assert ask(engine, "newest", prompts[2]).num_cached_tokens == 160


def test_a_pinned_prefix_stays_on_disk_through_a_flood_and_restores_after_a_restart(tiny_model_dir, tmp_path):
    disk_pages = 40  # the disk tier holds 40 page files: the flood evicts all but the pinned
    geometry = dict(kv_disk_dir=str(tmp_path), single_flight="off", max_model_len=1024)

    def disk_engine(file_bytes: int):
        return make_engine(
            tiny_model_dir, kv_cache_bytes=POOL_PAGES * PAGE_BYTES, kv_disk_bytes=file_bytes, **geometry
        )

    engine = disk_engine(disk_pages * 3 * 4096)  # a page file takes 3 blocks (8 KiB of KV and its header)
    assert engine.kv.disk.policy.capacity == disk_pages
    other = random_prompts([161], seed=13)[0]
    ask(engine, "pinned", PINNED, pins=((len(PINNED), 300.0),))
    ask(engine, "other", other)
    flood(engine, seed=5)
    engine.kv.disk.flush()
    engine.close()
    restarted = disk_engine(disk_pages * 3 * 4096)  # pins are RAM state; the files stayed
    again = ask(restarted, "pinned-again", PINNED)
    assert again.num_cached_tokens == 160 and restarted.stats().prefix_hit_tokens_disk == 160
    assert ask(restarted, "other-again", other).num_cached_tokens == 0
