"""Hardening timings against a real server process: how fast an oversized body is refused (413), and how
/health and an open stream fare while a 1 MB legal prompt is being tokenized.

    python -m benchmarks.hardening [--model DIR] [--runs 5]
    python -m benchmarks.hardening --lanes [--model DIR] [--runs 3]

Without --model it builds a tiny random model whose context (262,144 positions, clamped to a 64 MiB pool:
131,072 tokens) lets the 1 MB prompt pass the length pre-check, so the server really tokenizes it (then
refuses it: about 233,000 tokens). Prints a table; writes nothing.

--huge: seconds to refuse a 3.9 MB prompt longer than the context on each route (completions, chat,
messages, responses), for texts of several kinds (prose, and runs with no word boundary: digits, one
letter, CJK, base64); the default model (its 32,768-token context) unless --model. Prints a table.

--lanes: short chat requests' TTFT idle, beside one and beside four 3.9 MB chat prompts (each refused: longer
than the context), on a server with MINIVLLM_PROMPT_LANES on and on one with it off, in one run; the default
model unless --model. Writes benchmarks/results/prompt_lanes.{json,md}.
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import models, results
from benchmarks.harness.results import markdown_table, metadata
from benchmarks.harness.servers import ServerSpec, running_server

BODY_8MB = json.dumps({"model": "m", "prompt": "x" * (8 << 20)}).encode()
PROMPT_1MB = ("The quick brown fox jumps over the lazy dog. " * 30_000)[: 1 << 20]
PROMPT_3_9MB = ("The quick brown fox jumps over the lazy dog.\n" * 90_000)[:3_900_000]
HUGE_TEXTS = {  # 3.9 MB each; all but prose have no word boundary to cut between when counting
    "prose": PROMPT_3_9MB,
    "digits": ("0123456789" * 390_000),
    "one letter": "x" * 3_900_000,
    "CJK": ("\u4e00\u4e8c\u4e09\u56db" * 325_000),
    "base64": ("QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo+/w==" * 97_500),
}
SHORT_CHAT = [{"role": "user", "content": "Write a haiku about caches."}]
IDLE_SHORTS = 5  # short requests timed on an idle server, per run


def ms(values: list[float]) -> str:
    if not values:
        return "—"
    q = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else values * 19
    return (
        f"median {statistics.median(values) * 1e3:,.1f}, p95 {q[18] * 1e3:,.1f}, max {max(values) * 1e3:,.1f}"
    )


def chunks(data: bytes, size: int = 1 << 16):
    """An iterator body: httpx sends it chunked, without a Content-Length."""
    return (data[i : i + size] for i in range(0, len(data), size))


def refuse_8mb(url: str, runs: int) -> dict[str, list[float]]:
    """Seconds from sending an 8 MB body to its 413, with a Content-Length and chunked."""
    out: dict[str, list[float]] = {"content-length": [], "chunked": []}
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(runs):
            for kind in out:
                content = BODY_8MB if kind == "content-length" else chunks(BODY_8MB)
                t = time.perf_counter()
                r = http.post("/v1/completions", content=content, headers=headers)
                out[kind].append(time.perf_counter() - t)
                assert r.status_code == 413, r.text
    return out


async def health_during_big_prompt(url: str, model: str) -> dict[str, object]:
    """/health latencies and stream chunk gaps in three phases: idle; a stream running; the stream running
    while a 1 MB prompt is processed. The middle phase separates the prompt's effect from decoding's."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:

        async def poll(seconds: float | None = None, until: asyncio.Event | None = None) -> list[float]:
            latencies: list[float] = []
            end = time.perf_counter() + (seconds or 0)
            while (until is not None and not until.is_set()) or (seconds and time.perf_counter() < end):
                t = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - t)
            return latencies

        idle = await poll(seconds=2)
        chunk_times: list[float] = []
        done = asyncio.Event()
        first_chunk = asyncio.Event()

        async def stream() -> None:
            body = {
                "model": model,
                "prompt": "abc",
                "max_tokens": 100_000,
                "ignore_eos": True,
                "stream": True,
            }
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        chunk_times.append(time.perf_counter())
                        first_chunk.set()
                    if done.is_set():
                        return

        streaming = asyncio.create_task(stream())
        await first_chunk.wait()
        s0 = time.perf_counter()
        streaming_only = await poll(seconds=3)
        polling = asyncio.create_task(poll(until=done))
        t0 = time.perf_counter()
        r = await http.post("/v1/completions", json={"model": model, "prompt": PROMPT_1MB, "max_tokens": 1})
        t1 = time.perf_counter()
        done.set()
        busy = await polling
        await streaming

    def gaps(start: float, end: float) -> list[float]:
        return [b - a for a, b in zip(chunk_times, chunk_times[1:]) if start <= a and b <= end]

    error = r.json().get("error", {}).get("message", "")
    return {
        "big": (t1 - t0, r.status_code, error[:120]),
        "health": {"idle": idle, "stream running": streaming_only, "stream + 1 MB prompt": busy},
        "gaps": {"stream running": gaps(s0, t0), "stream + 1 MB prompt": gaps(t0, t1)},
    }


