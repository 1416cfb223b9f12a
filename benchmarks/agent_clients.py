"""The real coding agents on the default model: a three-turn session of Claude Code (`claude -p`, then
`-c`) and of Codex CLI (`codex exec`, then `exec resume --last`), each configured as `minivllm launch`
configures it, against one `minivllm serve`. The task's natural first step is a tool call the client runs
(write a file, read it back, run it).

Per turn: the client's requests (a turn with a tool call makes several: the client sends each result back),
the prompt tokens of its last request and what the prefix cache restored of them, the TTFT of its first
request (arrival to first output, the server's own measure: GET /v1/cache/explain), the turn's wall time, the
client's exit status, and whether the model's tool calls left their trace (the file exists). The clients'
transcripts go beside the results.

    npm install --prefix tests/agents          # the pinned clients
    python -m benchmarks.agent_clients [--model DIR] [--clients claude,codex] [--turns 3]
"""

from __future__ import annotations

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import argparse
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.harness import models, results
from benchmarks.harness.servers import ServerSpec, running_server
from server import launch

AGENTS = results.REPO_ROOT / "tests" / "agents" / "node_modules"
EXECUTABLES = {
    "claude": [str(AGENTS / "claude-code-2.1.332" / "bin" / "claude.exe")],
    "codex": ["node", str(AGENTS / "codex-0.171.0" / "bin" / "codex.js")],
}
TURNS = [
    "Create a file hello.py that prints hello, then read it back to check it.",
    "Add a function greet(name) to hello.py that prints a greeting, and call it.",
    "Run python hello.py and tell me what it printed.",
]
# the clients run their tools without asking (a throwaway folder): a headless session cannot answer prompts
# (Claude Code refuses --dangerously-skip-permissions to root: its file and shell tools are allowed by name)
AUTONOMY = {
    "claude": ["--permission-mode", "acceptEdits", "--allowedTools", "Bash,Read,Write,Edit"],
    "codex": ["--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check"],
}
CLIENT_TIMEOUT_S = 3600


@dataclass
class Turn:
    client: str
    turn: int
    requests: int
    prompt_tokens: int
    restored_tokens: int
    restored_pct: float
    ttft_s: float
    wall_s: float
    exit: int
    file_written: bool


def turn_args(client: str, turn: int, task: str) -> list[str]:
    if client == "claude":
        return [*AUTONOMY[client], "-p", *(["-c"] if turn else []), task]
    resume = ["resume", "--last"] if turn else []
    return ["exec", *AUTONOMY[client], *resume, task]


def reports(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/cache/explain", timeout=30).json()["data"]


def session(url: str, client: str, turns: int, scratch: Path, transcripts: Path) -> list[Turn]:
    home, work = scratch / client / "home", scratch / client / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    served = launch.served_model(url, "unused")
    out = []
    for k, task in enumerate(TURNS[:turns]):
        invocation = launch.CLIENTS[client].configure(served, turn_args(client, k, task), scratch)
        env = {**os.environ, "HOME": str(home), **invocation.env}
        seen = {r["request_id"] for r in reports(url)}
        start = time.monotonic()
        done = subprocess.run(
            [*EXECUTABLES[client], *invocation.argv[1:]],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        wall = time.monotonic() - start
        (transcripts / f"{client}-turn{k + 1}.txt").write_text(
            f"$ {client} {' '.join(invocation.argv[1:])}\n# exit {done.returncode}\n\n"
            f"{done.stdout}\n--- stderr ---\n{done.stderr[-4000:]}"
        )
        new = [r for r in reports(url) if r["request_id"] not in seen]
        first, last = (new[0], new[-1]) if new else ({}, {})
        prompt, restored = last.get("prompt_tokens", 0), last.get("restored_tokens", 0)
        out.append(
            Turn(
                client,
                k + 1,
                len(new),
                prompt,
                restored,
                round(100 * restored / prompt, 1) if prompt else 0.0,
                first.get("ttft_s") or float("nan"),
                round(wall, 1),
                done.returncode,
                (work / "hello.py").exists(),
            )
        )
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the default model)")
    parser.add_argument("--clients", default="claude,codex")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--allow-dirty", action="store_true")
    args = parser.parse_args(argv)
    results.require_clean_tree(args.allow_dirty)
    model = models.resolve_model(args.model)
    clients = {c: EXECUTABLES[c][-1].split("/")[-3] for c in EXECUTABLES}
    meta = results.metadata(model, page_size=16, clients=clients)  # the commit the run starts from
    spec = ServerSpec("minivllm", model, label="agent-clients", startup_timeout_s=1800)
    rows: list[Turn] = []
    transcripts = results.RESULTS_DIR / "agent_clients"
    transcripts.mkdir(parents=True, exist_ok=True)
    with running_server(spec) as server, tempfile.TemporaryDirectory(prefix="agent-clients-") as scratch:
        for client in args.clients.split(","):
            rows += session(server.base_url, client, args.turns, Path(scratch), transcripts)
    notes = (
        "restored_pct: of the turn's last request's prompt; ttft_s: the turn's first request, arrival to first "
        "output (the server's measure); transcripts: benchmarks/results/agent_clients/."
    )
    paths = results.write_results(
        "agent_clients", [asdict(r) for r in rows], meta, notes=notes, allow_dirty=args.allow_dirty
    )
    results.print_report(paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
