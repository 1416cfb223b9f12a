"""The real coding agents, as installed from npm (pinned in tests/agents/package.json), headless against
`minivllm serve`, configured exactly as `minivllm launch` configures them: every request of a two-turn
session 2xx, the client exits 0 with its answer printed, and the second turn restores its prompt from the
prefix cache.

The model is a tiny random Qwen2 with the real Qwen tokenizer and chat template and a 32k context
(tests.tiny_model.make_tiny_qwen_tokenizer_model), so the clients' 8-12k-token prompts fit and prefill in
seconds. `.ci/run` installs the clients (`npm install` in tests/agents) and sets MINIVLLM_AGENT_TESTS=required,
so that there a missing client fails instead of skipping.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server import launch
from tests.tiny_model import make_tiny_qwen_tokenizer_model

AGENTS = Path(__file__).parent / "agents" / "node_modules"
MODEL = "qwen-tiny"
CLIENT_TIMEOUT_S = 300
TASK = "Create a file hello.py that prints hello"
FOLLOW_UP = "Now print it"
# the client's executable by (name, version): the npm aliases of tests/agents/package.json
EXECUTABLES = {
    ("claude", "2.1.328"): ["claude-code-2.1.328/bin/claude.exe"],
    ("claude", "2.1.332"): ["claude-code-2.1.332/bin/claude.exe"],
    ("codex", "0.169.0"): ["node", "codex-0.169.0/bin/codex.js"],
    ("codex", "0.171.0"): ["node", "codex-0.171.0/bin/codex.js"],
    ("opencode", "1.18.33"): ["opencode-ai/bin/opencode.exe"],
    ("qwen", "0.24.4"): ["node", "@qwen-code/qwen-code/cli-entry.js"],
}
# each protocol's route, and how opencode (its AI SDK provider) and qwen-code (its --auth-type) reach it
PROTOCOLS = {
    "chat": ("/v1/chat/completions", "@ai-sdk/openai-compatible", "openai"),
    "responses": ("/v1/responses", "@ai-sdk/openai", "openai-responses"),
    "messages": ("/v1/messages", "@ai-sdk/anthropic", "anthropic"),
}


def _executable(name: str, version: str) -> list[str]:
    parts = EXECUTABLES[(name, version)]
    path = AGENTS / parts[-1]
    if not path.exists() or (parts[0] == "node" and shutil.which("node") is None):
        if os.environ.get("MINIVLLM_AGENT_TESTS") == "required":
            pytest.fail(f"{name} {version} is not installed in {AGENTS} (npm install in tests/agents)")
        pytest.skip(f"{name} {version} is not installed (npm install in tests/agents)")
    return [*parts[:-1], str(path)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`minivllm serve` on the tiny Qwen-tokenizer model."""
    from minivllm.models.default_model import default_model_dir

    model = make_tiny_qwen_tokenizer_model(tmp_path_factory.mktemp("tiny-qwen"), default_model_dir())
    port = _free_port()
    env = {
        **os.environ,
        "MINIVLLM_MODEL": str(model),
        "MINIVLLM_MODEL_NAME": MODEL,
        "MINIVLLM_KV_CACHE_BYTES": str(64 << 20),
        "MINIVLLM_MAX_OUTPUT_TOKENS": "64",  # a bound: the random model ends most answers in a few tokens
    }
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    argv = [sys.executable, "-m", "server.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(url, proc, timeout=300)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _statuses(url: str) -> dict[tuple[str, str], float]:
    """minivllm_http_requests_total by (endpoint, status)."""
    text = httpx.get(f"{url}/metrics").text
    pattern = r'minivllm_http_requests_total\{endpoint="([^"]*)",status="(\d+)"\} ([0-9.e+]+)'
    return {(e, s): float(n) for e, s, n in re.findall(pattern, text)}


def _since(before: dict, after: dict) -> dict[tuple[str, str], float]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def _session(url: str, name: str, version: str, turns: list[list[str]], tmp_path: Path) -> list[tuple]:
    """Run the client's turns, configured as `minivllm launch` does (see _run)."""
    served = launch.served_model(url, "unused")
    invocations = [launch.CLIENTS[name].configure(served, args, tmp_path) for args in turns]
    env = invocations[0].env
    return _run(_executable(name, version), [i.argv[1:] for i in invocations], env, tmp_path, url)


def _run(executable: list[str], turns: list[list[str]], env: dict, tmp_path: Path, url: str) -> list[tuple]:
    """Run a client's turns in one throwaway home and working folder; each must exit 0. Returns each
    turn's stdout and the prefix-cache reports of the requests it made."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**os.environ, "HOME": str(home), **env}
    outputs = []
    for args in turns:
        seen = {r["request_id"] for r in _reports(url)}
        argv = [*executable, *args]
        done = subprocess.run(
            argv,
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, (
            f"{argv}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
        outputs.append((done.stdout, [r for r in _reports(url) if r["request_id"] not in seen]))
    return outputs


def _reports(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/cache/explain").json()["data"]


def _check(url: str, before: dict, endpoint: str, turns: list[tuple[str, list[dict]]], restores=True) -> None:
    requests = _since(before, _statuses(url))
    assert requests and all(status.startswith("2") for _, status in requests), requests
    assert requests.get((endpoint, "200"), 0) >= len(turns), requests
    assert all(out.strip() for out, _ in turns), turns  # each turn printed its answer
    if restores:  # the last turn's conversation (its longest prompt; a client may send side requests too)
        _, reports = turns[-1]
        longest = max((r for r in reports if r["endpoint"] == endpoint), key=lambda r: r["prompt_tokens"])
        assert longest["restored_tokens"] >= 0.95 * longest["prompt_tokens"], longest


@pytest.mark.parametrize("version", ["2.1.328", "2.1.332"])
def test_claude_code_completes_a_session(server, version, tmp_path):
    before = _statuses(server)
    outputs = _session(server, "claude", version, [["-p", TASK], ["-p", "-c", FOLLOW_UP]], tmp_path)
    _check(server, before, "/v1/messages", outputs)


@pytest.mark.parametrize("version", ["0.169.0", "0.171.0"])
def test_codex_completes_a_session(server, version, tmp_path):
    before = _statuses(server)
    first = ["exec", "--skip-git-repo-check", TASK]
    resume = ["exec", "--skip-git-repo-check", "resume", "--last", FOLLOW_UP]
    outputs = _session(server, "codex", version, [first, resume], tmp_path)
    _check(server, before, "/v1/responses", outputs)


def test_opencode_completes_a_session_as_launched(server, tmp_path):
    """opencode's defaults ask max_tokens 32000 beside a ~7k-token prompt on a 32k context: clamped."""
    before = _statuses(server)
    outputs = _session(server, "opencode", "1.18.33", [["run", TASK], ["run", "-c", FOLLOW_UP]], tmp_path)
    _check(server, before, "/v1/chat/completions", outputs, restores=False)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_opencode_with_its_default_settings_on_each_protocol(server, protocol, tmp_path):
    endpoint, provider, _ = PROTOCOLS[protocol]
    config = {
        "model": f"local/{MODEL}",
        "provider": {
            "local": {
                "npm": provider,
                "options": {"baseURL": f"{server}/v1", "apiKey": "x"},
                "models": {MODEL: {}},
            }
        },
    }
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    env = {"OPENCODE_CONFIG": str(tmp_path / "opencode.json")}
    before = _statuses(server)
    outputs = _run(_executable("opencode", "1.18.33"), [["run", TASK]], env, tmp_path, server)
    _check(server, before, endpoint, outputs, restores=False)


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_qwen_code_with_its_default_settings_on_each_protocol(server, protocol, tmp_path):
    """qwen-code asks max_tokens 32768 on chat and thinking with a 32000-token budget on Messages."""
    endpoint, _, auth_type = PROTOCOLS[protocol]
    env = {
        "OPENAI_BASE_URL": f"{server}/v1",
        "OPENAI_API_KEY": "x",
        "OPENAI_MODEL": MODEL,
        "ANTHROPIC_BASE_URL": server,
        "ANTHROPIC_API_KEY": "x",
        "ANTHROPIC_MODEL": MODEL,
    }
    before = _statuses(server)
    outputs = _run(
        _executable("qwen", "0.24.4"), [["--auth-type", auth_type, "-p", TASK]], env, tmp_path, server
    )
    _check(server, before, endpoint, outputs, restores=False)


def test_launch_names_the_install_command_for_a_missing_client(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert launch.launch_main(["codex", "exec", "hi"]) == 127
    assert "npm install -g @openai/codex" in capsys.readouterr().err


def test_launch_uses_a_running_server_and_passes_the_arguments_through(server, tmp_path, monkeypatch):
    """`minivllm launch claude ...` with claude on the PATH: the user's arguments reach it, and its
    settings point at the running server."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "claude"
    script.write_text(f'#!/bin/sh\necho "$ANTHROPIC_BASE_URL $ANTHROPIC_MODEL $*" > {tmp_path / "seen"}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(
        launch, "start_server", lambda *a: pytest.fail("started a server beside a running one")
    )
    assert launch.launch_main(["--url", server, "claude", "-p", "hi there"]) == 0
    assert (tmp_path / "seen").read_text().split() == [server, MODEL, "-p", "hi", "there"]