async def short_ttft(http: httpx.AsyncClient, model: str) -> float:
    """Seconds from sending a short streamed chat request to its first data event (keep-alive comments are
    not output)."""
    body = {"model": model, "messages": SHORT_CHAT, "max_tokens": 1, "temperature": 0, "stream": True}
    t = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t
    raise RuntimeError(f"no data event (HTTP {r.status_code})")


async def shorts_beside_big_prompts(url: str, model: str, bigs: int) -> tuple[list[float], list[int]]:
    """Short requests one after another while `bigs` 3.9 MB chat prompts are in flight (IDLE_SHORTS of them
    when there are none): their TTFTs, and the big prompts' HTTP statuses."""
    async with httpx.AsyncClient(base_url=url, timeout=900) as http:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT_3_9MB}], "max_tokens": 1}
        big = [asyncio.create_task(http.post("/v1/chat/completions", json=body)) for _ in range(bigs)]
        ttfts: list[float] = []
        while len(ttfts) < (IDLE_SHORTS if not bigs else 1) or not all(t.done() for t in big):
            ttfts.append(await short_ttft(http, model))
        return ttfts, [r.status_code for r in await asyncio.gather(*big)]


def lanes_comparison(model: Path, runs: int) -> tuple[list[dict], dict]:
    """Rows: short-request TTFT per server setting and scenario, over `runs` repetitions each."""
    rows, raw = [], {}
    for lanes in ("1", "0"):
        env = {"MINIVLLM_PROMPT_LANES": lanes, "MINIVLLM_LOG_LEVEL": "warning"}
        with running_server(ServerSpec("minivllm", model, env=env, label=f"lanes-{lanes}")) as server:
            for bigs in (0, 1, 4):
                ttfts, statuses = [], []
                for _ in range(runs):
                    t, st = asyncio.run(shorts_beside_big_prompts(server.base_url, server.model_id, bigs))
                    ttfts += t
                    statuses += st
                raw[f"lanes={lanes} bigs={bigs}"] = {"ttft_s": ttfts, "big_statuses": statuses}
                rows.append(
                    {
                        "prompt lanes": "on" if lanes == "1" else "off",
                        "3.9 MB prompts in flight": bigs,
                        "short TTFT (ms)": ms(ttfts),
                        "mean (ms)": round(statistics.mean(ttfts) * 1e3, 1),
                        "short requests": len(ttfts),
                        "big prompts' statuses": ", ".join(sorted({str(s) for s in statuses})) or "—",
                    }
                )
    return rows, raw


