"""Peer comparison: the same scenarios against minivllm and mlx_lm.server, same model and dtype.

Scenarios: cold vs warm TTFT of an ~860-token prompt; 4 and 8 identical simultaneous cold prompts
(mean TTFT, slowest completion, cached tokens); aggregate decode throughput of 8 concurrent distinct
requests. Reports each metric per server (mean ± sd over runs) and the ratio minivllm/mlx-lm.
On the CPU backend the peer loads a float32 copy of a 4-bit model dir, as minivllm dequantizes at load,
with OpenBLAS preloaded, as minivllm loads it. --peers measures other ways to run the peer side by side
(`as-given+bundled` is what a plain `mlx_lm.server --model <dir>` does); --ttft first-chunk times the
first streamed chunk of any kind instead of the first one with content (both: a row for each).

    python -m benchmarks.peer [--servers minivllm,mlx-lm] [--model DIR] [--runs 3] [--quick]
        [--peers float32+openblas,as-given+bundled] [--ttft first-content,first-chunk]
        [--scenarios cold-warm,burst,throughput] [--prompt-tokens N] [--bursts 4,8] [--tag NAME]
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
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


SCENARIOS = ("cold-warm", "burst", "throughput")
TTFT_DEFINITIONS = ("first-content", "first-chunk")


@dataclass(frozen=True)
class Peer:
    """One way to run mlx_lm.server: its weights and its BLAS (servers.PEER_WEIGHTS, servers.PEER_BLAS)."""

    weights: str = "float32"
    blas: str = "openblas"

    @property
    def label(self) -> str:
        # The default keeps the plain name, so results from before --peers read the same.
        return "mlx-lm" if self == Peer() else f"mlx-lm {self.weights}+{self.blas}"


def parse_peers(text: str) -> list[Peer]:
    peers = []
    for item in text.split(","):
        weights, _, blas = item.partition("+")
        if weights not in servers.PEER_WEIGHTS or blas not in servers.PEER_BLAS:
            raise ValueError(
                f"--peers {item!r}: expected WEIGHTS+BLAS, WEIGHTS in {servers.PEER_WEIGHTS}, "
                f"BLAS in {servers.PEER_BLAS}"
            )
        peers.append(Peer(weights, blas))
    return peers


@dataclass(frozen=True)
class Options:
    """What one peer run measures and how; the defaults are the headline comparison's."""

    sizes: Sizes
    scenarios: tuple[str, ...] = SCENARIOS
    ttft: tuple[str, ...] = ("first-content",)


def ttft_s(r: client.RequestResult, definition: str) -> float:
    return (r.first_chunk_at if definition == "first-chunk" else r.first_token_at) - r.sent_at


def ttft_metrics(m: dict, name: str, group: list[client.RequestResult], opt: Options) -> None:
    """Mean TTFT of the group under each definition asked for; the default one keeps the plain name."""
    for definition in opt.ttft:
        suffix = "" if definition == "first-content" else f" ({definition})"
        m[f"{name} TTFT ms{suffix}"] = results.mean_sd([ttft_s(r, definition) for r in group])[0] * 1e3


QUICK = Sizes(cold_tokens=200, burst_tokens=200, bursts=(4,), short_output=8, throughput_requests=4,
              throughput_prompt=64, throughput_output=16)  # fmt: skip


def decode_tok_s(group: list[client.RequestResult]) -> float:
    # Tokens after each request's first, over the window from the first first-token to the last finish:
    # the batch's decode rate, with prefill kept out as far as a client can tell.
    window = max(r.finished_at for r in group) - min(r.first_token_at for r in group)
    return sum(max(0, r.completion_tokens - 1) for r in group) / window if window > 0 else float("nan")


async def cold_warm(session: runner.Session, run: int, tokenizer, opt: Options, m: dict, raw: dict) -> None:
    prompt = prompts.make_prompt(tokenizer, opt.sizes.cold_tokens, 50_000 + run)
    cold = await session.chat(prompt.messages, opt.sizes.short_output)
    warm = await session.chat(prompt.messages, opt.sizes.short_output)
    raw["cold_warm"] = [cold, warm]
    m["cold/warm: prompt tokens"] = cold.prompt_tokens
    ttft_metrics(m, "cold/warm: cold", [cold], opt)
    ttft_metrics(m, "cold/warm: warm", [warm], opt)
    m["cold/warm: warm cached tokens"] = warm.cached_tokens


