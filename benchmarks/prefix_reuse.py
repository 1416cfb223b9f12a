"""Prefix reuse: a seed prompt warms the cache, then probes share 0/25/50/75/100% of its prefix.

Run with the prefix cache on and off (a fresh server each, so both start cold): restored tokens and
TTFT per overlap, the TTFT reduction the cache buys, and a check of the restore rule
restored = floor((N-1)/page)*page at 100% (floor(shared/page)*page below it).

    python -m benchmarks.prefix_reuse [--model DIR] [--runs 3] [--quick]
"""

from __future__ import annotations

import asyncio
from typing import Any

from benchmarks.harness import prompts, results, runner

OVERLAPS = (0.0, 0.25, 0.5, 0.75, 1.0)
CONFIGS = {"cache-on": {"MINIVLLM_PREFIX_CACHE": "1"}, "cache-off": {"MINIVLLM_PREFIX_CACHE": "0"}}


def build_prompts(tokenizer, n_tokens: int, run: int) -> tuple[prompts.Prompt, list[prompts.Prompt]]:
    # Seeds depend on the run only, so cache-on and cache-off see the very same prompts.
    seed = prompts.make_prompt(tokenizer, n_tokens, 10_000 * (run + 1))
    probes = [
        prompts.make_prompt(tokenizer, n_tokens, 10_000 * (run + 1) + 1 + i, share=seed, fraction=f)
        for i, f in enumerate(OVERLAPS)
    ]
    return seed, probes


async def one_run(
    session: runner.Session, run: int, tokenizer, n_tokens: int, max_tokens: int
) -> dict[str, Any]:
    seed, probes = build_prompts(tokenizer, n_tokens, run)
    cold = await session.chat(seed.messages, max_tokens)
    answers = []
    for probe in probes:  # one at a time: each probe measures reuse, not contention
        answers.append(await session.chat(probe.messages, max_tokens))
    return {
        "seed": cold,
        "probes": answers,
        "shared": [p.shared_tokens for p in probes],
        "client_tokens": [p.n_tokens for p in probes],  # if these differ from the server's, so may "expected"
    }


def summarize(by_config: dict[str, list[dict[str, Any]]], page_size: int) -> list[dict[str, Any]]:
    off_ttft = {
        f: results.mean_sd([r["probes"][i].ttft_s for r in by_config.get("cache-off", [])])[0]
        for i, f in enumerate(OVERLAPS)
    }
    rows = []
    for label, runs in by_config.items():
        cache_on = label == "cache-on"
        rows.append(
            {
                "cache": label,
                "request": "seed (cold)",
                "prompt tokens": runs[0]["seed"].prompt_tokens,
                "client tokens": None,
                "shared tokens": None,
                "restored": results.mean_sd([r["seed"].cached_tokens for r in runs])[0],
                "expected": 0,
                "rule holds": None,
                "TTFT ms": results.fmt_ms([r["seed"].ttft_s for r in runs]),
            }
        )
        for i, f in enumerate(OVERLAPS):
            probes = [r["probes"][i] for r in runs]
            expected = [
                prompts.expected_restore(r["shared"][i], p.prompt_tokens, page_size) if cache_on else 0
                for r, p in zip(runs, probes, strict=True)
            ]
            ttft = results.mean_sd([p.ttft_s for p in probes])[0]
            rows.append(
                {
                    "cache": label,
                    "request": f"probe {f:.0%}",
                    "prompt tokens": probes[0].prompt_tokens,
                    "client tokens": runs[0]["client_tokens"][i],
                    "shared tokens": runs[0]["shared"][i],
                    "restored": results.mean_sd([p.cached_tokens for p in probes])[0],
                    "expected": expected[0],
                    "rule holds": all(p.cached_tokens == e for p, e in zip(probes, expected, strict=True)),
                    "TTFT ms": results.fmt_ms([p.ttft_s for p in probes]),
                    "TTFT reduction % vs cache-off": results.reduction(off_ttft[f], ttft)
                    if cache_on
                    else None,
                }
            )
    return rows


async def run(args) -> None:
    tokenizer = prompts.load_tokenizer(args.model)
    n_tokens, max_tokens = (
        (300, 8) if args.quick else (904, 16)
    )  # the seed article's size (the rule gives 896 restored)
    specs = [runner.spec_for(args, label, env) for label, env in CONFIGS.items()]
    by_config = await runner.run_configs(
        specs, args.runs, lambda s, r: one_run(s, r, tokenizer, n_tokens, max_tokens)
    )
    rows = summarize(by_config, args.page_size)
    name = runner.result_name("prefix_reuse", args)
    meta = results.metadata(args.model, args.page_size, server=args.server, runs=args.runs, env=args.env)
    paths = results.write_results(
        name, rows, meta, out_dir=args.out, raw=by_config, notes=NOTES, allow_dirty=args.allow_dirty
    )
    if args.plot:
        on = [r for r in rows if r["cache"] == "cache-on" and r["request"].startswith("probe")]
        results.save_plot(name, [r["request"] for r in on], {"restored tokens": [r["restored"] for r in on]}, "tokens",
                    out_dir=args.out)  # fmt: skip
    results.print_report(paths)


NOTES = (
    "TTFT: client-side, send -> first streamed content, mean ± sd over runs. Restored: "
    "usage.prompt_tokens_details.cached_tokens. Expected (cache on): whole pages of the shared prefix, "
    "never the prompt's last token: floor(min(shared, N-1)/page)*page."
)


def main(argv: list[str] | None = None) -> None:
    args = runner.parse_args(runner.base_parser(__doc__.splitlines()[0]), argv)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
