"""Fairness: short requests and a running stream while one very long prompt is being prefilled.

A tiny random long-context model (262,144 positions) serves, through the HTTP server, one stream that
decodes all along, one long completion prompt (default 200,000 tokens) and, once the long prefill has
started, short requests one after another. Per server: the short requests' time to first token and the
engine's mean step while they ran (from /metrics); over the whole long prefill, the stream's gaps between
tokens counted in engine steps (the engine's histogram minivllm_inter_token_steps: only the stream makes
more than one token in the window) and in ms as the client received them. The bounds: short TTFT p99
<= 2 s + one step, and the stream's gap p99 <= 2 steps.
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
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import checkouts, results
from benchmarks.harness.client import bucket_counts, make_client, sample_sums, scrape
from benchmarks.harness.servers import ServerSpec, running_server

STEPS = "minivllm_engine_steps_total"
COMPUTED = "minivllm_computed_prompt_tokens_total"
GAPS = "minivllm_inter_token_steps"


@dataclass
class Snapshot:
    """One scrape of /metrics: the engine's counters and its gap histogram at one time."""

    values: dict[str, float]
    gaps: dict[float, float]  # minivllm_inter_token_steps' cumulative buckets
    time: float

    def step_s(self, later: Snapshot) -> float:
        """The mean step between this snapshot and a later one."""
        steps = later.values.get(STEPS, 0) - self.values.get(STEPS, 0)
        return (later.time - self.time) / steps if steps else float("nan")


async def snapshot(base_url: str) -> Snapshot:
    """Scraped off the event loop, so that the stream's chunks keep being read meanwhile."""
    families = await asyncio.to_thread(scrape, base_url)
    return Snapshot(sample_sums(families), bucket_counts(families, GAPS), time.monotonic())


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
    idle = await snapshot(base_url)
    long_start = time.monotonic()
    long = asyncio.create_task(
        client.completions.create(model=model, prompt=[3] * prompt_tokens, max_tokens=1)
    )
    while (await snapshot(base_url)).values.get(COMPUTED, 0) <= idle.values.get(COMPUTED, 0) + 32:
        await asyncio.sleep(0.05)  # until the prefill runs
    start = await snapshot(base_url)
    ttfts = []
    for i in range(shorts):
        if long.done():
            break
        try:
            ttfts.append(await asyncio.wait_for(short(i), short_timeout))
        except TimeoutError:  # counted as its timeout: a lower bound of its TTFT
            ttfts.append(short_timeout)
            break
    shorts_end = end = await snapshot(base_url)
    while not long.done():  # the window's end: the last scrape while the long prompt still prefilled
        await asyncio.wait({long}, timeout=0.5)
        now = await snapshot(base_url)
        if now.values.get(COMPUTED, 0) < idle.values.get(COMPUTED, 0) + prompt_tokens:
            end = now  # not after it: the stream alone decodes in much shorter steps
    await long
    long_s = time.monotonic() - long_start
    done.set()
    await streamer
    # the stream's gaps over the prefill: from the engine's histogram, and as the client received them
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:]) if start.time <= a and b <= end.time]
    return {
        "ttfts": ttfts,
        "short_step_s": start.step_s(shorts_end),
        "gaps": gaps,
        "prefill_steps": end.values.get(STEPS, 0) - start.values.get(STEPS, 0),
        "prefill_step_s": start.step_s(end),
        "long_s": long_s,
        "gap_steps_p99": bucket_quantile(start.gaps, end.gaps, 0.99),
        "engine_gaps": end.gaps.get(float("inf"), 0.0) - start.gaps.get(float("inf"), 0.0),
    }


def row(label: str, commit: str, m: dict, prompt_tokens: int) -> dict:
    """Times in ms. TTFT bound: p99 within 2 s plus one mean step of the shorts' window. The stream, over
    the whole prefill: its gaps per engine step as the engine counted them and as the client received
    them (1.0: a token in every step), and the engine's gap p99 in steps (a histogram bucket's bound):
    the bound is 2 steps. Its gaps in ms follow the steps' lengths, which grow with the long context."""
    ttft99, step = quantile(m["ttfts"], 0.99), m["short_step_s"]
    gaps, steps = m["gaps"], m["prefill_steps"]
    gap99, gap50 = quantile(gaps, 0.99), statistics.median(gaps) if gaps else float("nan")
    return {
        "server": label,
        "commit": commit,
        "long prompt tokens": prompt_tokens,
        "long prompt s": m["long_s"],
        "short requests": len(m["ttfts"]),
        "short TTFT median ms": 1e3 * statistics.median(m["ttfts"]) if m["ttfts"] else float("nan"),
        "short TTFT p99 ms": 1e3 * ttft99,
        "mean step ms (shorts)": 1e3 * step,
        "TTFT p99 <= 2 s + step": ttft99 <= 2 + step,
        "prefill steps": steps,
        "mean step ms (prefill)": 1e3 * m["prefill_step_s"],
        "stream tokens per step (engine)": m["engine_gaps"] / steps if steps else float("nan"),
        "stream tokens per step (client)": len(gaps) / steps if steps else float("nan"),
        "stream gap p99 steps": m["gap_steps_p99"],
        "stream gap median ms": 1e3 * gap50,
        "stream gap p99 ms": 1e3 * gap99,
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
