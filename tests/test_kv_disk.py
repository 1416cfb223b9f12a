"""The disk tier under the RAM pool, in the engine: restore from disk with mlx-lm's outputs, persistence
across restarts and kill -9, the budget, damaged or foreign files never served, a full or unusable disk,
and reads that make only their own request wait (the tier alone: tests/test_disk_tier.py). Waits are for progress (flush, a read done),
never for a number of seconds."""

import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from minivllm import EngineConfig, SamplingParams
from minivllm.cache import disk_tier
from minivllm.cache.disk_tier import DiskTier
from minivllm.cache.page_file import file_name
from minivllm.cache.page_hash import extend_page_hashes
from minivllm.engine.grammar import MaskCounters
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.model_runner import KVGeometry, ModelRunner
from tests.reference import MlxLmReference
from tests.test_engine import random_prompts
from tests.tiny_model import BYTES_PER_PAGE, make_tiny_model

REPO = Path(__file__).resolve().parent.parent
PAGE = 16
RAM_PAGES = 12  # a small pool: two 150-token prompts evict everything before them


def make_engine(model_dir, disk_dir, disk_bytes=4 << 20, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", RAM_PAGES * BYTES_PER_PAGE)
    kw.setdefault("single_flight", "off")
    return LLMEngine(
        EngineConfig(model=str(model_dir), kv_disk_dir=str(disk_dir), kv_disk_bytes=disk_bytes, **kw)
    )


def generate(engine, rid, prompt, n=8):
    seq = engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    return seq


def evict_ram(engine, seed):
    """Two other prompts that need the whole RAM pool; their pages go to disk too."""
    for i, prompt in enumerate(random_prompts([150, 150], seed=seed + 10_000)):  # no shared prefix
        generate(engine, f"evict-{seed}-{i}", prompt)
    engine.kv.disk.flush()


def page_path(disk_dir, prompt, k) -> Path:
    hashes: list[bytes] = []
    extend_page_hashes(hashes, prompt, PAGE)
    return Path(disk_dir) / "pages" / file_name(hashes[k])


def disk_usage(directory) -> int:
    """What `du` counts: allocated blocks of every file and directory."""
    total = os.lstat(directory).st_blocks * 512
    for root, dirs, files in os.walk(directory):
        total += sum(os.lstat(os.path.join(root, name)).st_blocks * 512 for name in dirs + files)
    return total


# -- restore -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [17, 100, 161])
def test_a_prompt_evicted_from_ram_restores_from_disk(tiny_model_dir, reference, tmp_path, n):
    engine = make_engine(tiny_model_dir, tmp_path / "disk")
    prompt = random_prompts([n], seed=n)[0]
    cold = generate(engine, "cold", prompt)
    evict_ram(engine, seed=n)
    ram_hits = engine.stats().prefix_hit_tokens_ram
    warm = generate(engine, "warm", prompt)
    restored = (n - 1) // PAGE * PAGE
    stats = engine.stats()
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == restored and warm.num_computed_prompt_tokens == n - restored
    assert stats.prefix_hit_tokens_disk == restored and stats.prefix_hit_tokens_ram == ram_hits
    assert stats.kv_disk_pages_read == restored // PAGE == stats.pages_from_disk
    assert warm.output_token_ids == cold.output_token_ids == reference.greedy(prompt, 8)
    # the restored pages are published in RAM again: the next request hits them there
    again = generate(engine, "again", prompt)
    assert again.num_cached_tokens == restored and engine.stats().prefix_hit_tokens_disk == restored
    engine.close()


def test_a_new_engine_on_the_directory_restores_the_last_runs_prompts(tiny_model_dir, reference, tmp_path):
    prompt = random_prompts([100], seed=7)[0]
    first = make_engine(tiny_model_dir, tmp_path / "disk")
    generate(first, "first", prompt)
    first.close()  # writes what is queued, releases the directory
    second = make_engine(tiny_model_dir, tmp_path / "disk")
    assert second.stats().kv_disk_pages == (100 + 8 - 1) // PAGE
    warm = generate(second, "warm", prompt)
    assert warm.num_cached_tokens == 96 and second.stats().prefix_hit_tokens_disk == 96
    assert warm.output_token_ids == reference.greedy(prompt, 8)
    second.close()


KILLED_WRITER = """
import os, signal, sys
import minivllm
from minivllm import EngineConfig, SamplingParams
from minivllm.engine.grammar import MaskCounters
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.model_runner import KVGeometry, ModelRunner
from tests.test_engine import random_prompts

model, disk = sys.argv[1:3]
engine = LLMEngine(EngineConfig(model=model, kv_cache_bytes={ram}, single_flight="off", kv_disk_dir=disk,
                                kv_disk_bytes=4 << 20))
def run(rid, prompt):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
run("kept", random_prompts([100], seed=7)[0])
engine.kv.disk.flush()
# the next page is killed between its temporary file and the rename that would put it in place
os.replace = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
run("killed", random_prompts([60], seed=8)[0])
engine.kv.disk.flush()
print("not killed")
"""


def test_kill_9_mid_write_leaves_a_directory_the_next_start_accepts(tiny_model_dir, reference, tmp_path):
    disk = tmp_path / "disk"
    script = KILLED_WRITER.format(ram=RAM_PAGES * BYTES_PER_PAGE)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tiny_model_dir), str(disk)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = [p for p in (disk / "pages").iterdir() if p.name.endswith(".tmp")]
    assert leftovers  # killed with a page half-way into place
    engine = make_engine(tiny_model_dir, disk)
    assert not any(p.name.endswith(".tmp") for p in (disk / "pages").iterdir())
    prompt = random_prompts([100], seed=7)[0]
    warm = generate(engine, "warm", prompt)
    assert warm.num_cached_tokens == 96 and engine.stats().prefix_hit_tokens_disk == 96
    assert warm.output_token_ids == reference.greedy(prompt, 8)
    engine.close()


