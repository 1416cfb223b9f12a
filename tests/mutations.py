"""Mutation check: break the code on purpose, one mutation at a time, and see whether the tests notice.

Each mutation replaces one exact piece of source text in a temporary copy of the working tree (tracked
files and uncommitted edits) and runs the tests that guard that code there, stopping at the first failure.
A mutation is caught when a test fails (or the run hangs past the timeout); the table names the test.

    python -m tests.mutations                 # every mutation: a table and the catch rate
    python -m tests.mutations --list
    python -m tests.mutations parent-hash no-leader-handover

It takes about ten minutes on 2 CPU cores. A mutation whose source text is no longer in the tree is
reported as "stale": update its text here when the code it breaks changes.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: test files, -k expressions


SCHEDULER = "minivllm/engine/scheduler.py"
KV_MANAGER = "minivllm/cache/kv_manager.py"
KERNEL = "kernels/paged_attention.py"
ROUTING = "minivllm/cluster/routing.py"
RUNNER = "minivllm/engine/model_runner.py"
SPECULATIVE_TESTS = ("tests/test_speculative.py",)
# prefix_hits' accesses and releases of a request, then its yield
REPLAY_ACCESSES = (
    "        parent, last = None, len(req.hash_ids) - 1\n"
    "        partial_tail = req.input_length < len(req.hash_ids) * block_size  # the last block is not full\n"
    "        for i, h in enumerate(req.hash_ids):\n"
    "            cache.access(h, parent, partial_tail and i == last)\n"
    "            parent = h\n"
    "        for h in reversed(req.hash_ids):  # the request is done: its blocks are released tail first\n"
    "            cache.release(h)\n"
    "        yield k\n"
)
PINS_TESTS = ("tests/test_pins.py",)
LAYOUT = "minivllm/models/cpu_layout.py"
LAYOUT_TESTS = ("tests/test_cpu_layout.py",)
HYBRID_TESTS = ("tests/test_hybrid.py",)
HARMONY = "server/harmony.py"
GEMMA4 = "minivllm/models/gemma4_text.py"
GEMMA4_TESTS = ("tests/test_families.py", "-k", "gemma4")
HARMONY_TESTS = ("tests/test_harmony.py",)
MUTATIONS = [
    # -- five the suite once missed (wrong KV or draws) ------------------------------------------------------
    Mutation(
        "parent-hash",
        "the parent hash left out of the chained page hash",
        "minivllm/cache/page_hash.py",
        "xxh3_128_digest(parent + np.asarray(tokens",
        "xxh3_128_digest(np.asarray(tokens",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "publish-uncomputed",
        "pages published before their KV is computed",
        KV_MANAGER,
        "full = min(req.num_computed_tokens // self.page_size, len(hashes))",
        "full = len(hashes)",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "no-leader-handover",
        "preemption no longer hands a leader's flight over to a follower",
        SCHEDULER,
        "        if self.flights and self.flights.is_open_leader(seq):\n            self.flights.hand_over(seq)\n",
        "",
        ("tests/test_single_flight.py",),
    ),
    Mutation(
        "sampler-key-without-position",
        "the sampler's per-request key no longer depends on the token position",
        "minivllm/engine/sampler.py",
        "mx.random.key((s.seed * 1_000_003 + position) % (1 << 63))",
        "mx.random.key(s.seed % (1 << 63))",
        ("tests/test_engine.py",),
    ),
    Mutation(
        "admission-ignores-pinned-hits",
        "admission ignores the cache-hit pages it just pinned",
        KV_MANAGER,
        "if need > self.num_available() - taken_off_cache:",
        "if need > self.num_available():",
        ("tests/test_prefix_cache.py",),
    ),
    # -- caught by the earlier suite -------------------------------------------------------------------------
    Mutation(
        "restore-one-page-more",
        "the restore rule restores one page more",
        KV_MANAGER,
        "return (len(req.token_ids) - 1) // self.page_size\n",
        "return (len(req.token_ids) - 1) // self.page_size + 1\n",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "restore-one-page-less",
        "the restore rule restores one page less",
        KV_MANAGER,
        "return (len(req.token_ids) - 1) // self.page_size\n",
        "return (len(req.token_ids) - 1) // self.page_size - 1\n",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "abort-keeps-pages",
        "an aborted request's pages are not released",
        SCHEDULER,
        "        self.kv.release(seq.cache)\n        if seq.status == SequenceStatus.RUNNING:",
        '        if reason != "abort":\n            self.kv.release(seq.cache)\n'
        "        if seq.status == SequenceStatus.RUNNING:",
        ("tests/test_engine.py", "tests/test_single_flight.py"),
    ),
    Mutation(
        "s3fifo-promotion-threshold",
        "S3FIFO promotes from the small queue at freq >= 2 instead of >= 1",
        "minivllm/cache/eviction.py",
        "            if vf >= 1:\n                self._admit_to_main(victim, vf, evicted)  # freq kept",
        "            if vf >= 2:\n                self._admit_to_main(victim, vf, evicted)  # freq kept",
        ("tests/test_eviction.py", "tests/test_replay.py"),
    ),
    Mutation(
        "s3fifo-frequency-reset",
        "S3FIFO resets the frequency of a page promoted to the main queue",
        "minivllm/cache/eviction.py",
        "self._admit_to_main(victim, vf, evicted)  # freq kept",
        "self._admit_to_main(victim, 0, evicted)  # freq kept",
        ("tests/test_eviction.py", "tests/test_replay.py"),
    ),
    Mutation(
        "replay-yields-before-the-requests-accesses",
        "the replay yields a request's prefix hit before it accesses the request's blocks (a consumer that "
        "stops with the trace never replays its last request)",
        "minivllm/replay.py",
        REPLAY_ACCESSES,
        "        yield k\n" + REPLAY_ACCESSES.removesuffix("        yield k\n"),
        ("tests/test_replay.py",),
    ),
    Mutation(
        "stray-subtree-kept",
        "a key the followed configuration gave up is a stray, but the keys under it are not",
        "minivllm/cache/eviction.py",
        "        under = list(entry.children) if stray else []\n",
        "        under = []\n",
        ("tests/test_adaptive_eviction.py", "tests/test_policy_robustness.py"),
    ),
    Mutation(
        "stray-parent-not-inherited",
        "a key admitted under a stray key is not a stray unless the followed configuration lacks it",
        "minivllm/cache/eviction.py",
        "        stray = stray or (parent is not None and parent.stray)\n",
        "",
        ("tests/test_adaptive_eviction.py", "tests/test_policy_robustness.py"),
    ),
    Mutation(
        "going-back-takes-z",
        "the default goes back to a configuration it left lately on Z deviations, as to a new one",
        "minivllm/cache/eviction.py",
        "self.Z_BACK if self._left_lately(leader) else self.Z\n",
        "self.Z\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "switch-forgets-left",
        "the default never records the configuration it leaves, so nothing takes Z_BACK",
        "minivllm/cache/eviction.py",
        "            self._left[self.mode] = self._accesses\n",
        "",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-keeps-nothing-for-the-runner-up",
        "the default's cache gives up every key its leader gives up, whatever a runner-up at the bound holds",
        "minivllm/cache/eviction.py",
        "        if eligible and self._lead_noise(self.mode, runner) >= self.KEEP_NOISE:\n",
        "        if False:\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-keeps-for-a-runner-up-below-the-bound",
        "the default's cache keeps keys for the runner-up wherever it stands",
        "minivllm/cache/eviction.py",
        "        eligible = self._at_bound(runner) or self._at_start()\n",
        "        eligible = True\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-keeps-on-one-request",
        "the default's cache keeps keys for a runner-up at the bound after one request the two served a block "
        "apart (right after the pool fills, every configuration is at the bound)",
        "minivllm/cache/eviction.py",
        "        if eligible and self._lead_noise(self.mode, runner) >= self.KEEP_NOISE:\n",
        "        if eligible:\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-keeps-nothing-at-the-start",
        "the default's cache keeps keys for a runner-up below the bound at no time, the start included",
        "minivllm/cache/eviction.py",
        "        eligible = self._at_bound(runner) or self._at_start()\n",
        "        eligible = self._at_bound(runner)\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-start-never-ends",
        "the default's start, when it keeps keys for a runner-up below the bound, lasts until the first switch",
        "minivllm/cache/eviction.py",
        "        return self._filled_at is None or self._accesses - self._filled_at < self.START_KEEP * self.capacity\n",
        "        return True\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-start-outlives-a-switch",
        "the default's start, when it keeps keys for a runner-up below the bound, goes on after a switch",
        "minivllm/cache/eviction.py",
        "        if self._left:\n            return False\n",
        "",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-keeps-for-every-new-runner-up",
        "the default's cache keeps keys for each new runner-up at once, however little it leads the old one by",
        "minivllm/cache/eviction.py",
        "            if lead <= self.Z_RUNNER * self._lead_noise(runner, kept_for):\n",
        "            if False:\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-keeps-what-the-runner-up-gave-up",
        "the default's cache keeps a key for the runner-up after the runner-up gave it up too",
        "minivllm/cache/eviction.py",
        "            if k in self._kept:\n                del self._kept[k]\n",
        "            if False:\n                del self._kept[k]\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "adaptive-evicts-inner-pages",
        "the adaptive policy lists pages with cached children as victims",
        "minivllm/cache/eviction.py",
        "        if entry.pinned or entry.children:\n            return\n",
        "        if entry.pinned:\n            return\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "adaptive-no-aging",
        "the adaptive policy's frequency segment never ages (LFU without the DA)",
        "minivllm/cache/eviction.py",
        "                self.age = max(self.age, entry.value)",
        "                pass",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "adaptive-unlearned-count-value",
        "the adaptive policy never refits the value of a request count from the trace",
        "minivllm/cache/eviction.py",
        "        if self._tallies % self.REFIT_EVERY == 0:\n            self._uses = self._fit_uses()",
        "        if False:\n            self._uses = self._fit_uses()",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "adaptive-count-value-not-monotone",
        "a higher request count may be worth less than a lower one",
        "minivllm/cache/eviction.py",
        "            uses[c] = max(uses[c], uses[c - 1])",
        "            uses[c] = uses[c]",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "adaptive-versions-per-entry",
        "a heap entry's version counts per entry, so a stale heap entry of an evicted key can match the key "
        "admitted again (a key in use was given up)",
        "minivllm/cache/eviction.py",
        "        entry.version = next(self._versions)\n        if entry.pinned",
        "        entry.version += 1\n        if entry.pinned",
        ("tests/test_adaptive_eviction.py", "-k", "random_concurrent or old_heap_entries"),
    ),
    Mutation(
        "adaptive-memory-ignored",
        "the adaptive policy recalls every key of its history whatever its memory",
        "minivllm/cache/eviction.py",
        "        if ghost is None or self.memory is None:\n            return ghost",
        "        if True:\n            return ghost",
        ("tests/test_adaptive_eviction.py", "tests/test_policy_robustness.py", "-k", "memory or revisits"),
    ),
    Mutation(
        "default-no-strays",
        "the default's cache gives up its own victims first, not the keys the configuration it follows gave "
        "up (after a switch it can keep other keys than its leader for good)",
        "minivllm/cache/eviction.py",
        "        key = self._pop(self._heaps[STRAY], can_evict)\n        if key is not None:",
        "        key = None\n        if key is not None:",
        ("tests/test_adaptive_eviction.py", "-k", "leaders_keys"),
    ),
    Mutation(
        "default-strays-not-marked-at-a-switch",
        "at a switch the cache's keys the new leader lacks are not marked as strays",
        "minivllm/cache/eviction.py",
        "            left = list(self.cache)  # every cached key is checked against the new leader",
        "            pass",
        ("tests/test_adaptive_eviction.py", "-k", "leaders_keys"),
    ),
    Mutation(
        "default-no-s3fifo-shares-configuration",
        "S3FIFO's shares are only the rules the cache runs while it follows S3FIFO, not a configuration with "
        "keys of its own",
        "minivllm/cache/eviction.py",
        "    (0.1, True, False, 0.5),\n    (0.1, False, False, 1.0),  # S3FIFO's keys",
        "    (0.1, False, False, 1.0),  # S3FIFO's keys",
        ("tests/test_policy_robustness.py", "-k", "hot_prompts"),
    ),
    Mutation(
        "default-s3fifo-shares-by-recency",
        "the configuration with S3FIFO's shares orders its frequent pages by recency, with a memory of one "
        "capacity (as it first did)",
        "minivllm/cache/eviction.py",
        "    (0.1, True, False, 0.5),\n",
        "    (0.1, False, False, 1.0),\n",
        ("tests/test_policy_robustness.py", "-k", "hot_prompts and 538"),
    ),
    Mutation(
        "default-no-s3fifo-shadow",
        "the default's last shadow runs S3FIFO's shares on ARC's segments instead of following S3FIFO itself",
        "minivllm/cache/eviction.py",
        "        self.shadows.append(FollowedS3FIFO(capacity, history))",
        "        self.shadows.append(Segmented(capacity, history, *CONFIGURATIONS[-1]))",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-shadow-evicts-pages-in-use",
        "the default's S3FIFO shadow is the seed's S3FIFO, which gives up pages in use the cache cannot",
        "minivllm/cache/eviction.py",
        "        self.shadows.append(FollowedS3FIFO(capacity, history))",
        "        self.shadows.append(S3FIFO(capacity))",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "followed-s3fifo-keeps-what-s3fifo-gave-up",
        "the followed S3FIFO does not mark the keys S3FIFO gave up as its first victims",
        "minivllm/cache/eviction.py",
        "            self.set_stray(gone, True)",
        "            pass",
        ("tests/test_eviction.py", "-k", "followed_s3fifo"),
    ),
    Mutation(
        "followed-s3fifo-readmits-as-stray",
        "a key S3FIFO takes back stays a stray in the followed S3FIFO",
        "minivllm/cache/eviction.py",
        "        self.set_stray(key, key not in self.s3fifo)",
        "        pass",
        ("tests/test_eviction.py", "-k", "followed_s3fifo"),
    ),
    Mutation(
        "followed-s3fifo-remove-keeps-s3fifos-key",
        "removing a key from the followed S3FIFO leaves it in the S3FIFO that picks its keys",
        "minivllm/cache/eviction.py",
        "        self.s3fifo.remove(key)\n",
        "",
        ("tests/test_eviction.py", "-k", "followed_s3fifo"),
    ),
    Mutation(
        "default-shadow-hits-past-a-miss",
        "a shadow scores every key it holds, also past the request's first missing block",
        "minivllm/cache/eviction.py",
        "            hit = self._hitting[i] = self._hitting[i] and key in shadow",
        "            hit = key in shadow",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-never-switches",
        "the default policy keeps its first configuration whichever shadow hits more",
        "minivllm/cache/eviction.py",
        "        leader = self._leader_past_the_noise()\n",
        "        leader = None\n",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "default-lru-configuration-partial-first",
        "the default's LRU configuration gives partial last blocks up first, as ARC proper does (a growing "
        "conversation's next turn continues that block)",
        "minivllm/cache/eviction.py",
        "        if self.by_recency:  # least recently released first, partial or not, in either segment\n"
        "            return (True, entry.released)",
        "        if self.by_recency:  # least recently released first, partial or not, in either segment\n"
        "            return (not entry.partial, entry.released)",
        ("tests/test_adaptive_eviction.py", "tests/test_policy_robustness.py", "-k", "recency or lru_holds"),
    ),
    Mutation(
        "default-two-deviations-at-the-bound",
        "the default asks a leader that hits what a cache holding every recent key would for two deviations "
        "of lead, as any other (one-off prompts that return are given up before the switch to LRU)",
        "minivllm/cache/eviction.py",
        "        z = self.Z_AT_BOUND if at_bound else self.Z",
        "        z = self.Z",
        ("tests/test_adaptive_eviction.py", "-k", "deviations_alone"),
    ),
    Mutation(
        "default-bound-on-one-block",
        "the default follows a leader at the bound on a lead of one block (right after the pool fills every "
        "shadow is at the bound: the first prompt LRU alone holds switches the cache)",
        "minivllm/cache/eviction.py",
        "self._at_bound(leader) and lead >= self._bound_lead",
        "self._at_bound(leader) and lead >= 1.0",
        ("tests/test_policy_robustness.py", "-k", "pool_fills"),
    ),
    Mutation(
        "default-bound-forgets-keys-past-a-miss",
        "the default's bound records a request's keys only up to its first miss (later keys look new when "
        "they return)",
        "minivllm/cache/eviction.py",
        "        self._seen.access(key)  # every key, past a miss too\n",
        "        self._bound_hitting and self._seen.access(key)\n",
        ("tests/test_policy_robustness.py", "-k", "floors"),
    ),
    Mutation(
        "default-switches-on-noise",
        "the default policy switches configuration on a lead above a fixed share of its window however noisy "
        "(a single long prompt one shadow happens to hold: 17 switches on the synthetic trace's last third)",
        "minivllm/cache/eviction.py",
        "            past_the_noise = lead >= self.MIN_LEAD and lead > z * self._lead_noise(leader, self.mode)\n",
        "            past_the_noise = lead > 0.01 * self.WINDOW * self.capacity\n",
        ("tests/test_policy_robustness.py", "-k", "third"),
    ),
    Mutation(
        "default-noise-without-the-request-under-way",
        "the default's noise test leaves out the request under way, whose hits the lead already holds (one "
        "long prompt that one shadow holds switches the cache)",
        "minivllm/cache/eviction.py",
        "        return (noise[i, j] + (self._request[i] - self._request[j]) ** 2) ** 0.5",
        "        return noise[i, j] ** 0.5",
        ("tests/test_adaptive_eviction.py", "-k", "one_long"),
    ),
    Mutation(
        "default-has-one-time-scale",
        "the default tests a lead over WINDOW alone (where a better configuration gains on a request in forty, "
        "its lead stays within the noise of the window for good)",
        "minivllm/cache/eviction.py",
        "        return self._long_leader_past_the_noise()\n",
        "        return None\n",
        ("tests/test_adaptive_eviction.py", "-k", "long_window"),
    ),
    Mutation(
        "default-follows-a-long-leader-behind-lately",
        "the default follows the leader over LONG_WINDOW even where it is behind the configuration in use over "
        "WINDOW (its hits have gone)",
        "minivllm/cache/eviction.py",
        "        if leader == self.mode or self.scores[leader] < self.scores[self.mode]:\n",
        "        if leader == self.mode:\n",
        ("tests/test_adaptive_eviction.py", "-k", "long_window"),
    ),
    Mutation(
        "default-long-test-at-z",
        "the default's long test switches at Z deviations, as the window's (a lead from the first pools of "
        "the synthetic trace's last quarter switched the cache twice: 1.017x -> 0.967x max(LRU, S3FIFO))",
        "minivllm/cache/eviction.py",
        "self.Z_BACK if self._left_lately(leader) else self.Z_LONG\n",
        "self.Z_BACK if self._left_lately(leader) else self.Z\n",
        ("tests/test_adaptive_eviction.py", "-k", "long_window"),
    ),
    Mutation(
        "default-switches-on-a-short-lead-far-behind-for-long",
        "the default follows a leader over WINDOW that trails the configuration in use far over LONG_WINDOW "
        "(scan#246 at 1k blocks: a scan or two S3FIFO happened to hold, 1.043x -> 0.969x max(LRU, S3FIFO))",
        "minivllm/cache/eviction.py",
        "            held_back = not at_bound and self._behind_for_long(leader)\n",
        "            held_back = False\n",
        ("tests/test_adaptive_eviction.py", "-k", "far_behind"),
    ),
    Mutation(
        "default-holds-back-a-leader-at-the-bound",
        "the default holds back a leader at the bound that trails the configuration in use over LONG_WINDOW "
        "(no configuration can beat it: the cache holds the wrong keys)",
        "minivllm/cache/eviction.py",
        "            held_back = not at_bound and self._behind_for_long(leader)\n",
        "            held_back = self._behind_for_long(leader)\n",
        ("tests/test_adaptive_eviction.py", "-k", "far_behind"),
    ),
    Mutation(
        "default-switches-on-a-residue",
        "the default switches on a lead of a fraction of a block past its noise (two shadows that have hit "
        "alike for 100,000 accesses keep the deviations of the last request they told apart)",
        "minivllm/cache/eviction.py",
        "            past_the_noise = lead >= self.MIN_LEAD and lead > z * self._lead_noise(leader, self.mode)\n",
        "            past_the_noise = lead > z * self._lead_noise(leader, self.mode)\n",
        ("tests/test_adaptive_eviction.py", "-k", "residue"),
    ),
    Mutation(
        "default-waits-for-a-share-of-the-window",
        "the default policy switches only once the lead also passes 1.5% of its window (on forests that fill "
        "the cache late, the LRU configuration's lead passed its noise long before and the trace ended first)",
        "minivllm/cache/eviction.py",
        "            past_the_noise = lead >= self.MIN_LEAD and lead > z * self._lead_noise(leader, self.mode)\n",
        "            past_the_noise = lead > max(z * self._lead_noise(leader, self.mode), 0.015 * self.WINDOW"
        " * self.capacity)\n",
        ("tests/test_adaptive_eviction.py", "-k", "deviations_alone"),
    ),
    Mutation(
        "no-overlap-for-small-models",
        "overlap stays off on the CPU whatever the model's size (a tiny model's step is mostly host work)",
        "minivllm/engine/llm_engine.py",
        "        return self.backend.is_gpu or weights <= OVERLAP_CPU_MAX_WEIGHT_BYTES",
        "        return self.backend.is_gpu",
        ("tests/test_overlap.py", "-k", "default"),
    ),
    Mutation(
        "arc-frequent-by-count",
        "ARC proper's frequency segment gives up its least used key first, not its least recently released",
        "minivllm/cache/eviction.py",
        "        return (entry.value if self.by_count else 0.0, entry.released)",
        "        return (entry.value if self.by_count else -entry.count, entry.released)",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "adaptive-no-adaptation",
        "ghost hits no longer move the adaptive policy's recency target",
        "minivllm/cache/eviction.py",
        "        if self._evictions[segment] - number >= free[segment]:\n            return",
        "        if True:\n            return",
        ("tests/test_adaptive_eviction.py",),
    ),
    Mutation(
        "pool-releases-head-first",
        "the page pool releases a request's pages head first",
        "minivllm/cache/page_pool.py",
        "        for page in reversed(pages):\n            assert self.refcount[page] > 0",
        "        for page in pages:\n            assert self.refcount[page] > 0",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "pool-keeps-unreachable-pages",
        "the pool keeps the pages extending an evicted page published (unreachable)",
        "minivllm/cache/page_pool.py",
        "        for child in self.children.pop(h, ()):",
        "        for child in ():",
        ("tests/test_prefix_cache.py", "-k", "unreachable"),
    ),
    Mutation(
        "hit-without-token-check",
        "a cache hit no longer compares the page's token ids",
        "minivllm/cache/page_pool.py",
        "if page is None or self.page_tokens[page] != tokens:",
        "if page is None:",
        ("tests/test_prefix_cache.py",),
    ),
    Mutation(
        "stop-string-leaks",
        "stop-string hold-back disabled",
        "server/generation.py",
        "end = len(self.text) if final else len(self.text) - self._held_back()",
        "end = len(self.text)",
        ("tests/test_server.py", "-k", "stop"),
    ),
    Mutation(
        "no-abort-on-close",
        "no abort when a stream closes",
        "minivllm/engine/async_engine.py",
        "                accepted.cancel()\n                self._inbox.put(_Abort(request_id))",
        "                accepted.cancel()",
        ("tests/test_faults.py", "-k", "cancelled"),
    ),
    # -- engine defects: counters, churn, faults, seeds ------------------------------------------------------
    Mutation(
        "cached-tokens-on-readmission",
        "a readmitted request counts its restored pages as cached prompt tokens again",
        SCHEDULER,
        "if self.config.enable_prefix_caching and seq.num_admissions == 0:",
        "if self.config.enable_prefix_caching:",
        ("tests/test_preemption.py",),
    ),
    Mutation(
        "readmit-in-preempting-step",
        "a step that preempted still admits (the victim may come straight back)",
        SCHEDULER,
        "if self.counters.preemptions == preemptions:",
        "if True:",
        ("tests/test_preemption.py",),
    ),
    Mutation(
        "never-fitting-request-preempts",
        "a request that can never fit preempts the others before it is stopped",
        SCHEDULER,
        "if need > self.kv.num_available() and self._stop_if_it_never_fits(seq):",
        "if need > self.kv.num_available() and len(self.running) == 1 and self._stop_if_it_never_fits(seq):",
        ("tests/test_preemption.py",),
    ),
    Mutation(
        "step-faults-escape",
        "a fault in a step escapes it: its requests are not failed (the loop retries it)",
        "minivllm/engine/llm_engine.py",
        "        except Exception as e:\n            failed = self.scheduler.step_seqs",
        "        except MemoryError as e:\n            failed = self.scheduler.step_seqs",
        ("tests/test_faults.py", "-k", "fault"),
    ),
    Mutation(
        "consecutive-choice-seeds",
        "choice i of a request with n > 1 samples with seed + i",
        "server/core.py",
        "choice_seed(s.seed, first_index + j)",
        "s.seed + first_index + j",
        ("tests/test_server.py", "-k", "seed"),
    ),
    Mutation(
        "decodes-sit-out-prefills",
        "a running decode gets no token in the steps in which a prompt is being prefilled",
        SCHEDULER,
        "if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 or budget == 0:",
        "if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 or budget == 0 or any("
        "s.in_prefill for s in self.running):",
        ("tests/test_scheduler.py", "-k", "every_step"),
    ),
    Mutation(
        "token-gap-from-nothing",
        "a request's first token counts as a gap (of every step the engine ran before it)",
        "minivllm/engine/llm_engine.py",
        "        if seq.last_token_step:\n",
        "        if True:\n",
        ("tests/test_engine.py", "-k", "long_prefill"),
    ),
    # -- the OpenAI API: sampling controls, grammars, tools ----------------------------------------------------
    Mutation(
        "grammar-mask-dropped",
        "the grammar's token mask is computed but not applied",
        "minivllm/engine/sampler.py",
        "    if bitmasks is not None:",
        "    if False:",
        ("tests/test_sampling.py", "-k", "json or lark or grammar"),
    ),
    Mutation(
        "grammar-end-ignored",
        "a request whose grammar is complete goes on generating",
        SCHEDULER,
        "elif seq.matcher is not None and seq.matcher.is_stopped():",
        "elif False:",
        ("tests/test_sampling.py", "-k", "lark or json"),
    ),
    Mutation(
        "presence-penalty-from-second-use",
        "the presence penalty applies from a token's second use",
        "minivllm/engine/sampler.py",
        "presence * (counts > 0)",
        "presence * (counts > 1)",
        ("tests/test_sampling.py", "-k", "penalt"),
    ),
    Mutation(
        "repetition-penalty-output-only",
        "the repetition penalty forgets the prompt",
        "minivllm/engine/sampler.py",
        "seqs[penalized[j]].token_ids) for j in repeat]",
        "seqs[penalized[j]].output_token_ids) for j in repeat]",
        ("tests/test_sampling.py", "-k", "penalt or repetition"),
    ),
    Mutation(
        "grammar-output-loses-its-last-token",
        "the last token is cut from the text whenever the finish reason is stop",
        "server/generation.py",
        "if out.stop_token_id is not None and tokens:",
        'if out.finish_reason == "stop" and tokens:',
        ("tests/test_api.py", "-k", "json_schema"),
    ),
    Mutation(
        "tool-history-dropped",
        "assistant tool calls in the history are left out of the prompt",
        "server/tools.py",
        "        if t.tool_calls:",
        "        if False:",
        ("tests/test_api.py", "-k", "round_trip"),
    ),
    Mutation(
        "call-markers-as-text",
        "a call's markers are text in its grammar, also where they are added tokens (Qwen's <tool_call>)",
        "server/tools.py",
        'return json.dumps(marker) if token is None else f"<[{token}]>"',
        "return json.dumps(marker)",
        ("tests/test_default_model.py", "-k", "call_grammar"),
    ),
    Mutation(
        "advice-never-pauses",
        "the cache advice's replay keeps running while the engine decodes (a nice-19 process took decode to 0.56x)",
        "minivllm/shadow.py",
        "                if self.busy() != paused:",
        "                if False:",
        ("tests/test_shadow.py", "-k", "idle"),
    ),
    Mutation(
        "advice-replays-a-shifted-pool",
        "the cache advice replays the pool one page larger than the factor says",
        "minivllm/shadow.py",
        "            pages = max(1, round(capacity * factor))",
        "            pages = max(1, round(capacity * factor)) + 1",
        ("tests/test_shadow.py",),
    ),
    Mutation(
        "generic-tool-results-unmerged",
        "in the generic tool format, each tool result is its own user turn (not one turn after the calls)",
        "server/generic_tools.py",
        "            if after_result:",
        "            if False:",
        ("tests/test_generic_tools.py", "-k", "renders"),
    ),
    Mutation(
        "generic-tools-left-out",
        "a template without a tool-call format gets no tool list in its prompt",
        "server/prompts.py",
        "            dicts, tools = generic_tools.render(dicts, tools), None",
        "            dicts, tools = generic_tools.render(dicts, None), None",
        ("tests/test_generic_tools.py",),
    ),
    Mutation(
        "request-dict-keys-unmarked",
        "control strings in a request's dict keys (parameter names, argument keys) stay control tokens",
        "server/prompts.py",
        "return {self._mark(k): self._mark(v) for k, v in value.items()}",
        "return {k: self._mark(v) for k, v in value.items()}",
        ("tests/test_default_model.py", "-k", "request_string"),
    ),
    Mutation(
        "logprob-bytes-of-text",
        "logprobs bytes are the UTF-8 of the token's decoded text",
        "server/chat.py",
        '"bytes": list(self.token_bytes(token_id))',
        '"bytes": list(self.token_text(token_id).encode())',
        ("tests/test_api.py", "-k", "bytes"),
    ),
    Mutation(
        "incomplete-character-dropped",
        "an output ending inside a multi-byte character loses its last bytes (DecodeStream's None)",
        "server/generation.py",
        "        if self.pending:  # DecodeStream",
        "        if False:  # DecodeStream",
        ("tests/test_api.py", "-k", "inside_a_character"),
    ),
    Mutation(
        "fim-text-parses-control-tokens",
        "a control-token string in a fill-in-the-middle prompt or suffix becomes that token",
        "server/prompts.py",
        "return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)",
        "return self.tokenizer.encode(text, add_special_tokens=False)",
        ("tests/test_fim.py",),
    ),
    Mutation(
        "responses-calls-dropped",
        "/v1/responses leaves the model's function calls out of its output",
        "server/responses.py",
        "            self.pending_calls.append(event.call)",
        "            pass",
        ("tests/test_responses.py", "-k", "forced"),
    ),
    Mutation(
        "responses-calls-lose-their-turn",
        "a function_call input item becomes an assistant turn of its own, apart from the text before it",
        "server/responses.py",
        "if last is not None and last.role == Role.ASSISTANT and thinking is None:",
        "if False:",
        ("tests/test_responses.py", "-k", "input_items"),
    ),
    Mutation(
        "responses-built-in-tools-offered",
        "a built-in tool (web_search, local_shell, ...) is rendered into the prompt as a function",
        "server/responses_protocol.py",
        'return [t for t in self.tools or () if t.type in ("function", "namespace")]',
        "return list(self.tools or ())",
        ("tests/test_responses.py", "-k", "built_in"),
    ),
    Mutation(
        "openai-streams-wait-for-the-first-token",
        "an OpenAI stream sends nothing (no headers) until the first token",
        "server/core.py",
        "    keepalive_s: float | None = KEEPALIVE_S",
        "    keepalive_s: float | None = None",
        ("tests/test_keepalive.py",),
    ),
    Mutation(
        "no-header-timeout",
        "a connection that never finishes its headers is never closed",
        "server/connections.py",
        "            self.header_timer = self.loop.call_later(self.timeout, self.close)",
        "            pass",
        ("tests/test_connections.py", "-k", "timed_out"),
    ),
    Mutation(
        "header-timeout-restarts",
        "every byte of a trickled request restarts its header timer",
        "server/connections.py",
        "        elif state is h11.IDLE:  # its request's headers are not all here yet\n"
        "            self._arm_header_timer()",
        "        elif state is h11.IDLE:  # its request's headers are not all here yet\n"
        "            self._cancel_header_timer()\n            self._arm_header_timer()",
        ("tests/test_connections.py", "-k", "timed_out"),
    ),
    Mutation(
        "idle-connections-hold-the-cap",
        "a connection past the cap closes no idle one, so idle sockets lock out /health",
        "server/connections.py",
        "        victim.close()\n        return True",
        "        return False",
        ("tests/test_connections.py", "-k", "lock_out"),
    ),
    Mutation(
        "one-prompt-lane",
        "long texts are templated and tokenized on the same worker as short ones",
        "server/prompts.py",
        "        builder = self.long if chars > LONG_TEXT_CHARS else self",
        "        builder = self",
        ("tests/test_prompt_lanes.py", "-k", "short_prompt"),
    ),
    Mutation(
        "huge-text-tokenized-whole",
        "a text far longer than the context is tokenized whole before it is refused",
        "server/prompts.py",
        "        if len(text) > room * TYPICAL_TOKEN_CHARS:",
        "        if False:",
        ("tests/test_prompt_lanes.py", "-k", "huge"),
    ),
    Mutation(
        "grammar-limit-mid-way-is-a-fault",
        "a grammar past llguidance's limits after some tokens is a 500 carrying the parser's state",
        SCHEDULER,
        "            seq.finish_detail, seq.error_param = refusal.message, refusal.param",
        '            seq.finish_detail = f"grammar error: {seq.matcher.get_error()}"',
        ("tests/test_hostile.py",),
    ),
    # -- the Anthropic Messages API --------------------------------------------------------------------------
    Mutation(
        "billing-header-in-the-prompt",
        "Claude Code's billing header (a new cch every request) is templated into the prompt",
        "server/anthropic_protocol.py",
        "if blocks and blocks[0].text.startswith(BILLING_HEADER):",
        "if False:",
        ("tests/test_messages.py", "-k", "billing"),
    ),
    Mutation(
        "cache-creation-counts-output-pages",
        "pages published past the prompt count as prompt tokens the request cached",
        KV_MANAGER,
        "if end <= req.num_prompt_tokens:",
        "if True:",
        ("tests/test_prefix_cache.py", "-k", "repeated"),
    ),
    Mutation(
        "stop-sequence-unreported",
        "an answer cut at a stop sequence reports end_turn",
        "server/messages.py",
        '    StopReason.STOP_STRING: "stop_sequence",',
        '    StopReason.STOP_STRING: "end_turn",',
        ("tests/test_messages.py", "-k", "stop_sequence"),
    ),
    Mutation(
        "no-pings-before-the-first-token",
        "a stream waits for the first token before it sends anything",
        "server/core.py",
        "        if conv.stream and writer.keepalive_s is not None:",
        "        if False:",
        ("tests/test_messages.py", "-k", "ping or order"),
    ),
    Mutation(
        "glm-calls-as-json",
        "a forced call on a GLM-format template is held to JSON, not to the template's argument tags",
        "server/tools.py",
        '        if parser.endswith(".glm47"):',
        "        if False:",
        ("tests/test_tagged_tools.py",),
    ),
    Mutation(
        "glm-optional-argument-required",
        "a GLM call's grammar treats every argument as optional, the required ones included",
        "server/tools.py",
        'arguments.append(rule if key in required else f"{rule}?")',
        'arguments.append(f"{rule}?")',
        ("tests/test_tagged_tools.py",),
    ),
    Mutation(
        "gpt-oss-sinks-ignored",
        "gpt-oss's attention leaves out its sink logits",
        "minivllm/models/layers.py",
        'getattr(attn, "sinks", None)',
        "None",
        ("tests/test_families.py", "-k", "gpt_oss"),
    ),
    Mutation(
        "gpt-oss-window-ignored",
        "gpt-oss's sliding-window layers attend to the whole context",
        "minivllm/models/gpt_oss.py",
        'body.window_size if kind == "sliding_attention" else None',
        "None",
        ("tests/test_families.py", "-k", "gpt_oss"),
    ),
    Mutation(
        "sinks-dropped-on-mlx-ops",
        "attention on MLX ops over several runs drops the sink column from the wrong end",
        KERNEL,
        "        probs = probs[..., 1:]",
        "        probs = probs[..., :-1]",
        ("tests/test_paged_attention.py", "-k", "sinks"),
    ),
    Mutation(
        "cpu-kernel-sinks-ignored",
        "the compiled CPU kernel leaves the sink out of each row's denominator",
        "kernels/cpu_attention.cpp",
        "float s = sinks ? expf(sink - m) : 0.f;",
        "float s = 0.f;",
        ("tests/test_paged_attention.py", "-k", "compiled and sinks"),
    ),
    # -- paged attention and page placement ---------------------------------------------------------------
    Mutation(
        "causal-block-sees-a-future-key",
        "a prefill block's queries see one key past their own position",
        KERNEL,
        "visible = seq.start + r1  # keys",
        "visible = seq.start + r1 + 1  # keys",
        ("tests/test_paged_attention.py",),
    ),
    Mutation(
        "runs-mask-shifted",
        "the causal mask of a context in several runs is shifted by one position",
        KERNEL,
        "mx.arange(S - L, S)[:, None]",
        "mx.arange(S - L + 1, S + 1)[:, None]",
        ("tests/test_paged_attention.py",),
    ),
    Mutation(
        "last-layer-query-at-chunk-start",
        "the last layer's sampled row attends from its chunk's first position, not its last",
        KERNEL,
        "start=self.seqs[i].start + self.seqs[i].num_new - c, num_new=c",
        "start=self.seqs[i].start, num_new=c",
        ("tests/test_engine.py",),
    ),
    Mutation(
        "last-layer-wrong-rows",
        "the last layer goes on with each sequence's first new token instead of its last",
        KERNEL,
        "ends = np.cumsum([s.num_new for s in self.seqs])",
        "ends = np.cumsum([0] + [s.num_new for s in self.seqs])[:-1] + 1",
        ("tests/test_engine.py",),
    ),
    Mutation(
        "numpy-softmax-unshifted",
        "the numpy softmax exponentiates the scores without subtracting their maximum",
        "kernels/activations.py",
        "out = np.subtract(s, s.max(axis=-1, keepdims=True))",
        "out = np.array(s)",
        ("tests/test_activations.py",),
    ),
    Mutation(
        "numpy-swiglu-sign",
        "the numpy SwiGLU takes exp(gate) for exp(-gate)",
        "kernels/activations.py",
        "out = np.negative(g)",
        "out = np.array(g)",
        ("tests/test_engine.py", "-k", "numpy"),
    ),
    Mutation(
        "quantized-matmul-drops-group-bias",
        "the quantized decode kernel forms its weights as level * scale, the groups' biases forgotten",
        "kernels/cpu_quantized_matmul.cpp",
        "w[j] = (float)q[j] * s + b;",
        "w[j] = (float)q[j] * s;",
        ("tests/test_cpu_quantized_matmul.py",),
    ),
    Mutation(
        "quantized-matmul-rows-past-one-pass",
        "the quantized decode kernel multiplies only its first pass of rows (8), the rest left unwritten",
        "kernels/cpu_quantized_matmul.cpp",
        "for (int r0 = 0; r0 < m; r0 += kRowsPerPass) {",
        "for (int r0 = 0; r0 < std::min(m, kRowsPerPass); r0 += kRowsPerPass) {",
        ("tests/test_cpu_quantized_matmul.py",),
    ),
    Mutation(
        "quantized-matmul-float16-scales-read-as-float32",
        "float16 scales and biases are passed to the quantized decode kernel as float32",
        "kernels/cpu_quantized_matmul.py",
        "int(scales.dtype == np.float16), group,",
        "0, group,",
        ("tests/test_cpu_quantized_matmul.py",),
    ),
    Mutation(
        "quantized-linear-kernel-never-used",
        "a quantized layer always multiplies its float32 copy: decode never reads the levels",
        "minivllm/models/quantized_linear.py",
        "if cpu_quantized_matmul.fits(x):",
        "if False:",
        ("tests/test_engine.py", "-k", "4bit"),
    ),
    Mutation(
        "cpu-kernel-sees-future-keys",
        "the compiled CPU kernel's softmax takes every key of the block, the causal mask forgotten",
        "kernels/cpu_attention.cpp",
        "int64_t hi = std::min(width, position - first + 1);",
        "int64_t hi = width;",
        ("tests/test_paged_attention.py", "-k", "compiled"),
    ),
    Mutation(
        "cpu-kernel-window-ignored",
        "the compiled CPU kernel's rows see keys before their sliding window",
        "kernels/cpu_attention.cpp",
        "int64_t lo = window > 0 ? std::max<int64_t>(0, position - window + 1 - first) : 0;",
        "int64_t lo = 0;",
        ("tests/test_paged_attention.py", "-k", "compiled"),
    ),
    Mutation(
        "cpu-kernel-last-run-only",
        "the compiled CPU kernel's values product keeps only the context's last run",
        "kernels/cpu_attention.cpp",
        "i == 0 ? 0.f : 1.f",
        "0.f",
        ("tests/test_paged_attention.py", "-k", "compiled"),
    ),
    Mutation(
        "cpu-kernel-group-head-mixup",
        "the compiled CPU kernel's query-head groups all read the first KV head's keys",
        "kernels/cpu_attention.cpp",
        "blocks.push_back({q, k_pool + (int64_t)g * slots * D,",
        "blocks.push_back({q, k_pool,",
        ("tests/test_paged_attention.py", "-k", "compiled"),
    ),
    Mutation(
        "cpu-kernel-never-used",
        "the engine never loads the compiled CPU kernel: attention stays on MLX ops",
        "minivllm/engine/llm_engine.py",
        'if self.backend.is_gpu or self.config.cpu_attention != "compiled":',
        "if True:",
        ("tests/test_long_context.py",),
    ),
    Mutation(
        "split-heads-misaligned",
        "attention split over CPU streams pairs query heads with the wrong KV head",
        KERNEL,
        "_attend(q[:, h0 * rep : h1 * rep], k, v, scale, window, s)",
        "_attend(q[:, h0 : h0 + (h1 - h0) * rep], k, v, scale, window, s)",
        ("tests/test_paged_attention.py",),
    ),
    Mutation(
        "placement-ignores-last-page",
        "a growing request no longer takes the page after its last one",
        "minivllm/cache/free_pages.py",
        "page = after + 1 if after is not None else -1",
        "page = -1",
        ("tests/test_free_pages.py",),
    ),
    # -- routing over replicas (the replay's rule and the Ray Serve router) ------------------------------------
    Mutation(
        "affinity-ignores-holders",
        "affinity forgets which replicas hold a prefix and picks the least-loaded replica",
        ROUTING,
        "first = next(r for r in by_load if self._bits[r] & mask)",
        "first = by_load[0]",
        ("tests/test_routing.py",),
    ),
    Mutation(
        "no-load-fallback",
        "affinity never yields to the least-loaded replica, however uneven the load",
        ROUTING,
        "return by_load[0] if self._overloaded(first) else first",
        "return first",
        ("tests/test_routing.py",),
    ),
    Mutation(
        "one-choice-for-cold-prefixes",
        "a prefix never seen goes to its rendezvous owner however loaded (one choice, not two)",
        ROUTING,
        "rendezvous_order(page_keys[0], self._bits)[:2]",
        "rendezvous_order(page_keys[0], self._bits)[:1]",
        ("tests/test_routing.py",),
    ),
    Mutation(
        "in-flight-never-ends",
        "a finished request still counts as load on its replica",
        ROUTING,
        "        if self._load.get(replica, 0) > 0:\n            self._load[replica] -= 1",
        "        pass",
        ("tests/test_routing.py",),
    ),
    Mutation(
        "dead-replica-still-holds",
        "a removed replica still counts as holding its prefixes",
        ROUTING,
        "self._live_mask &= ~bit",
        "pass",
        ("tests/test_routing.py",),
    ),
    Mutation(
        "router-ignores-the-prompt",
        "the Ray Serve router routes without the prompt's page hashes",
        "server/cluster/router.py",
        "        if prompt:\n            root = root_hash",
        "        if False:\n            root = root_hash",
        ("tests/test_cluster.py", "-k", "turn or burst"),
    ),
    # -- overlap: step n+1 queued before step n is read back -------------------------------------------------
    Mutation(
        "ahead-draw-ignores-position",
        "a step built ahead draws with the key of the previous output position",
        RUNNER,
        "len(seqs[i].token_ids) + ahead + j",
        "len(seqs[i].token_ids) + j",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "ahead-inputs-without-their-rows",
        "a step built ahead takes the running step's tokens as its inputs even when a request left the batch",
        RUNNER,
        "same = rows == list(range(len(after.sampling)))",
        "same = True",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "ahead-delivers-dropped-tokens",
        "a token computed ahead for a request that ended meanwhile is delivered",
        "minivllm/engine/llm_engine.py",
        "kept = [i for i, seq in enumerate(step.seqs) if not seq.is_finished]",
        "kept = list(range(len(step.seqs)))",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "ahead-ignores-waiting",
        "steps keep being built ahead while requests wait to be admitted",
        SCHEDULER,
        "if self.waiting or len(live) != len(self.running):",
        "if len(live) != len(self.running):",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "ahead-with-a-grammar",
        "a request under a grammar runs ahead (its mask needs the previous token on the host)",
        SCHEDULER,
        "                or seq.matcher is not None\n",
        "",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "ahead-with-penalties",
        "a penalized request runs ahead (its counts miss the previous token)",
        SCHEDULER,
        "                or seq.params.penalized\n",
        "",
        ("tests/test_overlap.py",),
    ),
    # -- model families ---------------------------------------------------------------------------------------
    Mutation(
        "rms-norm-without-eps",
        "the compiled RMSNorm serves every eps with the first one's",
        "minivllm/models/rms_norm.py",
        "    key = (module.eps, offset)",
        "    key = (offset,)",
        ("tests/test_rms_norm.py",),
    ),
    Mutation(
        "gemma-norm-without-its-offset",
        "Gemma's (1 + w) RMSNorm compiled as a plain one (w)",
        "minivllm/models/rms_norm.py",
        "OFFSETS = {nn.RMSNorm: 0.0, GemmaRMSNorm: 1.0}",
        "OFFSETS = {nn.RMSNorm: 0.0, GemmaRMSNorm: 0.0}",
        ("tests/test_rms_norm.py", "tests/test_families.py", "-k", "gemma or norm"),
    ),
    Mutation(
        "rope-table-ignores-the-base",
        "rope modules with another base (Gemma 3's local layers) share the first one's cos and sin",
        "minivllm/models/rope.py",
        "return (self.dims, self.input_scale, self.base, self.scale, freqs)",
        "return (self.dims, self.input_scale, self.scale, freqs)",
        ("tests/test_rope.py", "tests/test_families.py", "-k", "gemma or rope or base"),
    ),
    Mutation(
        "rope-module-known-by-id-alone",
        "a rope module made at a freed module's id is taken for it (its arguments and table reused)",
        "minivllm/models/rope.py",
        "if known is None or known[0]() is not module:",
        "if known is None:",
        ("tests/test_rope.py",),
    ),
    Mutation(
        "rope-sin-of-the-first-half",
        "the rotation's second half adds x2 * sin instead of x2 * cos",
        "minivllm/models/rope.py",
        "x1 * sin + x2 * cos]",
        "x1 * sin + x2 * sin]",
        ("tests/test_rope.py",),
    ),
    Mutation(
        "qk-norm-skipped",
        "Qwen3's q/k RMSNorms are not applied",
        "minivllm/models/layers.py",
        "    return x if norm is None else rms_norm(norm, x)",
        "    return x",
        ("tests/test_families.py",),
    ),
    Mutation(
        "kv-head-dim-from-hidden",
        "the KV pools' head_dim is hidden_size / heads, not the config's (Qwen3's differs)",
        RUNNER,
        '        or getattr(model.args, "head_dim", None)\n',
        "",
        ("tests/test_families.py", "-k", "qwen3"),
    ),
    Mutation(
        "gemma-window-ignored",
        "Gemma 3's local layers attend to the whole context",
        "minivllm/models/gemma3_text.py",
        "windows = tuple(window if b.self_attn.is_sliding else None for b in model.model.layers)",
        "windows = ()",
        ("tests/test_families.py",),
    ),
    Mutation(
        "gemma-embeddings-unscaled",
        "Gemma 3's embeddings are not scaled by sqrt(hidden_size)",
        "minivllm/models/gemma3_text.py",
        "return h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)",
        "return h",
        ("tests/test_families.py",),
    ),
    Mutation(
        "phi3-keys-for-values",
        "Phi-3's fused projection is split with keys and values swapped",
        "minivllm/models/phi3.py",
        "q, k, v = mx.split(attn.qkv_proj(x), [q_size, q_size + kv_size], axis=-1)",
        "q, v, k = mx.split(attn.qkv_proj(x), [q_size, q_size + kv_size], axis=-1)",
        ("tests/test_families.py",),
    ),
    Mutation(
        "window-mask-one-short",
        "a sliding-window prefill block's queries see one key fewer than their window",
        KERNEL,
        "visible & (keys > queries - window)",
        "visible & (keys > queries - window + 1)",
        ("tests/test_paged_attention.py",),
    ),
    Mutation(
        "sliding-window-accepted",
        "a model with sliding-window layers loads",
        "minivllm/models/families.py",
        '    if config.get("use_sliding_window") or "sliding_attention" in layer_types:',
        "    if False:",
        ("tests/test_families.py",),
    ),
    Mutation(
        "ahead-at-the-old-position",
        "a step built ahead runs its token at the previous step's position",
        RUNNER,
        "computed, ahead = [len(s.token_ids) for s in seqs], 1",
        "computed, ahead = [len(s.token_ids) - 1 for s in seqs], 1",
        ("tests/test_overlap.py",),
    ),
    Mutation(
        "model-routing-ignored",
        "every request goes to the first served model, whatever its `model` says",
        "server/core.py",
        "    return states[model]",
        "    return next(iter(states.values()))",
        ("tests/test_multi_model.py",),
    ),
    # -- the CPU weight layout ------------------------------------------------------------------------------
    Mutation(
        "layout-drops-the-bias",
        "a transposed layer leaves out its bias (q/k/v projections have one)",
        LAYOUT,
        "            return mx.addmm(self.bias, x, self.weight_t)",
        "            return x @ self.weight_t",
        LAYOUT_TESTS,
    ),
    Mutation(
        "layout-keeps-the-old-weight",
        "a swapped layer keeps its [out, in] weight beside the transposed copy",
        LAYOUT,
        '    layer = TransposedLinear(mx.contiguous(old.weight.T), old.get("bias"))\n',
        '    layer = TransposedLinear(mx.contiguous(old.weight.T), old.get("bias"))\n    layer.weight = old.weight\n',
        LAYOUT_TESTS,
    ),
    Mutation(
        "layout-ignores-prefill",
        "a shape goes transposed when that is faster for decode however much slower for prefill",
        LAYOUT,
        "            and self.transposed[prefill] <= PREFILL_SLACK * self.native[prefill]",
        "            and self.transposed[prefill] <= 10 * PREFILL_SLACK * self.native[prefill]",
        LAYOUT_TESTS,
    ),
    # -- speculative decoding ------------------------------------------------------------------------------
    Mutation(
        "spec-accepts-every-draft",
        "a verification accepts every drafted token, whatever the target draws",
        "minivllm/engine/ngram_draft.py",
        "while n < len(draft) and sampled[n] == draft[n]:",
        "while n < len(draft):",
        ("tests/test_speculative.py", "-k", "target_distribution"),  # the chi-square test alone
    ),
    Mutation(
        "spec-rejected-kv-counts-as-computed",
        "the KV of rejected drafted tokens counts as computed (and may be published)",
        SCHEDULER,
        "seq.num_computed_tokens += n - rejected",
        "seq.num_computed_tokens += n",
        SPECULATIVE_TESTS,
    ),
    Mutation(
        "spec-keeps-rejected-pages",
        "the pages only rejected drafted tokens were written to are kept",
        SCHEDULER,
        "        if not seq.is_finished:\n            self.kv.truncate(seq.cache, len(seq.token_ids))\n",
        "",
        SPECULATIVE_TESTS,
    ),
    Mutation(
        "spec-tokens-after-the-end",
        "accepted tokens after a stop token are appended too",
        SCHEDULER,
        "break  # tokens after an EOS, a stop token or the length limit are dropped",
        "continue",
        SPECULATIVE_TESTS,
    ),
    Mutation(
        "spec-rows-share-a-draw",
        "every row of a verification draws with the key of its first position",
        RUNNER,
        "len(seqs[i].token_ids) + ahead + j",
        "len(seqs[i].token_ids) + ahead",
        SPECULATIVE_TESTS,
    ),
    Mutation(
        "spec-draft-evicts-or-overflows",
        "a draft is not bounded by the free pages",
        SCHEDULER,
        "room = min(share, self.kv.free_room(seq.cache) - len(seq.token_ids))",
        "room = share",
        SPECULATIVE_TESTS,
    ),
    # -- pins, and why a prompt missed ----------------------------------------------------------------------
    Mutation(
        "messages-without-key-domain",
        "chat requests (Anthropic Messages among them) share one cache domain whatever their API key",
        "server/core.py",
        "cache = CacheHints(cache_salt(request, conv.cache_salt), pins)",
        "cache = CacheHints(conv.cache_salt, pins)",
        ("tests/test_cache_isolation.py",),
    ),
    Mutation(
        "pinned-pages-evictable",
        "the allocator may evict a pinned page",
        "minivllm/cache/page_pool.py",
        "self.refcount[self.index[h]] == 0 and h not in self.pinned)",
        "self.refcount[self.index[h]] == 0)",
        PINS_TESTS,
    ),
    Mutation(
        "pins-not-refreshed",
        "a restore of a pinned prefix does not start its TTL again",
        KV_MANAGER,
        "        self.pins.refresh(req.full_page_hashes(self.page_size)[: len(hits)])\n",
        "",
        PINS_TESTS,
    ),
    Mutation(
        "pins-unbounded",
        "pins hold more than half the pool: the oldest never give way",
        "minivllm/cache/pins.py",
        "while self.num_pages + self._new_pages(hashes) > self.limit:",
        "while False:",
        PINS_TESTS,
    ),
    Mutation(
        "pins-uncut",
        "a new pin is not cut to the room left: pins pass half the pool when others hold their shares",
        "minivllm/cache/pins.py",
        "change.kept = hashes = hashes[: held + max(0, self.limit - self.num_pages)]",
        "change.kept = hashes",
        PINS_TESTS,
    ),
    Mutation(
        "pins-across-keys",
        "a key's new pin unpins another key's pins within their fair share",
        "minivllm/cache/pins.py",
        "        if pages <= share and not last_resort:\n            return None\n",
        "",
        PINS_TESTS,
    ),
    Mutation(
        "burst-closes-one",
        "a closed connection stays in the book until it is gone: a burst closes the same one again and again",
        "server/connections.py",
        "        self._stop_waiting()  # at once: the next connection of a burst must pick another victim\n",
        "",
        ("tests/test_connections.py", "-k", "burst"),
    ),
    Mutation(
        "stalled-bodies-hold-the-cap",
        "a request whose body stalls counts as served: stalled bodies lock out /health",
        "server/connections.py",
        "            self._cancel_header_timer()\n            self._wait()\n",
        "            self._cancel_header_timer()\n            self._stop_waiting()\n",
        ("tests/test_connections.py", "-k", "stalled"),
    ),
    Mutation(
        "no-body-timeout",
        "a body that stops coming is waited for for ever",
        "server/gateway.py",
        "done, _ = await asyncio.wait((piece, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)",
        "done, _ = await asyncio.wait((piece, stop), return_when=asyncio.FIRST_COMPLETED)",
        ("tests/test_connections.py", "-k", "408"),
    ),
    Mutation(
        "no-graceful-shutdown-limit",
        "minivllm serve waits on SIGTERM for every request, a body that never ends included",
        "server/connections.py",
        "        timeout_graceful_shutdown=settings.shutdown_timeout + SHUTDOWN_GRACE_S,\n",
        "",
        ("tests/test_hardening.py", "-k", "sigterm_exits and serve"),
    ),
    Mutation(
        "plain-uvicorn-unguarded",
        "under plain uvicorn the app does not hand its guard and shutdown limit to the server",
        "server/app.py",
        "        guard_running_server(settings)",
        "        pass",
        ("tests/test_hardening.py", "-k", "sigterm_exits and uvicorn"),
    ),
    Mutation(
        "count-whole-run",
        "a long run with no word boundary is one piece: a huge text is tokenized whole before its 400",
        "server/prompts.py",
        "        if cut or start + 2 * size >= len(text):",
        "        if True:",
        ("tests/test_hardening.py", "-k", "no_word_boundary"),
    ),
    Mutation(
        "disk-opens-pipes",
        "the disk tier opens a page file blocking: a named pipe in its place hangs the reader",
        "minivllm/cache/page_file.py",
        "os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW",
        "os.O_RDONLY | os.O_NOFOLLOW",
        ("tests/test_disk_tier.py", "-k", "replaced"),
    ),
    Mutation(
        "disk-reads-directories",
        "the disk tier's start treats a directory in pages/ as a file: the whole tier goes off",
        "minivllm/cache/disk_tier.py",
        "            if not entry.is_file(follow_symlinks=False):",
        "            if False:",
        ("tests/test_disk_tier.py", "-k", "not_files"),
    ),
    Mutation(
        "full-disk-exits",
        "a disk whose free tenth holds no page stops the engine instead of serving from RAM",
        "minivllm/engine/llm_engine.py",
        "            if self.config.kv_disk_bytes:\n                raise",
        "            if True:\n                raise",
        ("tests/test_kv_disk.py", "-k", "too_full"),
    ),
    Mutation(
        "disk-dir-escapes",
        "a served model name is a directory name as it is: `../` leads outside MINIVLLM_KV_DISK_DIR",
        "server/settings.py",
        '    if re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}", name):',
        "    if True:",
        ("tests/test_multi_model.py", "-k", "inside"),
    ),
    Mutation(
        "layout-times-small-matrices",
        "auto times matrices that fit the caches: a tiny model's layout becomes noise",
        "minivllm/models/cpu_layout.py",
        "measured = [s for s in shapes if _shape_bytes(s) >= MIN_MEASURED_BYTES]",
        "measured = shapes",
        ("tests/test_cpu_layout.py", "-k", "small_matrices"),
    ),
    Mutation(
        "stalled-bodies-hold-the-budget",
        "bodies still arriving never give way: stalled large bodies hold every other POST at 429",
        "server/gateway.py",
        "            victim = next((b for b in self.arriving if b is not keep), None)",
        "            victim = None",
        ("tests/test_hardening.py", "-k", "gives_way"),
    ),
    Mutation(
        "slow-blas-silent",
        "a machine without OpenBLAS is not told it runs ~60x slower",
        "server/app.py",
        "        app.state.warnings = [w for w in [slow_blas_warning(detect_backend())] if w]",
        "        app.state.warnings = []",
        ("tests/test_web.py", "-k", "openblas"),
    ),
    Mutation(
        "disk-deletes-pinned-pages",
        "the disk tier's budget deletes pinned pages",
        "minivllm/cache/disk_tier.py",
        "if keep and e in self._pinned and record is not None:",
        "if False:",
        PINS_TESTS,
    ),
    Mutation(
        "miss-always-new",
        "a page evicted lately is reported as new content",
        KV_MANAGER,
        "if hashes[found] in self.pool.evicted:",
        "if False:",
        PINS_TESTS + ("tests/test_cache_api.py",),
    ),
    Mutation(
        "miss-message-off-by-one",
        "the message holding a miss is the one after it",
        "server/prompts.py",
        "            return lo\n",
        "            return lo + 1\n",
        ("tests/test_cache_api.py",),
    ),
    Mutation(
        "peer-ttft-one-definition",
        "the peer benchmark's first-chunk TTFT is timed to the first content instead",
        "benchmarks/peer.py",
        'return (r.first_chunk_at if definition == "first-chunk" else r.first_token_at) - r.sent_at',
        "return r.first_token_at - r.sent_at",
        ("tests/test_peer_options.py", "-k", "ttft"),
    ),
    Mutation(
        "peer-bundled-blas-keeps-openblas",
        "the peer run with MLX's bundled BLAS keeps an inherited OpenBLAS preload",
        "benchmarks/harness/servers.py",
        'if p and "openblas" not in p',
        "if p",
        ("tests/test_peer_options.py", "-k", "blas"),
    ),
    # -- the field policy and what agents send ---------------------------------------------------------------
    Mutation(
        "ignored-fields-unnamed",
        "hints accepted without effect are not named in x-minivllm-ignored",
        "server/core.py",
        "    if not ignored:\n        return {}",
        "    if True:\n        return {}",
        ("tests/test_field_policy.py", "-k", "hints or sends"),
    ),
    Mutation(
        "max-tokens-not-clamped",
        "a max_tokens past the room the context leaves is passed on (and refused) instead of clamped",
        "server/core.py",
        "        return max_tokens, False\n    return None, True",
        "        return max_tokens, False\n    return max_tokens, True",
        ("tests/test_field_policy.py", "-k", "context"),
    ),
    Mutation(
        "late-system-hoisted",
        "a system message inside messages[] is moved up beside the system prompt",
        "server/messages.py",
        "            turns.append(Turn(Role.SYSTEM, a.join_text(m.blocks()), source=i))",
        "            turns.insert(len(turns) > 0, Turn(Role.SYSTEM, a.join_text(m.blocks()), source=i))",
        ("tests/test_field_policy.py", "-k", "mid_conversation"),
    ),
    Mutation(
        "late-system-not-folded",
        "a template that renders system turns only first is given a later one (and refuses the prompt)",
        "server/prompts.py",
        "            dicts = _fold_late_system_turns(dicts)",
        "            pass",
        ("tests/test_field_policy.py", "-k", "late_system"),
    ),
    Mutation(
        "deferred-tools-listed",
        "a deferred tool, once loaded, joins the template's tool list (the cached prefix changes)",
        "server/messages.py",
        "listed=not tool.defer_loading",
        "listed=True",
        ("tests/test_field_policy.py", "-k", "deferred"),
    ),
    Mutation(
        "namespace-dropped",
        "a call of a namespaced function comes back without its namespace",
        "server/responses.py",
        "                namespace=call.namespace,",
        "                namespace=None,",
        ("tests/test_field_policy.py", "-k", "namespaced"),
    ),
    Mutation(
        "thinking-budget-ignored",
        "budget_tokens and effort do not bound the thinking",
        "server/core.py",
        "    if end is not None and conv.thinking.budget_tokens is not None:",
        "    if False:",
        ("tests/test_thinking.py", "-k", "budget"),
    ),
    Mutation(
        "thinking-signature-unread",
        "a thinking block sent back is rendered from its text, not its signature (omitted thinking is lost)",
        "server/messages.py",
        'unseal(b.signature) or b.thinking for b in blocks if b.type == "thinking"',
        'b.thinking for b in blocks if b.type == "thinking"',
        ("tests/test_thinking.py", "-k", "signed"),
    ),
    Mutation(
        "explain-across-keys",
        "GET /v1/cache/explain shows every API key's requests to any key",
        "server/cache_api.py",
        "for r in st.explained if r.domain == domain]",
        "for r in st.explained]",
        ("tests/test_cache_isolation.py", "-k", "own_key"),
    ),
    Mutation(
        "count-tokens-breakpoints-unchecked",
        "count_tokens accepts cache_control breakpoints that /v1/messages refuses",
        "server/messages.py",
        "    marks = breakpoints(body, turns)  #",
        "    marks = breakpoints(body, turns) if max_tokens is not None else ()  #",
        ("tests/test_field_policy.py", "-k", "breakpoints"),
    ),
    Mutation(
        "page-framable",
        "the web page may be framed by another site",
        "server/web.py",
        '"X-Frame-Options": "DENY",',
        '"X-Frame-Options": "SAMEORIGIN",',
        ("tests/test_field_policy.py", "-k", "framed"),
    ),
    Mutation(
        "grammar-cache-across-domains",
        "a grammar compiled for one cache domain (API key) is reused for another, so its timing leaks",
        "minivllm/engine/grammar.py",
        "        return self._compiled((domain, text)).deep_copy()",
        "        return self._compiled((None, text)).deep_copy()",
        ("tests/test_hardening.py", "-k", "cache_domain"),
    ),
    # -- hybrid models: the recurrent state and its snapshots -------------------------------------------------
    Mutation(
        "hybrid-restore-from-zeros",
        "a hybrid model's restored prefix resumes from a zero state instead of its snapshot",
        RUNNER,
        "            begin = seq.cache.restored_state  # its admission restored a cached prefix",
        "            begin = None",
        HYBRID_TESTS,
    ),
    Mutation(
        "hybrid-restore-without-state",
        "a hybrid model restores cached pages that have no snapshot at their end",
        KV_MANAGER,
        "            if h not in self.snapshots:",
        "            if h not in self.snapshots and False:",
        HYBRID_TESTS,
    ),
    Mutation(
        "hybrid-snapshot-outlives-page",
        "a snapshot is kept after the pool evicted its page",
        KV_MANAGER,
        "            pool.on_drop = self.snapshots.drop",
        "            pass",
        HYBRID_TESTS,
    ),
    Mutation(
        "hybrid-decode-batch-states",
        "every decode token of a batch keeps the first sequence's state",
        "minivllm/models/linear_attention.py",
        "            states.seqs[j].delta.append(delta[i : i + 1])",
        "            states.seqs[j].delta.append(delta[0:1])",
        HYBRID_TESTS,
    ),
    Mutation(
        "hybrid-no-branch-point",
        "no snapshot where a prompt leaves the cached prompts",
        KV_MANAGER,
        "            or p == req.branch_pages * size\n",
        "",
        HYBRID_TESTS,
    ),
    Mutation(
        "hybrid-waiter-state-unwanted",
        "a prefix flight's prefill keeps no state where its waiters' shared pages end",
        SCHEDULER,
        "        self.kv.want_state(seq.cache, shared)",
        "        pass",
        HYBRID_TESTS,
    ),
    Mutation(
        "hybrid-unread-state-used",
        "a state the disk tier could not read is used all the same",
        KV_MANAGER,
        "if n < len(r.read.records) or (r.state is not None and r.state.num_ok == 0):",
        "if n < len(r.read.records):",
        HYBRID_TESTS,
    ),
    # -- Gemma 4 ---------------------------------------------------------------------------------------------
    Mutation(
        "gemma4-no-softcap",
        "Gemma 4's logits not soft-capped",
        "minivllm/models/layers.py",
        "    if arch.logit_softcap:",
        "    if False:",
        GEMMA4_TESTS,
    ),
    Mutation(
        "gemma4-no-per-layer-inputs",
        "Gemma 4's per-layer inputs never gate the blocks",
        GEMMA4,
        "        gate_input = None if inputs is None else inputs[:, layer]",
        "        gate_input = None",
        GEMMA4_TESTS,
    ),
    Mutation(
        "gemma4-values-unnormed",
        "Gemma 4's values stored without their norm",
        GEMMA4,
        "store_kv(kv, layer, layout, k, attn.v_norm(v))",
        "store_kv(kv, layer, layout, k, v)",
        GEMMA4_TESTS,
    ),
    Mutation(
        "gemma4-experts-unnormed",
        "Gemma 4's dense MLP beside the experts without its own norm",
        GEMMA4,
        "    return rms_norm(block.post_feedforward_layernorm_1, dense) + ",
        "    return dense + ",
        GEMMA4_TESTS,
    ),
    Mutation(
        "gemma4-no-window",
        "Gemma 4's local layers attend to the whole context",
        GEMMA4,
        "    windows = [body.window_size if b.self_attn.is_sliding else None for b in body.layers]",
        "    windows = [None for b in body.layers]",
        GEMMA4_TESTS,
    ),
    Mutation(
        "gemma4-calls-as-json",
        "a forced call on a Gemma 4 template written as JSON, which its parser cannot read",
        "server/tools.py",
        "        if self.gemma_quote is not None and all(_flat(t.parameters) for t in tools):",
        "        if False:",
        ("tests/test_gemma4_format.py",),
    ),
    Mutation(
        "gemma4-optional-arguments-any-order",
        "a Gemma 4 call's optional arguments in any order, a comma before the first",
        "server/tools.py",
        "for o in optional[k + 1 :])]) for k, first in enumerate(optional)",
        "for o in optional)]) for k, first in enumerate(optional)",
        ("tests/test_gemma4_format.py",),
    ),
    Mutation(
        "think-start-of-one-token",
        "thinking opened by a template found only in the prompt's last four tokens (a start of several)",
        "server/core.py",
        "    tail = tokenizer.decode(prompt[-tail_tokens:])",
        "    tail = tokenizer.decode(prompt[-4:])",
        ("tests/test_gemma4_format.py",),
    ),
    Mutation(
        "kv-pages-mixed-shapes",
        "a page's bytes written back into pools of another shape in the wrong order",
        RUNNER,
        "        for k, (heads, dim) in enumerate(g.layers * 2):",
        "        for k, (heads, dim) in enumerate(g.layers[::-1] * 2):",
        ("tests/test_kv_disk.py",),
    ),
    # -- Harmony (gpt-oss) ---------------------------------------------------------------------------------
    Mutation(
        "harmony-tool-result-to-user",
        "a tool's result rendered as addressed to the user",
        HARMONY,
        '            .with_recipient("assistant")',
        '            .with_recipient("user")',
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-reasoning-as-answer",
        "the analysis channel read as the answer",
        HARMONY,
        '            analysis = self.parser.current_channel == "analysis"',
        '            analysis = self.parser.current_channel == "reasoning"',
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-unbounded-reasoning",
        "a forced output's reasoning not bounded by the thinking budget",
        HARMONY,
        'bound = f"[max_tokens={thinking_tokens}]" if thinking_tokens is not None else ""',
        'bound = ""',
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-effort-ignored",
        "the request's reasoning effort not in the system message",
        HARMONY,
        "        return ReasoningEffort.LOW\n",
        "        return ReasoningEffort.MEDIUM\n",
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-cut-call-lost",
        "a call whose stop token ended the output never read",
        HARMONY,
        "                    self.parser.process_eos()",
        "                    pass",
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-offline-vocabulary-unused",
        "offline, the vocabulary rebuilt from the model's tokenizer not given to openai-harmony",
        HARMONY,
        '    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)  # where openai-harmony reads it\n',
        "",
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-forced-call-reasons-unasked",
        "a forced call on gpt-oss reasons first, without bound, when the request did not ask for reasoning",
        "server/core.py",
        "        asked = conv.thinking.mode == ThinkingMode.ON",
        "        asked = conv.thinking.mode != ThinkingMode.OFF",
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-turns-at-default-effort",
        "the turn holding a prompt token looked for in a rendering at the default reasoning level",
        "server/prompts.py",
        "            ends = await self.message_ends(turns, tools, ids, list(range(1, len(turns) + 1)), reasoning)",
        "            ends = await self.message_ends(turns, tools, ids, list(range(1, len(turns) + 1)))",
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-endless-header",
        "output that never ends a message header (an untrained model) swallowed as a header, no text",
        HARMONY,
        "            if len(self.header) > MAX_HEADER_TOKENS:",
        "            if False:",
        HARMONY_TESTS,
    ),
    Mutation(
        "harmony-budget-no-next-message",
        "a reasoning cut at the thinking budget continued without the next message's header",
        "server/generation.py",
        "                    closing += budget.resume\n",
        "",
        HARMONY_TESTS,
    ),
    Mutation(
        "rope-split-shares-first-offsets",
        "tokens rotated a few at a time all take the first chunk's positions",
        "minivllm/models/rope.py",
        "offset=positions[i : i + rows]",
        "offset=positions[:rows]",
        ("tests/test_rope.py",),
    ),
    Mutation(
        "cuda-rope-never-splits",
        "MLX's CUDA rope gets every token in one call, whatever its rotated dims",
        "minivllm/models/rope.py",
        "    if dims >= 32:\n        return None\n",
        "    return None\n",
        ("tests/test_rope.py",),
    ),
]


@dataclass
class Outcome:
    mutation: Mutation
    status: str  # "caught", "MISSED", "stale"
    test: str = ""
    seconds: float = 0.0


def copy_tree(dst: Path) -> None:
    """Tracked files and untracked, not ignored ones: the working tree as it is, without build outputs."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listing.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def run_tests(root: Path, args: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """(passed, first failing test or why it failed)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {timeout:.0f} s (a hang)"
    if proc.returncode == 0:
        return True, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    return False, failed[0] if failed else f"pytest exit {proc.returncode}: {proc.stdout[-300:]}"


