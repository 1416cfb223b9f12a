"""Single flight: bursts of identical prompts, independent vs coordinated; and a churn control.

bursts (default): 2, 4 and 8 simultaneous identical chat prompts (~530 tokens, 128 output tokens)
for independent execution (single flight off, publication at completion), single flight released
at completion, and released after prefill: mean and max TTFT, slowest completion, restored tokens
per follower, and reductions vs independent.

churn: distinct prefixes whose pages overflow a small KV pool twice, sent one after another, per
eviction policy: restored tokens (expected 0), pages evicted (from /metrics), and whether the first
prefix is still restorable afterwards.

    python -m benchmarks.single_flight [--scenario bursts|churn] [--model DIR] [--runs 3] [--quick]
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from benchmarks.harness import client, models, prompts, results, runner

CONFIGS = {
    "independent": {"MINIVLLM_SINGLE_FLIGHT": "off", "MINIVLLM_PUBLICATION": "completion"},
    "at_completion": {"MINIVLLM_SINGLE_FLIGHT": "at_completion", "MINIVLLM_PUBLICATION": "completion"},
    "after_prefill": {"MINIVLLM_SINGLE_FLIGHT": "after_prefill", "MINIVLLM_PUBLICATION": "completion"},
}
EVICTED = "minivllm_pages_evicted_total"
POLICIES = ("adaptive", "s3fifo", "lru", "fifo")


# ---------------------------------------------------------------- bursts


async def burst_run(
    session: runner.Session, run: int, tokenizer, bursts: tuple[int, ...], n_tokens: int, max_tokens: int
):
    out = {}
    for i, n in enumerate(bursts):
        prompt = prompts.make_prompt(tokenizer, n_tokens, 30_000 + 100 * run + i)  # cold for every burst
        out[n] = await session.burst([prompt.messages] * n, max_tokens)
    return out


def follower_restored(group: list[client.RequestResult]) -> float:
    # The client cannot see who led; the request that restored least did the computing.
    restored = sorted(r.cached_tokens for r in group)[1:]
    return results.mean_sd(restored)[0] if restored else math.nan


def summarize_bursts(
    by_config: dict[str, list[dict[int, Any]]], bursts: tuple[int, ...]
) -> list[dict[str, Any]]:
    rows = []
    for n in bursts:
        base = None
        for label, runs in by_config.items():
            mean_ttft = [results.mean_sd([r.ttft_s for r in g[n]])[0] for g in runs]
            slowest = [max(r.latency_s for r in g[n]) for g in runs]
            m, s = results.mean_sd(mean_ttft)[0], results.mean_sd(slowest)[0]
            if label == "independent":
                base = (m, s)
            rows.append(
                {
                    "burst": n,
                    "strategy": label,
                    "prompt tokens": runs[0][n][0].prompt_tokens,
                    "restored per follower": results.mean_sd([follower_restored(g[n]) for g in runs])[0],
                    "mean TTFT ms": results.fmt_ms(mean_ttft),
                    "max TTFT ms": results.fmt_ms([max(r.ttft_s for r in g[n]) for g in runs]),
                    "slowest completion ms": results.fmt_ms(slowest),
                    "mean TTFT reduction %": results.reduction(base[0], m)
                    if base and label != "independent"
                    else None,
                    "slowest completion reduction %": (
                        results.reduction(base[1], s) if base and label != "independent" else None
                    ),
                }
            )
    return rows


async def run_bursts(args, tokenizer) -> tuple[list[dict[str, Any]], Any]:
    # the seed article: 532 -> 528 restored. Quick: 64 tokens, so that on a tiny model a burst's first
    # request is still running when the second arrives (with 16, a second request that the client or
    # server delayed by ~0.1 s found the first finished and published, and restored it)
    bursts, n_tokens, max_tokens = ((2,), 200, 64) if args.quick else ((2, 4, 8), 532, 128)
    specs = [runner.spec_for(args, label, env) for label, env in CONFIGS.items()]
    by_config = await runner.run_configs(
        specs, args.runs, lambda s, r: burst_run(s, r, tokenizer, bursts, n_tokens, max_tokens)
    )
    if args.plot:
        series = {
            label: [
                results.mean_sd([results.mean_sd([r.ttft_s for r in g[n]])[0] for g in runs])[0] * 1e3
                for n in bursts
            ]
            for label, runs in by_config.items()
        }
        name = runner.result_name("single_flight", args)
        results.save_plot(name, [f"burst {n}" for n in bursts], series, "mean TTFT (ms)", out_dir=args.out)
    return summarize_bursts(by_config, bursts), by_config


# ---------------------------------------------------------------- churn


def churn_pool(args, n_tokens: int, max_tokens: int) -> dict[str, int]:
    """A pool of 3 requests' pages, and enough distinct prompts to demand 3x that: fill once, overflow twice."""
    pages_per_prompt = math.ceil((n_tokens + max_tokens) / args.page_size)
    pool_pages = 3 * pages_per_prompt
    page_bytes = args.page_size * models.kv_bytes_per_token(args.model, args.kv_dtype_bytes)
    return {
        "pages per request": pages_per_prompt,
        "pool pages": pool_pages,
        "kv cache bytes": pool_pages * page_bytes,
        "requests": 3 * pool_pages // pages_per_prompt,
    }