def test_identical_prompts_read_the_disk_once(tiny_model_dir, reference, tmp_path):
    """Under single flight the leader reads the pages from disk; its followers restore them from RAM."""
    engine = make_engine(
        tiny_model_dir, tmp_path / "disk", kv_cache_bytes=24 * BYTES_PER_PAGE, single_flight="after_prefill"
    )
    prompt = random_prompts([100], seed=9)[0]
    generate(engine, "cold", prompt)
    engine.kv.disk.flush()
    engine.kv.clear_cache()
    seqs = [
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(3)
    ]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    assert [s.num_cached_tokens for s in seqs] == [96] * 3
    assert all(s.output_token_ids == reference.greedy(prompt, 8) for s in seqs)
    stats = engine.stats()
    assert stats.kv_disk_pages_read == 6 and stats.prefix_hit_tokens_disk == 96
    engine.close()
    assert engine.kv.disk is None and generate(engine, "after", prompt).num_cached_tokens == 96  # RAM alone


# -- the budget ----------------------------------------------------------------------------------------
def test_the_directory_stays_within_its_budget(tiny_model_dir, tmp_path):
    disk = tmp_path / "disk"
    budget = 40 * 12288 + 100  # room for 40 page files of the tiny model (8,352 bytes in 3 blocks)
    engine = make_engine(tiny_model_dir, disk, disk_bytes=budget)
    slack = 64 << 10  # the directories and the lock file ("a small index")
    for i, prompt in enumerate(random_prompts([80] * 15, seed=11)):
        generate(engine, f"r{i}", prompt)
        engine.kv.disk.flush()
        assert disk_usage(disk) <= budget + slack
    stats = engine.stats()
    assert stats.kv_disk_pages_evicted > 0 and stats.kv_disk_bytes <= budget
    assert stats.kv_disk_pages == len(list((disk / "pages").iterdir()))
    engine.close()
    smaller = make_engine(tiny_model_dir, disk, disk_bytes=budget // 2)  # a smaller budget trims at start
    assert disk_usage(disk) <= budget // 2 + slack
    smaller.close()


# -- files that must never be served ---------------------------------------------------------------------
def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40  # one bit of the KV payload
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1000)


@pytest.mark.parametrize("damage", [_corrupt, _truncate], ids=["corrupt", "truncated"])
@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_a_damaged_page_file_costs_a_recompute_never_an_output(
    tiny_model_dir, reference, tmp_path, damage, restart
):
    disk = tmp_path / "disk"
    engine = make_engine(tiny_model_dir, disk)
    prompt = random_prompts([100], seed=21)[0]
    generate(engine, "cold", prompt)
    evict_ram(engine, seed=21)
    damage(page_path(disk, prompt, 2))
    if restart:
        engine.close()
        engine = make_engine(tiny_model_dir, disk)
    warm = generate(engine, "warm", prompt)
    assert warm.num_cached_tokens == 2 * PAGE  # pages 0 and 1; page 2 and the rest are computed
    assert warm.output_token_ids == reference.greedy(prompt, 8)
    assert engine.stats().kv_disk_pages_rejected == 1
    engine.kv.disk.flush()  # deleted, then written again, whole, from the recompute
    assert page_path(disk, prompt, 2).stat().st_size == engine.kv.disk.identity.file_bytes
    engine.close()


def test_a_directory_another_model_wrote_is_never_served(tiny_model_dir, reference, tmp_path):
    disk = tmp_path / "disk"
    prompt = random_prompts([100], seed=31)[0]
    writer = make_engine(tiny_model_dir, disk)
    generate(writer, "cold", prompt)
    writer.close()
    written = len(list((disk / "pages").iterdir()))
    other_dir = make_tiny_model(tmp_path / "other", seed=1)  # same shapes, other weights
    other = make_engine(other_dir, disk)
    assert other.stats().kv_disk_pages_rejected == written and other.stats().kv_disk_pages == 0
    seq = generate(other, "other", prompt)
    assert seq.num_cached_tokens == 0
    assert seq.output_token_ids == MlxLmReference(other_dir).greedy(prompt, 8)
    other.close()