def applies(mutation: Mutation, root: Path = REPO) -> bool:
    """Whether the mutation's source text is in its file exactly once (else it is stale)."""
    path = root / mutation.path
    return path.is_file() and path.read_text().count(mutation.old) == 1


def stale_mutations(root: Path = REPO) -> list[str]:
    return [m.name for m in MUTATIONS if not applies(m, root)]


def check(mutation: Mutation, root: Path, timeout: float) -> Outcome:
    if not applies(mutation, root):
        return Outcome(mutation, "stale", f"{mutation.path}: text not found exactly once")
    path = root / mutation.path
    source = path.read_text()
    start = time.monotonic()
    try:
        path.write_text(source.replace(mutation.old, mutation.new))
        passed, test = run_tests(root, mutation.tests, timeout)
    finally:
        path.write_text(source)
    return Outcome(mutation, "MISSED" if passed else "caught", test, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="mutations to check (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=float, default=600, help="seconds per test run")
    p.add_argument("--no-baseline", action="store_true", help="skip checking that the unmutated tree passes")
    args = p.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    if args.list:
        for m in MUTATIONS:
            print(f"{m.name:32} {m.what}  [{' '.join(m.tests)}]")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        p.error(f"unknown mutations: {', '.join(unknown)} (see --list)")
    selected = [known[n] for n in args.names] if args.names else MUTATIONS

    with tempfile.TemporaryDirectory(prefix="minivllm-mutations-") as tmp:
        root = Path(tmp) / REPO.name
        root.mkdir()
        copy_tree(root)
        shared = REPO.parent / "shared"  # the real traces, beside the checkout, where the tests look
        if shared.is_dir():
            (Path(tmp) / "shared").symlink_to(shared)
        if not args.no_baseline:
            files = sorted({t for m in selected for t in m.tests if t.endswith(".py")})
            print(f"baseline: {' '.join(files)}", flush=True)
            passed, test = run_tests(root, tuple(files), args.timeout)
            if not passed:
                print(f"the unmutated tree fails {test}: fix that first", file=sys.stderr)
                return 2
        outcomes = []
        for m in selected:
            print(f"{m.name} ...", end=" ", flush=True)
            outcomes.append(check(m, root, args.timeout))
            print(f"{outcomes[-1].status} {outcomes[-1].test}", flush=True)

    print("\n| mutation | result | caught by |\n|---|---|---|")
    for o in outcomes:
        print(f"| {o.mutation.what} (`{o.mutation.name}`) | {o.status} | {o.test} |")
    applied = [o for o in outcomes if o.status != "stale"]
    caught = sum(o.status == "caught" for o in applied)
    print(f"\ncaught {caught} of {len(applied)} mutations", end="")
    stale = len(outcomes) - len(applied)
    print(f"; {stale} stale (their source text changed: update them)" if stale else "")
    return 0 if caught == len(applied) and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
