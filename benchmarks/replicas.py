"""Replicas on Ray Serve: TTFT and cached tokens of concurrent multi-turn chats at 1 and 2 engine replicas,
prefix-affinity vs round-robin routing.

Sessions run concurrently, each a chat of several turns in sequence; every turn resends the whole
conversation (a document, then questions and answers), as chat clients do. Configurations, each a fresh
server: one process (`uvicorn server.app:app`, no Ray), `minivllm serve --replicas 1`, and 2 replicas with
affinity and with round-robin routing. Per configuration: TTFT of first turns (cold) and of later turns,
cached tokens of later turns, the share of later-turn prompt tokens restored, and prompt tokens computed
per replica (from /metrics).

    python -m benchmarks.replicas [--model DIR | --tiny] [--runs 3] [--quick] [--sessions 6] [--turns 4]
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness import client, prompts, results, runner

CONFIGS = {  # label -> (replicas, routing); None: the single-process server
    "one process": (None, ""),
    "1 replica": (1, "affinity"),
    "2 replicas, affinity": (2, "affinity"),
    "2 replicas, round-robin": (2, "round-robin"),
}
COMPUTED = "minivllm_computed_prompt_tokens_total"


def follow_up(turn: int) -> str:
    return f"Question {turn}: " + prompts.filler_text(900 + turn, 160)


async def chat_session(
    session: runner.Session, document: prompts.Prompt, turns: int, max_tokens: int
) -> list[client.RequestResult]:
    """One user: ask, read the answer, ask again with the whole conversation."""
    messages = list(document.messages)
    out = []
    for turn in range(turns):
        r = await session.chat(messages, max_tokens)
        out.append(r)
        messages += [{"role": "assistant", "content": r.text}, {"role": "user", "content": follow_up(turn)}]
    return out


def computed_by_replica(base_url: str) -> dict[str, float]:
    """Prompt tokens each replica computed (one unnamed entry for the single-process server)."""
    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    return {
        sample.labels.get("replica", "-"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == COMPUTED
    }


async def one_run(session: runner.Session, run: int, tokenizer, args) -> dict[str, Any]:
    documents = [
        prompts.make_prompt(tokenizer, args.doc_tokens, 50_000 + 100 * run + s) for s in range(args.sessions)
    ]
    before = computed_by_replica(session.server.base_url)
    chats = await asyncio.gather(*(chat_session(session, d, args.turns, args.max_tokens) for d in documents))
    await asyncio.sleep(2.5)  # replica stats reach the ingress about every second
    after = computed_by_replica(session.server.base_url)
    return {"chats": chats, "computed": {r: v - before.get(r, 0.0) for r, v in after.items()}}


def summarize(by_config: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    base_rr = None
    for label, runs in by_config.items():
        first = [chat[0] for run in runs for chat in run["chats"]]
        later = [r for run in runs for chat in run["chats"] for r in chat[1:]]
        share = [
            sum(r.cached_tokens for chat in run["chats"] for r in chat[1:])
            / max(1, sum(r.prompt_tokens for chat in run["chats"] for r in chat[1:]))
            for run in runs
        ]
        computed = [sorted(run["computed"].values(), reverse=True) for run in runs]
        row = {
            "configuration": label,
            "first-turn TTFT ms": results.fmt_ms([r.ttft_s for r in first]),
            "later-turn TTFT ms": results.fmt_ms([r.ttft_s for r in later]),
            "later-turn prompt tokens": results.mean_sd([r.prompt_tokens for r in later])[0],
            "later-turn cached tokens": results.mean_sd([r.cached_tokens for r in later])[0],
            "restored share of later turns %": 100 * results.mean_sd(share)[0],
            "prompt tokens computed per replica": " / ".join(
                f"{results.mean_sd([c[i] for c in computed if len(c) > i])[0]:,.0f}"
                for i in range(max(map(len, computed)))
            ),
        }
        if label.endswith("round-robin"):
            base_rr = row["later-turn cached tokens"]
        rows.append(row)
    for row in rows:
        cached = row["later-turn cached tokens"]
        row["cached vs round-robin"] = f"{cached / base_rr:.2f}x" if base_rr else None
    return rows


NOTES = (
    "Sessions run concurrently; each sends its turns one after another and every turn resends the whole "
    "conversation. TTFT: client-side, send -> first streamed content, mean ± sd over all requests of all "
    "runs. Cached tokens: usage.prompt_tokens_details.cached_tokens. Prompt tokens computed per replica: "
    "delta of minivllm_computed_prompt_tokens_total per replica over a run, largest first."
)


def tiny_model_dir() -> Path:
    import minivllm  # noqa: F401  (OpenBLAS before the tiny model builder imports mlx)
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(Path(tempfile.mkdtemp(prefix="minivllm-tiny-")))


async def run(args) -> None:
    tokenizer = prompts.load_tokenizer(args.model)
    specs = []
    for label, (replicas, routing) in CONFIGS.items():
        spec = runner.spec_for(args, label)
        specs.append(dataclasses.replace(spec, replicas=replicas, routing=routing or spec.routing))
    by_config = await runner.run_configs(specs, args.runs, lambda s, r: one_run(s, r, tokenizer, args))
    rows = summarize(by_config)
    name = runner.result_name("replicas" + ("_tiny" if args.tiny else ""), args)
    workload = {k: getattr(args, k) for k in ("sessions", "turns", "doc_tokens", "max_tokens")}
    meta = results.metadata(args.model, args.page_size, runs=args.runs, env=args.env, workload=workload)
    results.print_report(
        results.write_results(
            name, rows, meta, out_dir=args.out, raw=by_config, notes=NOTES, allow_dirty=args.allow_dirty
        )
    )


def main(argv: list[str] | None = None) -> None:
    p = runner.base_parser(__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a small random model (tests/tiny_model.py)")
    p.add_argument("--sessions", type=int, default=6, help="concurrent chat sessions")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--doc-tokens", type=int, default=600, help="tokens of each session's first prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    argv = sys.argv[1:] if argv is None else argv
    if p.parse_args(argv).tiny and "--model" not in argv:
        argv = [*argv, "--model", str(tiny_model_dir())]
    args = runner.parse_args(p, argv)
    if args.quick:
        args.sessions, args.turns, args.doc_tokens, args.max_tokens = 3, 3, 200, 8
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
