"""`minivllm launch claude|codex|opencode [ARGS...]`: a coding agent against this server, in one command.

It uses the server at --url if one answers there, or starts `minivllm serve` (stopped again when the client
exits); then it runs the installed client with exactly the settings it needs, the user's arguments passed
through: the base URL, the served model's id, a key, and the context and output limits the client should
know (so that it compacts before the context fills). Nothing in the user's own client configuration is
written: each client takes these settings from the environment or its command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"
KEY_ENV = "MINIVLLM_LAUNCH_KEY"  # the key a launched client sends (the server's MINIVLLM_API_KEY, or any)
START_TIMEOUT_S = 900.0  # the first start fetches and converts the default model
COMPACT_AT = 0.8  # of the context: where the client should compact its history
REQUEST_TIMEOUT_MS = 3_600_000  # how long a client waits for one answer (a long cold prompt on a CPU)


@dataclass(frozen=True)
class ServedModel:
    url: str  # the server's root, without /v1
    model: str
    context: int
    key: str


@dataclass
class Invocation:
    """How to run one client: its command line and the environment it needs besides the user's."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Client:
    command: str  # the executable
    package: str  # its npm package, for the install hint
    configure: object  # (ServedModel, user args, a scratch folder) -> Invocation


def _claude(served: ServedModel, args: list[str], scratch: Path) -> Invocation:
    """Claude Code over the Messages API: every model role is the served model."""
    env = {
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_API_KEY": served.key,
        "ANTHROPIC_MODEL": served.model,
        "ANTHROPIC_SMALL_FAST_MODEL": served.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": served.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": served.model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry or update checks to other hosts
        # the served model's window: Claude Code assumes 1M tokens for a model it does not know (its own
        # compaction setting takes no window under 100k tokens, so that one is left as it is)
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(served.context),
        # its 600 s request timeout is shorter than a cold ~12k-token first prompt's prefill on a slow CPU
        "API_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
    }
    return Invocation(["claude", *args], env)


def _codex(served: ServedModel, args: list[str], scratch: Path) -> Invocation:
    """Codex CLI over the Responses API, as a model provider given on its command line."""
    provider = f'{{name="minivllm", base_url="{served.url}/v1", wire_api="responses", env_key="{KEY_ENV}"}}'
    overrides = {
        "model": json.dumps(served.model),
        "model_provider": '"minivllm"',
        "model_providers.minivllm": provider,
        "model_context_window": str(served.context),
        "model_auto_compact_token_limit": str(int(served.context * COMPACT_AT)),
    }
    config = [x for key, value in overrides.items() for x in ("-c", f"{key}={value}")]
    return Invocation(["codex", *config, *args], {KEY_ENV: served.key})


def _opencode(served: ServedModel, args: list[str], scratch: Path) -> Invocation:
    """opencode over chat completions, as an OpenAI-compatible provider in a config file of its own."""
    model = {"name": served.model, "limit": {"context": served.context, "output": served.context // 4}}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "model": f"minivllm/{served.model}",
        "provider": {
            "minivllm": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "minivllm",
                "options": {"baseURL": f"{served.url}/v1", "apiKey": f"{{env:{KEY_ENV}}}"},
                "models": {served.model: model},
            }
        },
    }
    path = scratch / "opencode.json"
    path.write_text(json.dumps(config, indent=2))
    return Invocation(["opencode", *args], {"OPENCODE_CONFIG": str(path), KEY_ENV: served.key})


CLIENTS = {
    "claude": Client("claude", "@anthropic-ai/claude-code", _claude),
    "codex": Client("codex", "@openai/codex", _codex),
    "opencode": Client("opencode", "opencode-ai", _opencode),
}


# -- the server ---------------------------------------------------------------------------------------------
def served_model(url: str, key: str, model: str | None = None, timeout: float = 5.0) -> ServedModel | None:
    """The model a running server serves at url (the first, or the one named), or None if none answers."""
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            cards = json.load(response)["data"]
    except (OSError, ValueError, KeyError):
        return None
    card = next((c for c in cards if model in (None, c["id"])), None)
    if card is None:
        raise SystemExit(f"minivllm launch: the server at {url} does not serve {model!r}")
    return ServedModel(url, card["id"], card.get("max_model_len") or 32768, key)


def start_server(url: str, serve_args: list[str], log: Path) -> subprocess.Popen:
    """`minivllm serve` on url's port, in the background (its log in a file)."""
    port = url.rsplit(":", 1)[-1].split("/")[0]
    argv = [sys.executable, "-m", "server.cli", "serve", "--port", port, *serve_args]
    return subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"minivllm launch: the server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"minivllm launch: no healthy server at {url} after {timeout:.0f} s")


# -- the command --------------------------------------------------------------------------------------------
def launch_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="minivllm launch",
        description="run a coding agent against minivllm (the server at --url, or one started for it)",
    )
    parser.add_argument("client", choices=sorted(CLIENTS))
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    parser.add_argument("--model", help="the served model id to use (default: the server's first)")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="an argument for the `minivllm serve` started here"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed to the client as they are")
    ns = parser.parse_args(argv)
    client = CLIENTS[ns.client]
    if shutil.which(client.command) is None:
        print(
            f"minivllm launch: `{client.command}` is not installed; install it with:\n"
            f"  npm install -g {client.package}",
            file=sys.stderr,
        )
        return 127
    url = ns.url.rstrip("/")
    key = os.environ.get("MINIVLLM_API_KEY") or "minivllm"
    server = None
    with tempfile.TemporaryDirectory(prefix="minivllm-launch-") as scratch:
        served = served_model(url, key, ns.model)
        if served is None:
            log = Path(scratch) / "serve.log"
            print(f"minivllm launch: starting minivllm serve at {url} (log: {log})", file=sys.stderr)
            server = start_server(url, ns.serve_arg, log)
            try:
                wait_healthy(url, server)
                served = served_model(url, key, ns.model)
                if served is None:
                    raise SystemExit(f"minivllm launch: the server at {url} refused this key")
            except BaseException:
                server.terminate()
                raise
        try:
            invocation = client.configure(served, ns.args, Path(scratch))
            return subprocess.call(invocation.argv, env={**os.environ, **invocation.env})
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
