"""Peer comparison: the same scenarios against minivllm and mlx_lm.server, same model and dtype.

Scenarios: cold vs warm TTFT of an ~860-token prompt; 4 and 8 identical simultaneous cold prompts
(mean TTFT, slowest completion, cached tokens); aggregate decode throughput of 8 concurrent distinct
requests. Reports each metric per server (mean ± sd over runs) and the ratio minivllm/mlx-lm.
On the CPU backend the peer loads a float32 copy of a 4-bit model dir, as minivllm dequantizes at load.

    python -m benchmarks.peer [--servers minivllm,mlx-lm] [--model DIR] [--runs 3] [--quick]
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import client, prompts, results, runner, servers


@dataclass
class Sizes:
    cold_tokens: int = 858  # as measured on mlx_lm.server before minivllm existed
    burst_tokens: int = 819
    bursts: tuple[int, ...] = (4, 8)
    short_output: int = 16
    throughput_requests: int = 8
    throughput_prompt: int = 128
    throughput_output: int = 128


QUICK = Sizes(cold_tokens=200, burst_tokens=200, bursts=(4,), short_output=8, throughput_requests=4,
              throughput_prompt=64, throughput_output=16)  # fmt: skip


def decode_tok_s(group: list[client.RequestResult]) -> float:
    # Tokens after each request's first, over the window from the first first-token to the last finish:
    # the batch's decode rate, with prefill kept out as far as a client can tell.
    window = max(r.finished_at for r in group) - min(r.first_token_at for r in group)
    return sum(max(0, r.completion_tokens - 1) for r in group) / window if window > 0 else float("nan")


async def peer_run(session: runner.Session, run: int, tokenizer, sz: Sizes) -> dict[str, Any]:
    m: dict[str, float] = {}
    raw: dict[str, Any] = {}
    prompt = prompts.make_prompt(tokenizer, sz.cold_tokens, 50_000 + run)
    cold = await session.chat(prompt.messages, sz.short_output)
    warm = await session.chat(prompt.messages, sz.short_output)
    raw["cold_warm"] = [cold, warm]
    m["cold/warm: prompt tokens"] = cold.prompt_tokens
    m["cold/warm: cold TTFT ms"] = cold.ttft_s * 1e3
    m["cold/warm: warm TTFT ms"] = warm.ttft_s * 1e3
    m["cold/warm: warm cached tokens"] = warm.cached_tokens
    for i, n in enumerate(sz.bursts):
        prompt = prompts.make_prompt(tokenizer, sz.burst_tokens, 51_000 + 100 * run + i)
        rs = await session.burst([prompt.messages] * n, sz.short_output)
        raw[f"burst_{n}"] = rs
        m[f"burst {n}: mean TTFT ms"] = results.mean_sd([r.ttft_s for r in rs])[0] * 1e3
        m[f"burst {n}: slowest completion ms"] = max(r.latency_s for r in rs) * 1e3
        m[f"burst {n}: mean cached tokens"] = results.mean_sd([r.cached_tokens for r in rs])[0]
    batch = [
        prompts.make_prompt(tokenizer, sz.throughput_prompt, 52_000 + 100 * run + i).messages
        for i in range(sz.throughput_requests)
    ]
    rs = await session.burst(batch, sz.throughput_output)
    raw["throughput"] = rs
    wall = max(r.finished_at for r in rs) - min(r.sent_at for r in rs)
    m[f"throughput x{sz.throughput_requests}: decode tok/s"] = decode_tok_s(rs)
    m[f"throughput x{sz.throughput_requests}: end-to-end tok/s"] = sum(r.completion_tokens for r in rs) / wall
    return {"metrics": m, "raw": raw}


def summarize(by_server: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    names = list(by_server)
    rows = []
    for metric in by_server[names[0]][0]["metrics"]:
        row: dict[str, Any] = {"metric": metric}
        means = {}
        for name in names:
            values = [r["metrics"][metric] for r in by_server[name]]
            means[name], sd = results.mean_sd(values)
            row[name] = f"{means[name]:,.1f} ± {sd:,.1f}"
        if {"minivllm", "mlx-lm"} <= set(means):
            row["minivllm/mlx-lm"] = f"{means['minivllm'] / means['mlx-lm']:.2f}" if means["mlx-lm"] else "—"
        rows.append(row)
    return rows


async def run(args) -> None:
    tokenizer = prompts.load_tokenizer(args.model)
    sizes = QUICK if args.quick else Sizes()
    specs = [runner.spec_for(args, name, name=name) for name in args.servers]
    by_server = await runner.run_configs(specs, args.runs, lambda s, r: peer_run(s, r, tokenizer, sizes))
    rows = summarize(by_server)
    both = set(args.servers) == set(servers.SERVER_NAMES)
    name = "peer" + ("" if both else "-" + "+".join(args.servers)) + ("-quick" if args.quick else "")
    served = {s.name: str(servers.served_model_dir(s)) for s in specs}
    meta = results.metadata(args.model, args.page_size, servers=args.servers, served_models=served, runs=args.runs,
                      env=args.env, sizes=vars(sizes))  # fmt: skip
    paths = results.write_results(
        name, rows, meta, out_dir=args.out, raw=by_server, notes=NOTES, allow_dirty=args.allow_dirty
    )
    if args.plot and both:
        ttft = [m for m in by_server[args.servers[0]][0]["metrics"] if "TTFT" in m]
        series = {
            n: [results.mean_sd([r["metrics"][m] for r in by_server[n]])[0] for m in ttft]
            for n in args.servers
        }
        results.save_plot(name, ttft, series, "ms", out_dir=args.out)
    results.print_report(paths)


NOTES = (
    "TTFT: client-side, send -> first streamed content. Cached tokens: usage.prompt_tokens_details.cached_tokens. "
    "Decode tok/s: completion tokens after each request's first / (last finish - first first-token). "
    "End-to-end tok/s: all completion tokens / (last finish - first send). Ratio of means; for TTFT and "
    "latency lower is better, for tok/s higher is better."
)


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--servers", type=lambda s: s.split(","), default=list(servers.SERVER_NAMES), help="comma-separated"
    )
    args = runner.parse_args(p, argv)
    unknown = set(args.servers) - set(servers.SERVER_NAMES)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
