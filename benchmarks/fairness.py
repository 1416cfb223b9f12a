"""Fairness: short requests and a running stream while one very long prompt is being prefilled.

A tiny random long-context model (262,144 positions) serves, through the HTTP server, one stream that
decodes all along, one long completion prompt (default 200,000 tokens) and, once the long prefill has
started, short requests one after another. Per server: the short requests' time to first token, the
stream's gaps between tokens while the long prefill runs, and the engine's mean step time over that
window (from /metrics), and the stream's gaps counted in engine steps (the engine's histogram
minivllm_inter_token_steps over the window: only the stream makes more than one token in it); the bounds:
short TTFT p99 <= 2 s + one step, and the stream's gap p99 <= 2 steps.
With --baseline REF the same run against another commit (e.g. a9d7380, before fair steps), side by side.

    python -m benchmarks.fairness [--prompt-tokens 200000] [--shorts 8] [--baseline a9d7380]
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import checkouts, results
from benchmarks.harness.client import fetch_buckets, fetch_metrics, make_client
from benchmarks.harness.servers import ServerSpec, running_server

STEPS = "minivllm_engine_steps_total"
COMPUTED = "minivllm_computed_prompt_tokens_total"
GAPS = "minivllm_inter_token_steps"


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The q-quantile's bucket bound of what a cumulative histogram counted between two scrapes (nan
    when it counted nothing: a server without the histogram)."""
    counts = {b: n - before.get(b, 0.0) for b, n in sorted(after.items())}
    total = counts.get(float("inf"), 0.0)
    return next((b for b, n in counts.items() if n >= q * total), float("nan")) if total else float("nan")


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(base_url: str, model: str, prompt_tokens: int, shorts: int, short_timeout: float) -> dict:
    client = make_client(base_url + "/v1")
    stream_times: list[float] = []

    async def stream() -> None:
        # logprobs: every token comes as a chunk (a token that completes no character has no text)
        s = await client.completions.create(
            model=model,
            prompt=[7] * 32,
            max_tokens=100_000,
            stream=True,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        async for _ in s:
            stream_times.append(time.monotonic())
            if done.is_set():
                await s.close()
                return

    async def short(i: int) -> float:
        start = time.monotonic()
        s = await client.completions.create(
            model=model, prompt=[11 + i] * 32, max_tokens=1, stream=True, extra_body={"ignore_eos": True}
        )
        async for _ in s:
            return time.monotonic() - start
        return float("nan")

    done = asyncio.Event()
    streamer = asyncio.create_task(stream())
    while len(stream_times) < 3:
        await asyncio.sleep(0.05)
    before = fetch_metrics(base_url)
    long_start = time.monotonic()
    long = asyncio.create_task(
        client.completions.create(model=model, prompt=[3] * prompt_tokens, max_tokens=1)
    )
    while fetch_metrics(base_url).get(COMPUTED, 0) <= before.get(COMPUTED, 0) + 32:  # the prefill runs
        await asyncio.sleep(0.05)
    before, window_start = fetch_metrics(base_url), time.monotonic()  # the window: while it prefills
    gaps_before = fetch_buckets(base_url, GAPS)
    ttfts = []
    for i in range(shorts):
        if long.done():
            break
        try:
            ttfts.append(await asyncio.wait_for(short(i), short_timeout))
        except TimeoutError:  # counted as its timeout: a lower bound of its TTFT
            ttfts.append(short_timeout)
            break
    window_end = time.monotonic()
    after, gaps_after = fetch_metrics(base_url), fetch_buckets(base_url, GAPS)
    await long
    long_s = time.monotonic() - long_start
    done.set()
    await streamer
    steps = after.get(STEPS, 0) - before.get(STEPS, 0)
    step_s = (window_end - window_start) / steps if steps else float("nan")
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:]) if window_start <= a and b <= window_end]
    steps99 = bucket_quantile(gaps_before, gaps_after, 0.99)
    tokens = gaps_after.get(float("inf"), 0.0) - gaps_before.get(float("inf"), 0.0)
    return {
        "ttfts": ttfts,
        "gaps": gaps,
        "step_s": step_s,
        "steps": steps,
        "long_s": long_s,
        "gap_steps_p99": steps99,
        "engine_tokens": tokens,
    }


def row(label: str, commit: str, m: dict, prompt_tokens: int) -> dict:
    """Times in ms. The stream's tokens per engine step over the window as the client received them and
    as the engine counted them (1.0: a token in every step), and the engine's gap p99 in steps (a
    histogram bucket's bound); the bounds: TTFT p99 2 s plus one (mean) step, the gap p99 2 steps."""
    ttft99, step = quantile(m["ttfts"], 0.99), m["step_s"]
    gaps = m["gaps"]
    gap99, gap50 = quantile(gaps, 0.99), statistics.median(gaps) if gaps else float("nan")
    return {
        "server": label,
        "commit": commit,
        "long prompt tokens": prompt_tokens,
        "long prompt s": m["long_s"],
        "short requests": len(m["ttfts"]),
        "short TTFT median ms": 1e3 * statistics.median(m["ttfts"]) if m["ttfts"] else float("nan"),
        "short TTFT p99 ms": 1e3 * ttft99,
        "mean step ms": 1e3 * step,
        "stream tokens per step (client)": len(gaps) / m["steps"] if m["steps"] else float("nan"),
        "stream tokens per step (engine)": m["engine_tokens"] / m["steps"] if m["steps"] else float("nan"),
        "stream gap p99 steps": m["gap_steps_p99"],
        "stream gap median ms": 1e3 * gap50,
        "stream gap p99 ms": 1e3 * gap99,
        "gap p99 / median": gap99 / gap50 if gaps else float("nan"),
        "TTFT p99 <= 2 s + step": ttft99 <= 2 + step,
        "gap p99 <= 2 steps": m["gap_steps_p99"] <= 2,
    }


def run(root: Path, model: Path, args: argparse.Namespace, label: str) -> dict:
    pool = max(64 << 20, args.prompt_tokens * 1024)  # the tiny model's KV: 512 bytes a token, doubled
    env = {"MINIVLLM_KV_CACHE_BYTES": str(pool), "MINIVLLM_LOG_LEVEL": "warning"}
    with running_server(ServerSpec("minivllm", model, env=env, label=label, root=root)) as server:
        return asyncio.run(
            measure(server.base_url, server.model_id, args.prompt_tokens, args.shorts, args.short_timeout)
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=200_000)
    p.add_argument("--shorts", type=int, default=8, help="short requests sent one after another")
    p.add_argument("--short-timeout", type=float, default=300.0, help="seconds a short request may wait")
    p.add_argument("--baseline", help="a commit or checkout to run side by side (e.g. a9d7380)")
    p.add_argument("--allow-dirty", action="store_true")
    p.add_argument("--tag", default="", help="suffix of the results file name")
    args = p.parse_args(argv)
    results.require_clean_tree(args.allow_dirty)
    from benchmarks.hardening import tiny_long_context_model

    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_long_context_model(Path(tmp))
        meta = results.metadata(model, prompt_tokens=args.prompt_tokens)
        rows = [row("minivllm", meta["git"]["commit"], run(results.REPO_ROOT, model, args, "fair"), args.prompt_tokens)]  # fmt: skip
        if args.baseline:
            with checkouts.checkout(args.baseline) as (root, commit):
                rows.append(row("baseline", commit, run(root, model, args, "baseline"), args.prompt_tokens))  # fmt: skip
    paths = results.write_results(f"fairness{args.tag}", rows, meta, allow_dirty=args.allow_dirty, raw=None)
    results.print_report(paths)


if __name__ == "__main__":
    main()