async def churn_run(
    session: runner.Session, run: int, tokenizer, pool: dict[str, int], n_tokens: int, max_tokens: int
):
    distinct = [
        prompts.make_prompt(tokenizer, n_tokens, 40_000 + 1000 * run + i) for i in range(pool["requests"])
    ]
    before = session.metrics()
    done, errors = [], []
    for p in [*distinct, distinct[0]]:  # one at a time, then revisit the first (long evicted) prefix
        try:
            done.append(await session.chat(p.messages, max_tokens))
        except Exception as e:  # an overfull pool may refuse requests: report it, don't die
            errors.append(repr(e))
    after = session.metrics()
    return {"results": done, "errors": errors, "metrics_before": before, "metrics_after": after}


def summarize_churn(by_policy: dict[str, list[dict[str, Any]]], pool: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    for label, runs in by_policy.items():
        evicted = [
            g["metrics_after"][EVICTED] - g["metrics_before"].get(EVICTED, 0.0)
            for g in runs
            if EVICTED in g["metrics_after"]
        ]
        rows.append(
            {
                "eviction": label.removeprefix("churn-"),
                **pool,
                "restored (distinct, expected 0)": sum(
                    r.cached_tokens for g in runs for r in g["results"][:-1]
                ),
                "restored on revisit of first": results.mean_sd(
                    [g["results"][-1].cached_tokens for g in runs]
                )[0],
                "pages evicted": results.mean_sd(evicted)[0] if evicted else None,
                "errors": sum(len(g["errors"]) for g in runs),
                "mean TTFT ms": results.fmt_ms([r.ttft_s for g in runs for r in g["results"]]),
            }
        )
    return rows


async def run_churn(args, tokenizer) -> tuple[list[dict[str, Any]], Any]:
    n_tokens, max_tokens = (64, 8) if args.quick else (530, 16)
    pool = churn_pool(args, n_tokens, max_tokens)
    env = {"MINIVLLM_KV_CACHE_BYTES": str(pool["kv cache bytes"]), "MINIVLLM_PREFIX_CACHE": "1"}
    specs = [runner.spec_for(args, f"churn-{p}", {**env, "MINIVLLM_EVICTION": p}) for p in args.evictions]
    by_policy = await runner.run_configs(
        specs, args.runs, lambda s, r: churn_run(s, r, tokenizer, pool, n_tokens, max_tokens)
    )
    return summarize_churn(by_policy, pool), by_policy


# ---------------------------------------------------------------- main

NOTES = {
    "bursts": (
        "All requests of a burst are sent at once with the same prompt. TTFT: client-side, send -> first "
        "streamed content; mean ± sd over runs. Restored per follower: cached_tokens of all but the request "
        "that restored least (the one that computed). Reductions vs independent execution."
    ),
    "churn": (
        "Distinct prompts sent one at a time into a pool sized for 3 requests, demanding 3x its pages; then "
        "the first prompt again. Pages evicted: delta of minivllm_pages_evicted_total (— if /metrics lacks it). "
        "kv cache bytes assumes the KV dtype size given by --kv-dtype-bytes."
    ),
}


async def run(args) -> None:
    tokenizer = prompts.load_tokenizer(args.model)
    rows, raw = await (run_churn if args.scenario == "churn" else run_bursts)(args, tokenizer)
    name = runner.result_name("single_flight" + ("_churn" if args.scenario == "churn" else ""), args)
    meta = results.metadata(args.model, args.page_size, server=args.server, runs=args.runs, env=args.env)
    paths = results.write_results(
        name, rows, meta, out_dir=args.out, raw=raw, notes=NOTES[args.scenario], allow_dirty=args.allow_dirty
    )
    results.print_report(paths)


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=("bursts", "churn"), default="bursts")
    p.add_argument("--evictions", type=lambda s: s.split(","), default=list(POLICIES), help="churn: policies")
    p.add_argument(
        "--kv-dtype-bytes",
        type=int,
        default=None,
        help="churn: KV bytes per element (default: 4 on CPU, else 2)",
    )
    args = runner.parse_args(p, argv)
    if args.kv_dtype_bytes is None:
        args.kv_dtype_bytes = models.kv_dtype_bytes()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