async def bursts(session: runner.Session, run: int, tokenizer, opt: Options, m: dict, raw: dict) -> None:
    sz = opt.sizes
    for i, n in enumerate(sz.bursts):
        prompt = prompts.make_prompt(tokenizer, sz.burst_tokens, 51_000 + 100 * run + i)
        rs = await session.burst([prompt.messages] * n, sz.short_output)
        raw[f"burst_{n}"] = rs
        ttft_metrics(m, f"burst {n}: mean", rs, opt)
        m[f"burst {n}: slowest completion ms"] = max(r.latency_s for r in rs) * 1e3
        m[f"burst {n}: mean cached tokens"] = results.mean_sd([r.cached_tokens for r in rs])[0]


async def throughput(session: runner.Session, run: int, tokenizer, opt: Options, m: dict, raw: dict) -> None:
    sz = opt.sizes
    batch = [
        prompts.make_prompt(tokenizer, sz.throughput_prompt, 52_000 + 100 * run + i).messages
        for i in range(sz.throughput_requests)
    ]
    rs = await session.burst(batch, sz.throughput_output)
    raw["throughput"] = rs
    wall = max(r.finished_at for r in rs) - min(r.sent_at for r in rs)
    m[f"throughput x{sz.throughput_requests}: decode tok/s"] = decode_tok_s(rs)
    m[f"throughput x{sz.throughput_requests}: end-to-end tok/s"] = sum(r.completion_tokens for r in rs) / wall


SCENARIO_FUNCTIONS = {"cold-warm": cold_warm, "burst": bursts, "throughput": throughput}


async def peer_run(session: runner.Session, run: int, tokenizer, opt: Options) -> dict[str, Any]:
    m: dict[str, float] = {}
    raw: dict[str, Any] = {}
    for scenario in opt.scenarios:
        await SCENARIO_FUNCTIONS[scenario](session, run, tokenizer, opt, m, raw)
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
        for peer in (n for n in names if n.startswith("mlx-lm") and "minivllm" in means):
            row[f"minivllm/{peer}"] = f"{means['minivllm'] / means[peer]:.2f}" if means[peer] else "—"
        rows.append(row)
    return rows


def server_specs(args) -> list[servers.ServerSpec]:
    specs = []
    for name in args.servers:
        if name != "mlx-lm":
            specs.append(runner.spec_for(args, name, name=name))
            continue
        for peer in args.peers:
            spec = runner.spec_for(args, peer.label, name=name)
            specs.append(dataclasses.replace(spec, peer_weights=peer.weights, peer_blas=peer.blas))
    return specs


def options(args) -> Options:
    sizes = QUICK if args.quick else Sizes()
    if args.prompt_tokens:
        sizes = dataclasses.replace(sizes, cold_tokens=args.prompt_tokens, burst_tokens=args.prompt_tokens)
    if args.bursts:
        sizes = dataclasses.replace(sizes, bursts=tuple(args.bursts))
    return Options(sizes, tuple(args.scenarios), tuple(args.ttft))


def result_name(args, opt: Options) -> str:
    both = set(args.servers) == set(servers.SERVER_NAMES)
    default = args.peers == [Peer()] and opt.scenarios == SCENARIOS and opt.ttft == ("first-content",)
    tag = args.tag or ("" if default and opt.sizes in (Sizes(), QUICK) else "variants")
    name = "peer" + ("" if both else "-" + "+".join(args.servers)) + (f"-{tag}" if tag else "")
    return name + ("-quick" if args.quick else "")


