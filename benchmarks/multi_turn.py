"""Multi-turn chat under cache pressure: concurrent sessions that grow turn by turn, one-off documents between.

Every session shares one system prompt; each turn sends the whole conversation so far (previous answers
included) plus a new user message. Before each of its turns a session may first send a one-off long
document under the same system prompt (a scan: never reused). A client-side limit keeps `concurrency`
requests in flight. The KV pool is sized for the requests in flight plus a fraction of the sessions'
working set, so it cannot keep every conversation: the eviction policy decides which turns restore their
history. Per policy (a fresh server each): restored tokens and mean TTFT per turn, and the sessions'
token hit rate (restored / prompt tokens).

    python -m benchmarks.multi_turn [--model DIR] [--runs 3] [--quick] [--plot]
    python -m benchmarks.multi_turn --tiny --preset sweep --plot     # the tiny random model, a larger sweep
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import models, prompts, results, runner
from benchmarks.harness.client import RequestResult
from minivllm.cache.eviction import POLICIES


@dataclass(frozen=True)
class Scenario:
    sessions: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int  # max_tokens of every request (answers run to it: ignore_eos)
    doc_tokens: int
    doc_every: int  # a session sends a document before every doc_every-th turn of its own
    concurrency: int  # requests in flight
    pool_fraction: float  # of the sessions' final working set, on top of the in-flight requests' pages


PRESETS = {
    "quick": Scenario(2, 3, 96, 32, 8, 160, 1, 2, 0.3),
    "real": Scenario(4, 4, 256, 64, 24, 600, 2, 2, 0.4),  # the default model on a 2-core CPU: minutes
    "sweep": Scenario(8, 8, 512, 96, 32, 1200, 2, 3, 0.4),  # meant for the tiny model
}


def pool_tokens(s: Scenario) -> int:
    """Requests in flight at their largest, plus pool_fraction of what a perfect cache would keep."""
    turn = s.user_tokens + s.answer_tokens + 16  # + chat template tokens
    final_context = s.system_tokens + s.turns * turn
    in_flight = s.concurrency * (max(final_context, s.system_tokens + s.doc_tokens) + s.answer_tokens)
    working_set = s.system_tokens + s.sessions * (final_context - s.system_tokens)
    return in_flight + int(s.pool_fraction * working_set)


class Texts:
    """Deterministic filler text of about n tokens."""

    def __init__(self, tokenizer):
        self.chars_per_token = prompts.chars_per_token(tokenizer)

    def __call__(self, n_tokens: int, seed: int) -> str:
        return prompts.filler_text(seed, int(n_tokens * self.chars_per_token))


async def one_session(
    session: runner.Session,
    gate: asyncio.Semaphore,
    s: Scenario,
    texts: Texts,
    system: str,
    index: int,
    seed: int,
) -> dict[str, list[RequestResult]]:
    messages = [{"role": "system", "content": system}]
    turns, docs = [], []
    for t in range(s.turns):
        if t % s.doc_every == 0:
            doc = texts(s.doc_tokens, seed + 7919 * (index * s.turns + t) + 1)
            async with gate:
                docs.append(await chat(session, [messages[0], {"role": "user", "content": doc}], s))
        messages.append({"role": "user", "content": texts(s.user_tokens, seed + 104_729 * (index + 1) + t)})
        async with gate:
            answer = await chat(session, messages, s)
        turns.append(answer)
        messages.append({"role": "assistant", "content": answer.text})
    return {"turns": turns, "docs": docs}


async def chat(session: runner.Session, messages: list[dict[str, str]], s: Scenario) -> RequestResult:
    return await session.chat(messages, s.answer_tokens, extra_body={"ignore_eos": True})


async def one_run(session: runner.Session, run: int, s: Scenario, texts: Texts) -> list[dict[str, Any]]:
    """All sessions of one run, concurrently; a list of {"turns", "docs"} per session."""
    seed = 1_000_003 * (run + 1)  # new text every run: the server's cache from earlier runs does not help
    system = texts(s.system_tokens, seed)
    gate = asyncio.Semaphore(s.concurrency)
    return list(
        await asyncio.gather(
            *(one_session(session, gate, s, texts, system, i, seed) for i in range(s.sessions))
        )
    )


def turn_means(by_policy: dict[str, list[list[dict]]], field: str) -> dict[str, list[float]]:
    """Per policy, per turn: the mean of one RequestResult field over sessions and runs."""
    out = {}
    for policy, runs in by_policy.items():
        sessions = [sess for run in runs for sess in run]
        turns = len(sessions[0]["turns"])
        out[policy] = [
            results.mean_sd([getattr(x["turns"][t], field) for x in sessions])[0] for t in range(turns)
        ]
    return out


def summarize(by_policy: dict[str, list[list[dict]]]) -> tuple[list[dict], list[dict]]:
    """One row per policy (hit rates, restored per turn, TTFT) and one per policy and turn."""
    per_policy, per_turn = [], []
    prompt, restored = turn_means(by_policy, "prompt_tokens"), turn_means(by_policy, "cached_tokens")
    for policy, runs in by_policy.items():
        sessions = [sess for run in runs for sess in run]
        turns = [a for sess in sessions for a in sess["turns"]]
        docs = [d for sess in sessions for d in sess["docs"]]
        per_policy.append(
            {
                "eviction": policy,
                "session hit rate %": 100 * hit_rate(turns),
                "hit rate with documents %": 100 * hit_rate(turns + docs),
                "restored per turn (turns 2+)": results.mean_sd(
                    [a.cached_tokens for sess in sessions for a in sess["turns"][1:]]
                )[0],
                "mean TTFT ms (turns)": results.fmt_ms([a.ttft_s for a in turns]),
                "mean TTFT ms (documents)": results.fmt_ms([d.ttft_s for d in docs]),
            }
        )
        for t in range(len(prompt[policy])):
            per_turn.append(
                {
                    "eviction": policy,
                    "turn": t + 1,
                    "prompt tokens": prompt[policy][t],
                    "restored": restored[policy][t],
                    "TTFT ms": results.fmt_ms([sess["turns"][t].ttft_s for sess in sessions]),
                }
            )
    return per_policy, per_turn


def hit_rate(answers: list[RequestResult]) -> float:
    prompt = sum(a.prompt_tokens for a in answers)
    return sum(a.cached_tokens for a in answers) / prompt if prompt else math.nan


def plot(name: str, by_policy: dict[str, list[list[dict]]], out_dir: Path) -> None:
    restored = turn_means(by_policy, "cached_tokens")
    ttft_ms = {p: [x * 1e3 for x in v] for p, v in turn_means(by_policy, "ttft_s").items()}
    groups = [f"turn {t + 1}" for t in range(len(next(iter(restored.values()))))]
    results.save_plot(name, groups, restored, "restored tokens per turn (mean)", out_dir=out_dir)
    results.save_plot(name + "_ttft", groups, ttft_ms, "TTFT per turn (ms, mean)", out_dir=out_dir)


NOTES = (
    "Restored: usage.prompt_tokens_details.cached_tokens, mean over sessions and runs. TTFT: client-side, "
    "send -> first streamed content (a request waits for the client's in-flight limit before it is sent), "
    "mean ± sd over sessions and runs. Session hit rate: restored / prompt tokens over all session turns."
)


async def run(args) -> None:
    s = PRESETS["quick" if args.quick else args.preset]
    tokenizer = prompts.load_tokenizer(args.model)
    page_bytes = args.page_size * models.kv_bytes_per_token(args.model, models.kv_dtype_bytes())
    pool_pages = math.ceil(pool_tokens(s) / args.page_size)
    env = {"MINIVLLM_KV_CACHE_BYTES": str(pool_pages * page_bytes), "MINIVLLM_PREFIX_CACHE": "1"}
    specs = [runner.spec_for(args, p, {**env, "MINIVLLM_EVICTION": p}) for p in args.policies]
    texts = Texts(tokenizer)
    by_policy = await runner.run_configs(specs, args.runs, lambda session, r: one_run(session, r, s, texts))
    per_policy, per_turn = summarize(by_policy)
    preset = "" if args.quick or args.preset == "real" else f"_{args.preset}"
    name = runner.result_name(f"multi_turn{preset}{'_tiny' if args.tiny else ''}", args)
    meta = results.metadata(
        args.model, args.page_size, server=args.server, runs=args.runs, env=args.env, scenario=vars(s),
        pool_pages=pool_pages,
    )  # fmt: skip
    paths = results.write_results(name, per_policy, meta, out_dir=args.out, raw=by_policy, notes=NOTES)
    results.write_results(name + "_turns", per_turn, meta, out_dir=args.out, notes=NOTES)
    if args.plot:
        plot(name, by_policy, args.out)
    results.print_report(paths)


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument("--preset", choices=PRESETS, default="real", help="scenario size (--quick: the smallest)")
    p.add_argument(
        "--policies",
        type=lambda x: x.split(","),
        default=list(POLICIES),
        help="eviction policies, comma list",
    )
    p.add_argument(
        "--tiny", action="store_true", help="build and use the tiny random test model (not --model)"
    )
    tiny = argparse.ArgumentParser(add_help=False)
    tiny.add_argument("--tiny", action="store_true")
    known, rest = tiny.parse_known_args(argv)
    if known.tiny:  # before runner.parse_args, which would resolve (and fetch) the default model
        from tests.tiny_model import make_tiny_model

        model = make_tiny_model(Path(tempfile.mkdtemp(prefix="minivllm-tiny-")), max_position_embeddings=8192)
        rest += ["--tiny", "--model", str(model)]  # 8k context: the sweep's conversations outgrow 2k
    args = runner.parse_args(p, rest)
    unknown = [x for x in args.policies if x not in POLICIES]
    if unknown:
        p.error(f"--policies: unknown {unknown}; choose from {', '.join(POLICIES)}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
