"""Concurrent population: followers arrive while the first request with the same prompt decodes.

One request starts (~500-token prompt, 128 output tokens); once its first token arrives, 2/4/8
followers with the same prompt are sent at once. Publication at completion vs incremental (single
flight off): restored tokens per follower and mean TTFT, with the reduction incremental buys.

    python -m benchmarks.concurrent_population [--model DIR] [--runs 3] [--quick]
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.harness import prompts, results, runner

CONFIGS = {
    "completion": {"MINIVLLM_PUBLICATION": "completion", "MINIVLLM_SINGLE_FLIGHT": "off"},
    "incremental": {"MINIVLLM_PUBLICATION": "incremental", "MINIVLLM_SINGLE_FLIGHT": "off"},
}


async def one_group(
    session: runner.Session, prompt: prompts.Prompt, followers: int, max_tokens: int
) -> dict[str, Any]:
    started = asyncio.Event()
    leader = asyncio.create_task(session.chat(prompt.messages, max_tokens, first_token=started))
    await started.wait()  # the leader has prefilled: whatever it publishes early is visible now
    rest = await session.burst([prompt.messages] * followers, max_tokens)
    return {"leader": await leader, "followers": rest}


async def one_run(
    session: runner.Session, run: int, tokenizer, groups: tuple[int, ...], n_tokens: int, max_tokens: int
):
    out = {}
    for i, n in enumerate(groups):
        # A new prompt per group and run: every group starts from a cold cache for its prompt.
        prompt = prompts.make_prompt(tokenizer, n_tokens, 20_000 + 100 * run + i)
        out[n] = await one_group(session, prompt, n, max_tokens)
    return out


def follower_means(runs: list[dict[int, Any]], n: int, field: str) -> list[float]:
    """Each run's mean over its followers of one RequestResult field."""
    return [results.mean_sd([getattr(r, field) for r in g[n]["followers"]])[0] for g in runs]


def summarize(by_config: dict[str, list[dict[int, Any]]], groups: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for n in groups:
        base = results.mean_sd(follower_means(by_config.get("completion", []), n, "ttft_s"))[0]
        for label, runs in by_config.items():
            ttft = follower_means(runs, n, "ttft_s")
            everyone = [
                results.mean_sd([x.ttft_s for x in [g[n]["leader"], *g[n]["followers"]]])[0] for g in runs
            ]
            rows.append(
                {
                    "followers": n,
                    "publication": label,
                    "prompt tokens": runs[0][n]["leader"].prompt_tokens,
                    "restored per follower": results.mean_sd(follower_means(runs, n, "cached_tokens"))[0],
                    "min restored": min(r.cached_tokens for g in runs for r in g[n]["followers"]),
                    "leader TTFT ms": results.fmt_ms([g[n]["leader"].ttft_s for g in runs]),
                    "follower mean TTFT ms": results.fmt_ms(ttft),
                    "all-request mean TTFT ms": results.fmt_ms(everyone),
                    "follower TTFT reduction % vs completion": (
                        None if label == "completion" else results.reduction(base, results.mean_sd(ttft)[0])
                    ),
                }
            )
    return rows


async def run(args) -> None:
    tokenizer = prompts.load_tokenizer(args.model)
    groups, n_tokens, max_tokens = (
        ((2,), 200, 16) if args.quick else ((2, 4, 8), 493, 128)
    )  # the seed article: 493 -> 480 restored
    specs = [runner.spec_for(args, label, env) for label, env in CONFIGS.items()]
    by_config = await runner.run_configs(
        specs, args.runs, lambda s, r: one_run(s, r, tokenizer, groups, n_tokens, max_tokens)
    )
    rows = summarize(by_config, groups)
    name = runner.result_name("concurrent_population", args)
    meta = results.metadata(args.model, args.page_size, server=args.server, runs=args.runs, env=args.env)
    paths = results.write_results(
        name, rows, meta, out_dir=args.out, raw=by_config, notes=NOTES, allow_dirty=args.allow_dirty
    )
    if args.plot:
        series = {
            label: [
                results.mean_sd([results.mean_sd([x.ttft_s for x in g[n]["followers"]])[0] for g in runs])[0]
                * 1e3
                for n in groups
            ]
            for label, runs in by_config.items()
        }
        results.save_plot(
            name, [f"{n} followers" for n in groups], series, "follower mean TTFT (ms)", out_dir=args.out
        )
    results.print_report(paths)


NOTES = (
    "Followers are sent together once the leader's first token arrives. TTFT: client-side, send -> first "
    "streamed content; mean ± sd over runs of each run's mean. Restored: cached_tokens."
)


def main(argv: list[str] | None = None) -> None:
    args = runner.parse_args(runner.base_parser(__doc__.splitlines()[0]), argv)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