async def run(args) -> None:
    tokenizer = prompts.load_tokenizer(args.model)
    load = os.getloadavg()  # the machine may be shared: other work shifts the ratios
    opt = options(args)
    specs = server_specs(args)
    by_server = await runner.run_configs(specs, args.runs, lambda s, r: peer_run(s, r, tokenizer, opt))
    rows = summarize(by_server)
    name = result_name(args, opt)
    served = {s.label: str(servers.served_model_dir(s)) for s in specs}
    peers = {p.label: {"weights": p.weights, "blas": p.blas} for p in args.peers if "mlx-lm" in args.servers}
    meta = results.metadata(args.model, args.page_size, servers=args.servers, served_models=served, runs=args.runs,
                      env=args.env, sizes=vars(opt.sizes), peers=peers, scenarios=list(opt.scenarios),
                      ttft=list(opt.ttft), load_average_at_start=load,
                      openblas_num_threads=os.environ.get("OPENBLAS_NUM_THREADS", "unset"))  # fmt: skip
    paths = results.write_results(
        name, rows, meta, out_dir=args.out, raw=by_server, notes=NOTES, allow_dirty=args.allow_dirty
    )
    if args.plot and len(specs) > 1:
        ttft = [m for m in next(iter(by_server.values()))[0]["metrics"] if "TTFT" in m]
        series = {
            n: [results.mean_sd([r["metrics"][m] for r in runs])[0] for m in ttft]
            for n, runs in by_server.items()
        }
        results.save_plot(name, ttft, series, "ms", out_dir=args.out)
    results.print_report(paths)


NOTES = (
    "TTFT: client-side, send -> first streamed content (--ttft first-chunk: first streamed chunk of any kind). "
    "Peers: mlx_lm.server's WEIGHTS+BLAS: float32 (a dequantized copy) or as-given (the model dir), OpenBLAS "
    "preloaded or MLX's bundled BLAS; plain `mlx-lm` is float32+openblas. Cached tokens: usage.prompt_tokens_details.cached_tokens. "
    "Decode tok/s: completion tokens after each request's first / (last finish - first first-token). "
    "End-to-end tok/s: all completion tokens / (last finish - first send). Ratio of means; for TTFT and "
    "latency lower is better, for tok/s higher is better."
)


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--servers", type=lambda s: s.split(","), default=list(servers.SERVER_NAMES), help="comma-separated"
    )
    p.add_argument(
        "--peers",
        default="float32+openblas",
        help="comma-separated ways to run mlx_lm.server, each WEIGHTS+BLAS: WEIGHTS float32 (a dequantized "
        "copy, as minivllm computes) or as-given (the model dir itself); BLAS openblas (preloaded) or bundled "
        "(MLX's own, as a plain install runs)",
    )
    p.add_argument(
        "--ttft",
        default="first-content",
        help=f"comma-separated TTFT definitions, a row each: {','.join(TTFT_DEFINITIONS)}",
    )
    p.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}"
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=0, help="cold/warm and burst prompt length (0: default)"
    )
    p.add_argument("--bursts", type=lambda s: [int(n) for n in s.split(",")], default=[],
                   help="comma-separated burst sizes (default: 4,8)")  # fmt: skip
    p.add_argument(
        "--tag", default="", help="results name suffix (default: 'variants' for non-default options)"
    )
    args = runner.parse_args(p, argv)
    unknown = set(args.servers) - set(servers.SERVER_NAMES)
    if unknown:
        p.error(f"unknown servers {sorted(unknown)}")
    args.scenarios, args.ttft = args.scenarios.split(","), args.ttft.split(",")
    if set(args.ttft) - set(TTFT_DEFINITIONS):
        p.error(
            f"--ttft: unknown {sorted(set(args.ttft) - set(TTFT_DEFINITIONS))}; expected {TTFT_DEFINITIONS}"
        )
    if set(args.scenarios) - set(SCENARIOS):
        p.error(f"--scenarios: unknown {sorted(set(args.scenarios) - set(SCENARIOS))}; expected {SCENARIOS}")
    if args.prompt_tokens < 0 or any(n < 1 for n in args.bursts):
        p.error("--prompt-tokens must be >= 0 and --bursts sizes >= 1")
    try:
        args.peers = parse_peers(args.peers)
    except ValueError as e:
        p.error(str(e))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