# -- a disk that cannot be used ---------------------------------------------------------------------------
def test_an_unusable_directory_leaves_the_engine_serving_with_a_warning(
    tiny_model_dir, reference, tmp_path, caplog
):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.WARNING):
        engine = make_engine(tiny_model_dir, not_a_dir / "disk")
    assert "KV disk tier off" in caplog.text
    prompt = random_prompts([40], seed=41)[0]
    assert generate(engine, "r", prompt).output_token_ids == reference.greedy(prompt, 8)
    assert engine.stats().kv_disk_pages is None
    engine.close()


def test_a_disk_too_full_for_one_page_leaves_the_engine_serving_from_ram(
    tiny_model_dir, reference, tmp_path, caplog, monkeypatch
):
    """With no budget set, the tier takes 10% of the free disk: less than one page file turns it off."""
    full = SimpleNamespace(total=1 << 30, used=(1 << 30) - 4096, free=4096)
    monkeypatch.setattr(disk_tier.shutil, "disk_usage", lambda path: full)
    with caplog.at_level(logging.WARNING):
        engine = make_engine(tiny_model_dir, tmp_path / "disk", disk_bytes=None)
    assert "KV disk tier off" in caplog.text
    prompt = random_prompts([40], seed=42)[0]
    assert generate(engine, "r", prompt).output_token_ids == reference.greedy(prompt, 8)
    assert engine.stats().kv_disk_pages is None
    engine.close()


def test_a_full_disk_fails_writes_with_a_warning_and_the_engine_serves_on(
    tiny_model_dir, reference, tmp_path, caplog, monkeypatch
):
    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk_tier, "open", full_disk, raising=False)
    engine = make_engine(tiny_model_dir, tmp_path / "disk")
    prompt = random_prompts([100], seed=51)[0]
    with caplog.at_level(logging.WARNING):
        first = generate(engine, "first", prompt)
        engine.kv.disk.flush()
    assert "disk full" in caplog.text
    evict_ram(engine, seed=51)
    again = generate(engine, "again", prompt)
    stats = engine.stats()
    assert stats.kv_disk_write_errors > 0 and stats.kv_disk_pages == 0 and again.num_cached_tokens == 0
    assert first.output_token_ids == again.output_token_ids == reference.greedy(prompt, 8)
    assert not list((tmp_path / "disk" / "pages").iterdir())  # no temporary file left behind
    engine.close()


def test_a_read_makes_only_its_own_request_wait(tiny_model_dir, reference, tmp_path, monkeypatch):
    """While a request's pages are read from disk (held up here until released), another request decodes."""
    engine = make_engine(tiny_model_dir, tmp_path / "disk", kv_cache_bytes=24 * BYTES_PER_PAGE)
    slow_prompt, busy_prompt = random_prompts([100, 30], seed=61)
    generate(engine, "cold", slow_prompt)
    engine.kv.disk.flush()
    engine.kv.clear_cache()  # out of RAM: only the disk has it
    release = threading.Event()
    read_pages = DiskTier._read_pages
    monkeypatch.setattr(DiskTier, "_read_pages", lambda self, read: (release.wait(), read_pages(self, read)))
    busy = engine.add_request("busy", busy_prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    slow = engine.add_request("slow", slow_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(6):
        engine.step()
        engine.check_invariants()
    assert (
        len(busy.output_token_ids) >= 5
        and slow.num_computed_tokens == 0
        and engine.kv.is_restoring(slow.cache)
    )
    release.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert slow.num_cached_tokens == 96 and slow.output_token_ids == reference.greedy(slow_prompt, 8)
    assert busy.output_token_ids == reference.greedy(busy_prompt, 20)
    engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_page_kv_round_trips_between_pools_and_bytes(dtype):
    """The runner's copies out of and into the pools, for every pool dtype (bfloat16 travels as uint16), with
    pools of other head counts and sizes (Gemma 4's global layers): a page is each pool's [kv heads, page,
    head dim] block in turn, the keys' pools then the values'."""
    geometry = KVGeometry(((2, 8), (1, 16), (3, 4)), getattr(mx, dtype))
    runner = ModelRunner(None, geometry, num_pages=4, page_size=PAGE, mask_counters=MaskCounters())
    pools = runner.kv.keys + runner.kv.values
    for i, pool in enumerate(pools):
        pool[:] = mx.random.normal(pool.shape, key=mx.random.key(i)).astype(pool.dtype)
    expected = [np.array(pool[:, PAGE : 2 * PAGE].astype(mx.float32)) for pool in pools]  # page 1
    payloads = runner.page_payloads([1, 3])
    assert payloads.dtype == np.uint8 and payloads.shape == (2, geometry.bytes_per_token * PAGE)
    if dtype == "float32":
        assert payloads[0].tobytes() == b"".join(want.tobytes() for want in expected)
    runner.reset_kv()
    runner.write_pages([2, 0], payloads)  # page 1's bytes into page 2
    for pool, want in zip(runner.kv.keys + runner.kv.values, expected):
        assert np.array_equal(np.array(pool[:, 2 * PAGE : 3 * PAGE].astype(mx.float32)), want)
