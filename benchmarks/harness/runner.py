"""Scenario runner: the shared command line, one fresh server per configuration, repeated runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.harness.client import (
    RequestResult,
    chat_burst,
    fetch_metrics,
    make_client,
    stream_chat,
    warmup,
)
from benchmarks.harness.models import resolve_model
from benchmarks.harness.results import RESULTS_DIR, DirtyTree, require_clean_tree
from benchmarks.harness.servers import SERVER_NAMES, Server, ServerSpec, running_server

T = TypeVar("T")


async def repeat_runs(runs: int, fn: Callable[[int], Awaitable[T]], desc: str) -> list[T]:
    from tqdm import tqdm

    out = []
    for r in tqdm(range(runs), desc=desc, unit="run", file=sys.stderr):
        out.append(await fn(r))
    return out


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", help="model dir (default: minivllm.models.default_model.default_model_dir())")
    p.add_argument("--runs", type=int, default=3, help="repeated runs per configuration")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    p.add_argument("--quick", action="store_true", help="1 run, small prompts and bursts: a smoke test")
    p.add_argument("--plot", action="store_true", help="also write a PNG chart")
    p.add_argument("--page-size", type=int, default=16, help="MINIVLLM_PAGE_SIZE")
    p.add_argument(
        "--server",
        choices=SERVER_NAMES,
        default="minivllm",
        help="server to measure; mlx-lm ignores the MINIVLLM_* configurations (useful to smoke-test the script)",
    )
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra MINIVLLM_* setting")
    add_allow_dirty(p)
    return p


def add_allow_dirty(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run from a tree with uncommitted changes; results are written as <name>-DIRTY.*, not to be quoted",
    )


def parse_on_clean_tree(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse, then refuse a dirty tree (unless --allow-dirty) before any measuring starts."""
    args = p.parse_args(argv)
    try:
        require_clean_tree(args.allow_dirty)
    except DirtyTree as e:
        p.error(str(e))
    return args


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    args = parse_on_clean_tree(p, argv)
    if args.quick:
        args.runs = 1
    args.model = resolve_model(args.model)
    args.env = dict(kv.split("=", 1) for kv in args.env)
    return args


def spec_for(
    args: argparse.Namespace, label: str, env: dict[str, str] | None = None, name: str = ""
) -> ServerSpec:
    """The server for one configuration: page size, script-level env, then the configuration's env."""
    merged = {"MINIVLLM_PAGE_SIZE": str(args.page_size), **args.env, **(env or {})}
    return ServerSpec(name or args.server, args.model, merged, args.port, label)


def result_name(base: str, args: argparse.Namespace) -> str:
    # Keep smoke runs and peer-server runs from overwriting the real minivllm results.
    suffix = "" if getattr(args, "server", "minivllm") == "minivllm" else f"-{args.server}"
    return base + suffix + ("-quick" if args.quick else "")


@dataclass
class Session:
    """A started server with its client: what a scenario's run function receives."""

    server: Server
    client: Any

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, **kw: Any) -> RequestResult:
        return await stream_chat(self.client, messages, max_tokens, model=self.server.model_id, **kw)

    async def burst(
        self, prompts: list[list[dict[str, str]]], max_tokens: int, **kw: Any
    ) -> list[RequestResult]:
        return await chat_burst(self.client, prompts, max_tokens, model=self.server.model_id, **kw)

    def metrics(self) -> dict[str, float]:
        return fetch_metrics(self.server.base_url)


async def run_configs(
    specs: list[ServerSpec], runs: int, fn: Callable[[Session, int], Awaitable[T]]
) -> dict[str, list[T]]:
    """For each spec: a fresh server (so every configuration starts with a cold cache), a warm-up
    request, then `runs` calls of fn(session, run_index). Results by spec label."""
    out: dict[str, list[T]] = {}
    for spec in specs:
        with running_server(spec) as server:
            client = make_client(server.api_url)
            try:
                await warmup(client, server.model_id)
                session = Session(server, client)
                out[spec.label] = await repeat_runs(runs, lambda r, s=session: fn(s, r), desc=spec.label)
            finally:
                await client.close()
    return out
