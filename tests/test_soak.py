"""Soak: 1,000 mixed requests against a tiny-model server, a fifth of them abandoned by their client mid-way.
Afterwards nothing may be left behind: no page in use, no request running or waiting, and the process's
memory back on a plateau.

Marked slow but run by CI (the suite runs everything): it takes about a minute of CPU here. A test rather than
a benchmark, because these are invariants to keep, not numbers to report.
"""

import asyncio
import random
import resource
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_thread import ServerThread, tiny_settings

MODEL = "tiny"
REQUESTS = 1000
CONCURRENCY = 32
RSS_GROWTH_LIMIT = 96 << 20  # after a warm-up; a leak of a few KB per request would pass 100 MB by far less
WORDS = "paged attention stores keys and values in blocks of sixteen tokens prefix cache reuse".split()


def rss_bytes() -> int:
    statm = Path("/proc/self/statm")
    if statm.exists():
        return int(statm.read_text().split()[1]) * resource.getpagesize()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # elsewhere the peak: it still shows growth
    return peak if sys.platform == "darwin" else peak * 1024


def make_request(rng: random.Random) -> tuple[str, dict, str]:
    """(path, body, how the client behaves: "wait", "drop" mid-way, or "bad" for a request that gets 400)."""
    shared = " ".join(WORDS[:8])  # a prefix many prompts share (prefix cache, single flight)
    text = shared + " " + " ".join(rng.choices(WORDS, k=rng.randint(0, 40)))
    body = {"model": MODEL, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.7, 1.5])}
    body |= {"seed": rng.randint(0, 1000), "n": rng.choice([1, 1, 1, 2, 3]), "stream": rng.random() < 0.5}
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.5:
        path, body = "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", body | {"prompt": text, "logprobs": rng.choice([None, 2])}
    behaviour = rng.choices(["wait", "drop", "bad"], weights=[75, 20, 5])[0]
    if behaviour == "bad":
        body["stream"] = "yes"
    return path, body, behaviour


async def send(
    http: httpx.AsyncClient, rng: random.Random, path: str, body: dict, behaviour: str
) -> int | None:
    """The status the client saw, or None when it walked away before the end."""
    if behaviour == "drop" and not body["stream"]:
        try:
            await asyncio.wait_for(http.post(path, json=body), timeout=rng.uniform(0.001, 0.2))
        except asyncio.TimeoutError:
            return None
        return 200
    async with http.stream("POST", path, json=body) as r:
        lines = 0
        async for line in r.aiter_lines():
            lines += line.startswith("data:")
            if behaviour == "drop" and lines >= 1 and rng.random() < 0.5:
                return None  # closing the stream here is the disconnect
        return r.status_code


async def soak(url: str, requests: list[tuple[str, dict, str]], seed: int) -> list[tuple[str, int | None]]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def one(path, body, behaviour):
            async with gate:
                return behaviour, await send(http, rng, path, body, behaviour)

        return await asyncio.gather(*(one(*r) for r in requests))


@pytest.mark.slow
def test_soak_leaves_no_pages_no_requests_and_flat_memory(tiny_model_dir):
    rng = random.Random(0)
    with ServerThread(tiny_settings(tiny_model_dir, max_num_seqs=8)) as server:
        asyncio.run(soak(server.url, [make_request(rng) for _ in range(100)], seed=1))  # warm-up
        server.wait_idle(timeout=60)
        rss_before = rss_bytes()
        results = asyncio.run(soak(server.url, [make_request(rng) for _ in range(REQUESTS)], seed=2))
        server.wait_idle(timeout=60)
        growth = rss_bytes() - rss_before
        stats = server.engine.stats()

    statuses = {(behaviour, status) for behaviour, status in results}
    assert statuses <= {("wait", 200), ("drop", 200), ("drop", None), ("bad", 400)}, statuses
    assert sum(status is None for _, status in results) > 50  # the disconnects really happened
    assert (stats.pages_in_use, stats.running, stats.waiting) == (0, 0, 0)
    assert stats.pages_free + stats.pages_cached == stats.pages_total
    print(f"RSS growth over {REQUESTS} requests: {growth / 2**20:.1f} MiB")
    assert growth < RSS_GROWTH_LIMIT