def huge_bodies(model: str, text: str) -> dict[str, dict]:
    """The same text as each route's prompt."""
    user = [{"role": "user", "content": text}]
    return {
        "/v1/completions": {"model": model, "prompt": text, "max_tokens": 1},
        "/v1/chat/completions": {"model": model, "messages": user, "max_tokens": 1},
        "/v1/messages": {"model": model, "messages": user, "max_tokens": 1},
        "/v1/responses": {"model": model, "input": text, "max_output_tokens": 16},
    }


def refuse_huge(url: str, model: str) -> list[dict]:
    """Seconds from sending each huge prompt to its answer (a 400: longer than the context), per route."""
    rows = []
    with httpx.Client(base_url=url, timeout=600) as http:
        for kind, text in HUGE_TEXTS.items():
            for path, body in huge_bodies(model, text).items():
                start = time.perf_counter()
                r = http.post(path, json=body)
                rows.append(
                    {
                        "text": kind,
                        "route": path,
                        "seconds": f"{time.perf_counter() - start:.2f}",
                        "HTTP": r.status_code,
                    }
                )
    return rows


def tiny_long_context_model(root: Path) -> Path:
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(root / "tiny-long", max_position_embeddings=1 << 18)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="model dir (default: a tiny random long-context model)")
    p.add_argument("--runs", type=int, default=5, help="8 MB bodies sent per kind (--lanes: repetitions)")
    p.add_argument(
        "--lanes", action="store_true", help="short-request TTFT beside 3.9 MB prompts, lanes on/off"
    )
    p.add_argument("--huge", action="store_true", help="seconds to refuse 3.9 MB prompts, per route")
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args(argv)
    if args.huge:
        model = models.resolve_model(args.model and str(args.model))
        env = {"MINIVLLM_LOG_LEVEL": "warning"}
        with running_server(ServerSpec("minivllm", model, env=env, label="huge")) as server:
            rows = refuse_huge(server.base_url, server.model_id)
        meta = metadata(model)
        print(
            f"# 3.9 MB prompts refused ({meta['date']}, commit {meta['git']['commit']}, dirty {meta['git']['dirty']})"
        )
        print(f"# machine: {meta['machine']}")
        print(markdown_table(rows))
        return
    if args.lanes:
        results.require_clean_tree(args.allow_dirty)
        model = models.resolve_model(args.model and str(args.model))
        rows, raw = lanes_comparison(model, args.runs)
        meta = metadata(model, runs=args.runs)
        results.print_report(
            results.write_results("prompt_lanes", rows, meta, raw=raw, allow_dirty=args.allow_dirty)
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or tiny_long_context_model(Path(tmp))
        env = {"MINIVLLM_KV_CACHE_BYTES": "64M", "MINIVLLM_LOG_LEVEL": "warning"}
        with running_server(ServerSpec("minivllm", model, env=env, label="hardening")) as server:
            refused = refuse_8mb(server.base_url, args.runs)
            big = asyncio.run(health_during_big_prompt(server.base_url, server.model_id))
        meta = metadata(model)
    seconds, status, message = big["big"]
    rows = [
        {"measurement": "8 MB body -> 413, Content-Length (ms)", "value": ms(refused["content-length"])},
        {"measurement": "8 MB body -> 413, chunked (ms)", "value": ms(refused["chunked"])},
        {
            "measurement": "1 MB prompt: time to its answer",
            "value": f"{seconds * 1e3:,.0f} ms, HTTP {status}",
        },
    ]
    for phase, latencies in big["health"].items():
        rows.append(
            {"measurement": f"/health, {phase} (ms)", "value": f"{ms(latencies)} ({len(latencies)} polls)"}
        )
    for phase, gaps in big["gaps"].items():
        rows.append(
            {"measurement": f"stream chunk gaps, {phase} (ms)", "value": f"{ms(gaps)} ({len(gaps)} gaps)"}
        )
    print(
        f"# hardening timings ({meta['date']}, commit {meta['git']['commit']}, dirty {meta['git']['dirty']})"
    )
    print(f"# machine: {meta['machine']}")
    print(f"# the 1 MB prompt's answer: {message}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
