"""The cache advice: the engine records its requests' page hashes (bounded), the shadow replay of that
stream equals `minivllm replay` on the same stream written as a trace, and a server exports the rates."""

import json
import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.shadow_cost import synthetic_stream
from minivllm import LLM, SamplingParams
from minivllm.cache.hash_stream import HashStream
from minivllm.cli import main as cli
from minivllm.shadow import OPTIMUM, POOL_FACTORS, ShadowReplay, shadow_rates, trace_of
from tests.server_thread import ServerThread, tiny_settings

PAGE = 16


def _hashes(n: int, salt: int) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(8, "little") + b"rest of the hash" for i in range(n)]


def test_the_hash_stream_is_bounded_by_requests_and_by_page_hashes():
    stream = HashStream(max_requests=3, max_page_hashes=10)
    for k in range(5):
        stream.record(_hashes(2, k), 2 * PAGE + 1)
    kept = stream.snapshot()
    assert stream.recorded == 5 and [int(r.hash_ids[0]) // 1000 for r in kept] == [2, 3, 4]
    assert kept[0].hash_ids.dtype == np.uint64 and kept[0].input_length == 2 * PAGE + 1
    stream.record(_hashes(7, 9), 7 * PAGE)  # 2 + 2 + 7 > 10: the oldest go first
    assert [len(r.hash_ids) for r in stream.snapshot()] == [2, 7]


@pytest.fixture(scope="module")
def recorded_traffic(tiny_model_dir):
    """A tiny engine's stream after traffic that shares prefixes and repeats some prompts, with a pool
    small enough that the replays' capacities matter."""
    llm = LLM(str(tiny_model_dir), kv_cache_bytes=48 * 8192, max_num_seqs=4)
    system = list(range(3, 3 + 5 * PAGE))  # five shared pages
    prompts = [system + [100 + k % 7] * (PAGE * (1 + k % 3)) + [7] for k in range(24)]
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
    yield llm.engine, prompts
    llm.close()


def test_the_engine_records_each_prompts_full_pages(recorded_traffic):
    engine, prompts = recorded_traffic
    recorded = engine.hash_stream.snapshot()
    assert [r.input_length for r in recorded] == [len(p) for p in prompts]
    assert [len(r.hash_ids) for r in recorded] == [len(p) // PAGE for p in prompts]
    assert len({int(r.hash_ids[4]) for r in recorded}) == 1  # the shared system prompt's last page
    assert len({int(r.hash_ids[5]) for r in recorded}) == 7  # the seven continuations


def test_shadow_rates_equal_minivllm_replay_on_the_same_stream(recorded_traffic, tmp_path, capsys):
    engine, _ = recorded_traffic
    recorded = engine.hash_stream.snapshot()
    trace = trace_of(recorded)
    path = tmp_path / "recorded.jsonl"
    path.write_text(
        "".join(json.dumps({"hash_ids": t.hash_ids, "input_length": t.input_length}) + "\n" for t in trace)
    )
    capacity = 12
    rates = shadow_rates(recorded, capacity, "s3fifo", PAGE)
    expected = [(p, f) for p in ("s3fifo", "lru") for f in POOL_FACTORS] + [(OPTIMUM, 1.0)]
    assert [(r.policy, r.pool_factor) for r in rates] == expected
    for rate in rates:
        assert rate.capacity == max(1, round(capacity * rate.pool_factor)), rate  # the pool it names
        args = ["replay", str(path), "--policy", rate.policy, "--capacity", str(rate.capacity)]
        assert cli([*args, "--block-size", str(PAGE), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["token_hit_rate"] == rate.hit_rate, rate
    by = {(r.policy, r.pool_factor): r.hit_rate for r in rates}
    assert 0 < by["lru", 0.5] <= by["lru", 4.0]  # the stream shares prefixes; more pool keeps more
    assert by[OPTIMUM, 1.0] >= max(by["lru", 1.0], by["s3fifo", 1.0])


def test_a_server_exports_the_advice_after_traffic(tiny_model_dir):
    settings = tiny_settings(tiny_model_dir, cache_shadow_interval=0.05)
    with ServerThread(settings) as s:
        client = s.client()
        for k in range(3):
            client.completions.create(model="tiny", prompt=[5] * 40 + [k], max_tokens=1)
        shadow = s.app.state.server.shadow
        while shadow.replayed < 3:  # the replay of all three requests
            assert shadow._thread.is_alive(), "the advice stopped"
            shadow._stop.wait(0.05)
        metrics = httpx.get(s.url + "/metrics").text
        lru2 = re.search(r'minivllm_cache_shadow_hit_rate\{policy="lru",pool_factor="2"\} (\S+)', metrics)
        assert lru2 and float(lru2[1]) > 0  # the second and third prompts restore the first's two pages
        stats = httpx.get(s.url + "/v1/cache/stats").json()
        assert {(r["policy"], r["pool_factor"]) for r in stats["shadow"]} >= {("lru", 0.5), (OPTIMUM, 1.0)}
    assert not shadow._thread.is_alive()


def _process_state(pid: int) -> str:
    """A Linux process's state letter (R running, S sleeping, T stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_the_replay_runs_only_while_the_engine_is_idle():
    """A replay in the worker is stopped (SIGSTOP) as soon as the engine is busy, and goes on once it is
    idle; a nice-19 process alone still slows a decode whose BLAS threads take every core."""
    stream = HashStream(2000)
    synthetic_stream(stream, 2000, 64, PAGE)
    busy = threading.Event()
    shadow = ShadowReplay(stream, 4096, "lru", PAGE, interval_s=0.01, busy=busy.is_set)
    shadow.start()
    try:
        while not shadow.replaying:
            assert shadow._thread.is_alive()
            shadow._stop.wait(0.01)
        busy.set()
        while _process_state(shadow._worker.pid) != "T":
            assert shadow.replaying, "the replay ended before the engine's requests could pause it"
            shadow._stop.wait(0.01)
        assert shadow.pauses == 1 and shadow.runs == 0
        busy.clear()
        while shadow.runs == 0:  # resumed: it finishes
            assert shadow._thread.is_alive()
            shadow._stop.wait(0.05)
        assert shadow.replayed == stream.recorded and len(shadow.rates) == 5  # lru: its 4 sizes, the optimum
    finally:
        shadow.close()
    assert not shadow._worker.is_alive()
